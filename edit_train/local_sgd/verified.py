"""`algo.penalty.rule=verified` (the default): a cluster's contribution is judged on what it actually sent and
counts only if it demonstrably helps; accepted clusters weigh by the tokens they trained on.

Per module, a contributing cluster is left out (weight 0) when any of these holds (docs/sync_math.md):

* its contribution is not finite (measured on what it sent; whatever it reported);
* it misreported: the norm it announced differs from the norm of what it sent (lossless links only);
* norm: its per-step norm is anomalously large against its own history (EDiT's test, `penalty.flag`);
* direction: 1 − cos(its contribution, the reference) is anomalously large against its own history — the
  reference is an EWMA of the accepted aggregates' directions, the same on every cluster, kept as a count
  sketch (`evidence.py`); a regime change shared by most clusters is re-learned, a fault window is not;
* usefulness: the other clusters' median relative loss change of their probe slice under its previous
  update (θ̄ − Δᵢ against θ̄) was above `probe_tolerance` — nobody scores its own update; non-IID data makes
  an honest cluster's own local model a few percent worse on another's slice, a harmful one far more.

Statistics are updated with accepted values only, per cluster name. Weights: the accepted clusters' claimed
tokens, each capped at `max_token_ratio` × the median claim (a cluster cannot buy weight by exaggerating).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.evidence import cosine
from edit_train.local_sgd.penalty import Decision, PenaltyConfig, flag, per_step
from edit_train.local_sgd.penalty_stats import EWMAStats
from edit_train.local_sgd.rules import Evidence, nobody, spread

_TESTS = ("norm", "direction")
DIRECTION_SIGMA = 0.02  # cosine units: the spread below which two directions are not told apart


class VerifiedRule:
    def __init__(self, cfg: PenaltyConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.sketch_dim = cfg.sketch_dim  # the round measures sketches of this size for the direction test
        self._direction_cfg = dataclasses.replace(cfg, z_threshold=cfg.direction_z)
        self.roster: list[str] = []
        self.stats: dict[str, EWMAStats] = {}  # "<test>/<module>" -> one row per roster slot
        self.refs: dict[str, Tensor] = {}  # module -> unit-norm reference direction (sketch)

    def _rows(self, key: str, names: list[str]) -> tuple[EWMAStats, Tensor]:
        new = [n for n in names if n not in self.roster]
        if new:
            self.roster.extend(new)
            for st in self.stats.values():
                st.grow(len(new))
        st = self.stats.setdefault(key, EWMAStats(len(self.roster), self._alpha(key)))
        return st, torch.tensor([self.roster.index(n) for n in names], dtype=torch.long)

    def _alpha(self, key: str) -> float:
        return self.cfg.direction_alpha if key.startswith("direction/") else self.cfg.ewma_alpha

    def decide(self, ev: Evidence) -> Decision:
        idx = ev.contributors
        if not idx:
            return nobody(ev)
        cfg, names = self.cfg, [ev.names[i] for i in idx]
        g = torch.as_tensor(ev.norms, dtype=torch.float64)[idx]
        steps = torch.as_tensor(ev.steps, dtype=torch.float64)[idx]
        x_norm = per_step(g, steps)
        bad = ~torch.isfinite(g)
        if "finite" in ev.extra:
            bad |= ~ev.extra["finite"].bool()[idx]
        lied = self._misreported(ev, g, idx)
        useless = self._useless(ev, idx)
        x_dir = self._directions(ev, idx)
        flags: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # test -> (flagged, z, bound, readmitted)
        pending: dict[str, tuple[EWMAStats, Tensor, EWMAStats, Tensor]] = {}
        for test, x in (("norm", x_norm), ("direction", x_dir)):
            if x is not None:
                st, rows = self._rows(f"{test}/{ev.module}", names)
                sub = st.select(rows)
                # directions: differences of cosines, around 0 (no ratio rescale; σ at least DIRECTION_SIGMA)
                flags[test] = flag(sub, x, self._direction_cfg, DIRECTION_SIGMA, regime=False) \
                    if test == "direction" else flag(sub, x, cfg)
                pending[test] = (st, rows, sub, x)
        anomalous = bad | lied | useless
        for an, _z, _thr, _readmit in flags.values():
            anomalous = anomalous | an
        for test, (st, rows, sub, x) in pending.items():  # statistics learn from accepted values only
            sub.update(x, ~anomalous & ~flags[test][3])
            st.assign(rows, sub)
        w = self._weights(ev, idx, anomalous)
        before = dict(self.refs)  # the reference this decision was judged against
        self._follow(ev, idx, w)
        d = Decision(module=ev.module, norms=g.tolist(), weights=w.tolist(), anomalous=anomalous.tolist(),
                     z=flags["norm"][1].tolist(), all_anomalous=bool(anomalous.all()),
                     threshold=flags["norm"][2].tolist(),
                     evidence=self._evidence(ev, idx, flags, bad, lied, useless, x_dir, before))
        out = spread(d, idx, len(ev.names), torch.as_tensor(ev.norms, dtype=torch.float64))
        out.evidence = [d.evidence[idx.index(i)] if i in idx else {} for i in range(len(ev.names))]
        return out

    # ------------------------------------------------------------------ the tests
    def _misreported(self, ev: Evidence, g: Tensor, idx: list[int]) -> Tensor:
        reported = ev.extra.get("reported")
        if reported is None or "finite" not in ev.extra or not bool(ev.extra.get("exact", torch.tensor(True))):
            return torch.zeros(len(idx), dtype=torch.bool)
        r = torch.as_tensor(reported, dtype=torch.float64)[idx]
        gap = (r - g).abs() > self.cfg.report_tolerance * torch.maximum(g.abs(), torch.full_like(g, 1e-12))
        return gap & torch.isfinite(g)

    def _useless(self, ev: Evidence, idx: list[int]) -> Tensor:
        probe = ev.extra.get("probe")
        if probe is None:
            return torch.zeros(len(idx), dtype=torch.bool)
        p = torch.as_tensor(probe, dtype=torch.float64)[idx]
        return torch.isfinite(p) & (p > self.cfg.probe_tolerance)

    def _directions(self, ev: Evidence, idx: list[int]) -> Tensor | None:
        """Each contributor's distance 1 − cos(contribution, reference) minus the lower median distance of
        this sync (None: no sketch or no reference yet). The shared drift of training (updates grow less
        aligned as the loss flattens) cancels, and a cluster whose statistics froze while it was left out is
        not judged against a past level on its return."""
        sk, ref = ev.extra.get("sketches"), self.refs.get(ev.module)
        if sk is None or ref is None:
            return None
        dist = torch.tensor([1.0 - cosine(sk[i], ref) for i in idx], dtype=torch.float64)
        ok = dist[torch.isfinite(dist)]
        med = float(ok.sort().values[(ok.numel() - 1) // 2]) if ok.numel() else 0.0
        return dist - med

    def _weights(self, ev: Evidence, idx: list[int], anomalous: Tensor) -> Tensor:
        tokens = torch.as_tensor(ev.extra.get("tokens", ev.steps), dtype=torch.float64)[idx]
        tokens = torch.where(torch.isfinite(tokens), tokens.clamp_min(0.0), torch.zeros_like(tokens))
        ok = ~anomalous
        if not bool(ok.any()):
            return torch.zeros(len(idx), dtype=torch.float64)
        cap = self.cfg.max_token_ratio * float(tokens[ok].median())
        t = torch.where(ok, tokens.clamp_max(cap) if cap > 0 else tokens, torch.zeros_like(tokens))
        total = float(t.sum())
        return t / total if total > 0 else ok.double() / float(ok.sum())

    def _follow(self, ev: Evidence, idx: list[int], w: Tensor) -> None:
        """The reference moves toward the accepted aggregate's direction."""
        sk = ev.extra.get("sketches")
        if sk is None or not bool((w > 0).any()):
            return
        agg = sum(float(w[j]) * sk[i] for j, i in enumerate(idx) if float(w[j]) > 0)
        norm = float(agg.norm())  # type: ignore[union-attr]
        if not norm > 0 or not math.isfinite(norm):
            return
        direction = agg / norm
        ref = self.refs.get(ev.module)
        a = self.cfg.direction_rate
        ref = direction if ref is None else (1 - a) * ref + a * direction
        self.refs[ev.module] = ref / max(float(ref.norm()), 1e-300)

    @staticmethod
    def _evidence(ev: Evidence, idx: list[int], flags: dict, bad: Tensor, lied: Tensor, useless: Tensor,
                  x_dir: Tensor | None, refs: dict[str, Tensor]) -> list[dict[str, Any]]:
        out = []
        for j, i in enumerate(idx):
            why = [r for r, hit in (("non_finite", bad[j]), ("misreported", lied[j]), ("useless", useless[j]))
                   if bool(hit)]
            e: dict[str, Any] = {"measured_norm": float(ev.norms[i])}
            for test, (an, z, thr, _) in flags.items():
                e[f"{test}_z"], e[f"{test}_threshold"] = float(z[j]), float(thr[j])
                if bool(an[j]) and not bool(bad[j]):
                    why.append(test)
            if x_dir is not None and "sketches" in ev.extra and ev.module in refs:
                e["cosine"] = cosine(ev.extra["sketches"][i], refs[ev.module])
            for key in ("reported", "probe"):
                if key in ev.extra:
                    e[key] = float(ev.extra[key][i])
            e["reasons"] = why
            out.append(e)
        return out

    # ------------------------------------------------------------------ state
    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        tensors = {f"{k}/{f}": getattr(st, f).clone().contiguous() for k, st in self.stats.items()
                   for f in EWMAStats.FIELDS}
        tensors.update({f"ref/{m}": r.clone().contiguous() for m, r in self.refs.items()})
        return {"roster": list(self.roster)}, tensors

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        roster = [str(n) for n in meta.get("roster", [])]
        stats: dict[str, EWMAStats] = {}
        refs: dict[str, Tensor] = {}
        for key, val in tensors.items():
            if key.startswith("ref/"):
                if val.dim() != 1 or val.numel() != self.sketch_dim:
                    raise ValueError(f"penalty state: {key!r} is not a {self.sketch_dim}-bucket sketch")
                refs[key[4:]] = val.detach().cpu().to(torch.float64).clone()
                continue
            test, _, rest = key.partition("/")
            module, _, fname = rest.rpartition("/")
            if test not in _TESTS or fname not in EWMAStats.FIELDS or val.dim() != 1 or val.shape[0] != len(roster):
                raise ValueError(f"penalty state: {key!r} does not fit a roster of {len(roster)} clusters")
            st = stats.setdefault(f"{test}/{module}", EWMAStats(len(roster), self._alpha(f"{test}/")))
            setattr(st, fname, val.detach().cpu().to(torch.int64 if fname in ("count", "streak") else torch.float64))
        self.roster, self.stats, self.refs = roster, stats, refs
