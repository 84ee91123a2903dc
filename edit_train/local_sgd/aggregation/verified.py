"""`algo.rule.name=verified` (the default): a cluster's contribution is judged on what it actually sent and
counts only if it demonstrably helps; accepted clusters weigh by the tokens they trained on.

Per unit, a contributing cluster is left out (weight 0) when any of these holds (docs/sync_math.md):

* its contribution is not finite (measured on what it sent; whatever it reported);
* it misreported: the norm it announced differs from the norm of what it sent (lossless links only);
* norm: its per-step norm is anomalously large against its own history (EDiT's test, `penalty.flag`);
* direction: it disagrees with the other clusters — the median of its exact pairwise cosines with the
  trusted others, against the unit's pooled history (`direction.py`; with two clusters, the reference
  direction of past accepted updates tells which of a disagreeing pair is off);
* usefulness: the lower median of at least two other clusters' relative loss change of their probe slice
  under its previous update (θ̄ − Δᵢ against θ̄) was more than `probe_tolerance` above what that cluster's
  accepted updates usually do (`probe_offset`: its own threshold, at most `PROBE_LIE` + the tolerance) — nobody scores its own update, and no
  evaluator decides alone (`evidence.probe_judgement`); sites with their own data make each other's slices
  worse by tens of percent, every sync alike; a harmful update far more, or suddenly;
* probation: at least half of its units were left out of its previous sync as corrupt (direction, non-finite,
  misreported) — or it was on probation then and some unit still was, or most of the units judged so far in this
  sync (at least two) left it out as corrupt — and that update did not demonstrably
  help the others (its probe score was not below −`probe_tolerance`/10, a tenth of the tolerance as an
  improvement): an update that broken is not trusted in any unit of the next sync — small units (norms,
  biases) whose direction is too noisy to judge included. A cluster on probation stays on it while any of its
  units is still flagged: measured at two clusters (benchmarks/false_positives.py), a site training on garbage
  stopped standing out in most units after 6 syncs, was trusted again, and its updates went back into the
  anchor while its first unit was still flagged every sync.

Norm statistics are per cluster name, direction statistics pooled per unit; both learn accepted values
only. Weights (`weighting`): by default the accepted clusters' claimed tokens, each capped at `max_token_ratio` × the
median claim (a cluster cannot buy weight by exaggerating); with `weighting=uniform` every accepted cluster the
same share, whatever it claims (sites whose data is their own: a fast site's tokens would make the anchor its
task's); a left-out cluster's share is a zero update (`left_out`, `token_weights`). With `expert_weights=tokens`, each expert's rows weigh every cluster by that backing spread
over the experts as the cluster routed its tokens (`experts.expert_weights`; the same judgements: a cluster left
out of the unit is left out of every expert).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.aggregator import Capabilities, Decision, Evidence, Needs, nobody, spread
from edit_train.local_sgd.aggregation.direction import KEYS as DIRECTION_KEYS
from edit_train.local_sgd.aggregation.direction import OWN_KEYS as DIRECTION_OWN
from edit_train.local_sgd.aggregation.direction import RETIRED_KEYS as DIRECTION_RETIRED
from edit_train.local_sgd.aggregation.direction import DirectionTest, Verdict, cosines
from edit_train.local_sgd.evidence import PROBE_LIE
from edit_train.local_sgd.moe.experts import expert_weights
from edit_train.local_sgd.penalty import NormTestConfig, check_fields, flag, interval_norm
from edit_train.local_sgd.penalty_stats import ClusterRows, EWMAStats

log = logging.getLogger(__name__)
_TESTS = ("norm", "interval", "probe", *DIRECTION_KEYS)  # "interval": each cluster's reference interval s₀ (its
# steps); "probe": each cluster's accepted probe scores (`probe_offset`)
_OWN = ("norm/", "interval/", "probe/")  # the per-cluster statistics this rule keeps (the rest are the direction test's)
# The usefulness test judges a cluster against its own history: sites with their own data hurt each other's probe
# slices every sync (at the federation's fixed point each site's update points toward its own optimum), by tens of
# percent (benchmarks/false_positives.py: up to +58 % on its four-language sites). A cluster's accepted scores
# (raw: before this offset) learn at PROBE_RATE; once it has PROBE_WARM of them its update is harmful above
# max(mean, 0) + max(`probe_tolerance`, PROBE_Z·σ), at least PROBE_FLOOR (an honest site's harm grows as training
# nears the fixed point: +12-30 % above a quiet history was measured) and at most PROBE_LIE + `probe_tolerance`
# (what an honest site may do; more is harmful whatever its history); before that, above the most. PROBE_WARM was 3:
# under `weighting=uniform` honest four-language sites at 1:3-1:8 scored +0.41 to +0.75 at syncs 5-7 with 3-5
# scores of history (mean ~0, sigma 0.02-0.15: the scores of the first syncs, before the anchor served every
# site, say little of what comes after) and were left out (benchmarks/false_positives.py, 16 decisions in 3 of
# 27 runs); with 6 nothing was. A harmful update above PROBE_LIE + the tolerance is caught from the first score.
PROBE_RATE, PROBE_WARM, PROBE_Z, PROBE_FLOOR = 0.2, 6, 3.0, 0.4
LEFT_OUT = ("zero", "others")  # `left_out`: see VerifiedConfig
EXPERT_WEIGHTS = ("none", "tokens")  # `expert_weights`: see VerifiedConfig
WEIGHTINGS = ("tokens", "uniform")  # `weighting`: see VerifiedConfig


@dataclass
class VerifiedConfig(NormTestConfig):
    """`algo.rule.verified`: EDiT's norm test (inherited) plus the direction and usefulness tests and the
    token weights (docs/sync_math.md)."""

    sketch_dim: int = 1024  # count-sketch buckets per unit (the reference direction; sketched syncs)
    direction_rate: float = 0.3  # EWMA rate of the reference direction (accepted aggregates)
    direction_alpha: float = 0.05  # EWMA rate per accepted value of a unit's pooled direction statistics
    direction_z: float = 4.0  # the direction test's nominal z (agreements have heavier tails than norms)
    # the least rise of a cluster's disagreement above its own history that flags it (cosine units, direction.py):
    # honest sites with their own data swing up to 0.7 (benchmarks/false_positives.py), a sign flip rises ≥ 1.06
    direction_floor: float = 0.5
    probe_tokens: int = 0  # tokens of validation data each cluster scores every update on (0 = no probe)
    probe_tolerance: float = 0.1  # flag an update that raised the others' probe loss by more than this fraction
    retract: bool = True  # take back, one sync late, an admitted update the probe then shows harmful (retract.py)
    report_tolerance: float = 1e-3  # relative gap between a reported and a measured norm that flags a liar
    # a cluster's claimed tokens count up to this many times the median claim: an honest A-EDiT cluster 12 times
    # as fast as the median is not capped (benchmarks/false_positives.py: 8 capped every decision of a 1:12 pair)
    max_token_ratio: float = 16.0
    # what an accepted cluster's share of a step is: "tokens" (its claimed tokens, capped as above: clusters that
    # train one task, where a fast cluster's steps are more of the same progress) or "uniform" (every accepted
    # cluster alike: sites whose data is their own, where the anchor should serve every site's task and not the
    # fastest one's; benchmarks/false_positives.py measured tokens 1.03-1.54x uniform's loss on own-task sites at
    # 1:3-1:12 and 0.28-0.96x where the task is shared). The rule cannot tell the two from the updates (the same
    # benchmark: the pairs' cosines and probe scores overlap at 1:8-1:12): the operator declares it, and it is part
    # of the configuration fingerprint the roster signs.
    weighting: str = "tokens"
    # what a left-out cluster's token share of a unit's step becomes: "zero" (the step is backed by the
    # accepted tokens only and shrinks with them) or "others" (shared among the accepted, as EDiT renormalises)
    left_out: str = "zero"
    # an expert's rows (units with experts): "tokens" weighs each cluster by the tokens it routed to that expert
    # (its token backing spread as it routed them, `experts.expert_weights`), "none" as the rest of the unit
    expert_weights: str = "none"
    # expert_weights=tokens: a cluster that routed fewer tokens than this to an expert sends none of its rows and
    # is no contribution to it (0: every row is sent)
    expert_min_tokens: int = 0
    # expert subsets (SPES-style; "" off): a cluster trains and sends only its experts, the others stay at the
    # anchor on it, and an expert's update comes only from its owners — "split" (expert e is cluster e mod N's)
    # or each cluster's experts as "0+1+2+3|4+5+6+7" (`experts.owned_experts`), or "routed": after
    # `expert_subsets_syncs` committed syncs of every cluster training every expert, each cluster owns the experts it
    # routed the largest share of its tokens to, balanced (`assignment.py`); needs expert_weights=tokens
    expert_subsets: str = ""
    expert_subsets_syncs: int = 4

    def validate(self, rule: str = "verified") -> None:
        super().validate(rule)
        check_fields(self.sketch_dim >= 0 and not self.sketch_dim & (self.sketch_dim - 1), f"{rule}.sketch_dim",
                     f"must be 0 or a power of two, got {self.sketch_dim}")
        check_fields(self.direction_z > 0 and math.isfinite(self.direction_z), f"{rule}.direction_z",
                     f"must be > 0, got {self.direction_z}")
        check_fields(0.0 <= self.direction_floor <= 2.0 and math.isfinite(self.direction_floor),
                     f"{rule}.direction_floor", f"must be in [0, 2] (cosine units), got {self.direction_floor}")
        check_fields(0.0 < self.direction_alpha < 1.0, f"{rule}.direction_alpha",
                     f"must be in (0, 1), got {self.direction_alpha}")
        check_fields(0.0 < self.direction_rate <= 1.0, f"{rule}.direction_rate",
                     f"must be in (0, 1], got {self.direction_rate}")
        check_fields(self.left_out in LEFT_OUT, f"{rule}.left_out", f"must be one of {LEFT_OUT}, got {self.left_out!r}")
        check_fields(self.weighting in WEIGHTINGS, f"{rule}.weighting",
                     f"must be one of {WEIGHTINGS}, got {self.weighting!r}")
        check_fields(self.expert_weights in EXPERT_WEIGHTS, f"{rule}.expert_weights",
                     f"must be one of {EXPERT_WEIGHTS}, got {self.expert_weights!r}")
        check_fields(self.expert_min_tokens >= 0 and (self.expert_min_tokens == 0 or self.expert_weights == "tokens"),
                     f"{rule}.expert_min_tokens", f"must be >= 0, and 0 unless expert_weights=tokens (rows a cluster "
                     f"does not send need weights per expert), got {self.expert_min_tokens}")
        check_fields(not self.expert_subsets or self.expert_weights == "tokens", f"{rule}.expert_subsets",
                     f"needs expert_weights=tokens (an expert's update comes from its owners only, weighed by the "
                     f"tokens each routed to it), got expert_weights={self.expert_weights}")
        check_fields(self.expert_subsets_syncs >= 1, f"{rule}.expert_subsets_syncs",
                     f"must be >= 1 (the syncs the routed map is measured over), got {self.expert_subsets_syncs}")
        check_fields(self.probe_tokens >= 0 and self.max_token_ratio >= 1.0 and self.report_tolerance > 0, rule,
                     ": probe_tokens must be >= 0, max_token_ratio >= 1, report_tolerance > 0")


class VerifiedRule:
    needs = Needs.MEASUREMENTS

    def __init__(self, cfg: VerifiedConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.sketch_dim = cfg.sketch_dim  # the round measures sketches of this size (the reference direction)
        self.clusters = ClusterRows()
        self.stats: dict[str, EWMAStats] = {}  # "norm/<unit>" -> one row per cluster
        self.direction = DirectionTest(cfg)
        self.sync = -1  # the sync being decided (from the evidence), and per cluster its units so far:
        # name -> unit -> left out as corrupt (a unit decided twice — a sketched SUM's provisional and final
        # decision — counts once: its last); every unit of a sync is decided within one step, so a checkpoint
        # falls between syncs and keeps only the counts (`tally`)
        self.units_corrupt: dict[str, dict[str, bool]] = {}
        self.probation: set[str] = set()  # clusters whose previous sync was mostly corrupt
        self.probe_learned = -1  # the sync whose probe scores the typical scores last learned

    def capabilities(self) -> Capabilities:
        """Sketches of `sketch_dim`; the probe, its retraction and the expert options as configured."""
        c = self.cfg
        return Capabilities(sketch_dim=c.sketch_dim, probe_tokens=c.probe_tokens, probe_tolerance=c.probe_tolerance,
                            retract=c.retract, probe_offset=self.probe_offset if c.probe_tokens > 0 else None,
                            # under subsets a cluster reports 0 tokens to others' experts: below 1, not sent
                            expert_min_tokens=max(c.expert_min_tokens, int(bool(c.expert_subsets))),
                            weighs_experts=c.expert_weights != "none", expert_subsets=c.expert_subsets,
                            expert_subsets_syncs=c.expert_subsets_syncs,
                            refuse=self.refuse)

    def refuse(self, clusters: int, gather_max: int, compression: str, experts: int = 0) -> tuple[str, str] | None:
        """Expert-aware merging (`expert_weights=tokens`, experts.py): what a sync can carry with it (`experts`:
        the model's experts, for the subsets' map; 0: not checked)."""
        c, key = self.cfg, "algo.rule.verified"
        if c.expert_weights == "none":
            return None
        if clusters > gather_max:
            return (f"{key}.expert_weights", f"tokens: above sync.gather_max={gather_max} clusters a sync is a SUM "
                    f"checked by sketches, which cannot check weights per expert; raise sync.gather_max to "
                    f"{clusters} or set expert_weights=none")
        if c.expert_min_tokens != 0 and compression != "none":
            return (f"{key}.expert_min_tokens", f"rows a cluster does not send cannot go compressed (error feedback "
                    f"needs every row): set sync.compression=none (now {compression}) or expert_min_tokens=0")
        if c.expert_subsets and compression != "none":
            return (f"{key}.expert_subsets", f"the experts a cluster does not own are not sent, and rows left out "
                    f"cannot go compressed: set sync.compression=none (now {compression})")
        if c.expert_subsets and experts:
            from edit_train.local_sgd.moe.experts import owned_experts

            try:
                owned_experts(c.expert_subsets, 0, clusters, experts)
            except ValueError as exc:
                return f"{key}.expert_subsets", str(exc)
        return None

    def _rows(self, key: str, names: list[str], alpha: float | None = None) -> tuple[EWMAStats, Tensor]:
        grown = self.clusters.add(names)
        for st in self.stats.values() if grown else ():
            st.grow(grown)
        st = self.stats.setdefault(key, EWMAStats(len(self.clusters), self.cfg.ewma_alpha if alpha is None else alpha))
        return st, self.clusters.rows(names)

    def probe_offset(self, names: list[str]) -> Tensor:
        """Each named cluster's offset of its probe score: its threshold (see PROBE_RATE) less `probe_tolerance`,
        so that "the score less the offset is above `probe_tolerance`" is "above the cluster's own threshold"
        (the test here and the retraction, retract.py, both read it so)."""
        tol = self.cfg.probe_tolerance
        st, rows = self._rows("probe/all", names, PROBE_RATE)
        sub = st.select(rows)
        most = PROBE_LIE + tol
        mu = sub.mu.clamp(0.0, PROBE_LIE)
        own = (mu + torch.maximum(PROBE_Z * sub.sigma, torch.full_like(mu, tol))).clamp(min(PROBE_FLOOR, most), most)
        return torch.where(sub.count >= PROBE_WARM, own, torch.full_like(mu, most)) - tol

    def _learn_probe(self, ev: Evidence, idx: list[int], names: list[str], accepted: Tensor) -> None:
        """Once per sync: the scores as measured of the clusters whose previous update is not judged harmful."""
        if "probe_raw" not in ev.extra or self.probe_learned == self.sync:
            return
        self.probe_learned = self.sync
        st, rows = self._rows("probe/all", names, PROBE_RATE)
        sub = st.select(rows)
        raw = torch.as_tensor(ev.extra["probe_raw"], dtype=torch.float64)[idx]
        sub.update(raw, accepted & torch.isfinite(raw))
        st.assign(rows, sub)

    def _new_sync(self, ev: Evidence) -> None:
        """At the first unit of a new sync, the previous sync's tallies decide who is on probation."""
        sync = int(ev.extra["sync"]) if "sync" in ev.extra else self.sync
        if sync == self.sync:
            return
        self.direction.new_sync()
        if sync == self.sync + 1:
            self.probation = {n for n, (judged, corrupt) in self.tally.items()
                              if 2 * corrupt >= judged > 0 or (n in self.probation and corrupt > 0)}
        else:  # a gap (this cluster missed syncs): the others' last sync is not known here
            self.probation = set()
        self.sync, self.units_corrupt = sync, {}

    def decide(self, ev: Evidence) -> Decision:
        self._new_sync(ev)
        idx = ev.contributors
        if not idx:
            return nobody(ev)
        cfg, names = self.cfg, [ev.names[i] for i in idx]
        g = torch.as_tensor(ev.norms, dtype=torch.float64)[idx]
        steps = torch.as_tensor(ev.steps, dtype=torch.float64)[idx]
        st_s, rows_s = self._rows(f"interval/{ev.module}", names)
        sub_s = st_s.select(rows_s)
        x_norm = interval_norm(g, steps, torch.where(sub_s.count > 0, sub_s.mu, torch.zeros_like(sub_s.mu)))
        bad = ~torch.isfinite(g)
        if "finite" in ev.extra:
            bad |= ~ev.extra["finite"].bool()[idx]
        lied = self._misreported(ev, g, idx)
        useless = self._useless(ev, idx)
        self._learn_probe(ev, idx, names, ~(bad | lied | useless))
        key = "probe_raw" if "probe_raw" in ev.extra else "probe"  # what its update did, whatever its history
        probe = torch.as_tensor(ev.extra[key], dtype=torch.float64)[idx] if key in ev.extra else None
        helped = -0.1 * cfg.probe_tolerance  # "demonstrably helped": lowered the others' probe loss this much
        turned = [self._turned(n, ev.module) for n in names]
        held = torch.tensor([(n in self.probation or turned[j]) and not (probe is not None and float(probe[j]) < helped)
                             for j, n in enumerate(names)], dtype=torch.bool)
        flags: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # test -> (flagged, z, bound, readmitted)
        st, rows = self._rows(f"norm/{ev.module}", names)
        sub = st.select(rows)
        flags["norm"] = flag(sub, x_norm, cfg)
        sketches = ev.extra.get("sketches")
        sk = [sketches[i] for i in idx] if sketches is not None else None
        verdict: Verdict | None = None
        if "gram" in ev.extra:
            gram = torch.as_tensor(ev.extra["gram"])[idx][:, idx]
            verdict = self.direction.judge(ev.module, gram, ~(bad | lied | useless | held), sk, held & ~(bad | lied),
                                           noise=float(ev.extra.get("distance_noise", 0.0)), rows=rows)
            flags["direction"] = (verdict.flagged, verdict.z, verdict.bound, torch.zeros_like(bad))
        anomalous = bad | lied | useless | held
        for an, _z, _thr, _readmit in flags.values():
            anomalous = anomalous | an
        sub.update(x_norm, ~anomalous & ~flags["norm"][3])  # statistics learn from accepted values only
        st.assign(rows, sub)
        sub_s.update(steps, ~anomalous)
        st_s.assign(rows_s, sub_s)
        if verdict is not None:
            self.direction.learn(ev.module, verdict, ~anomalous)
        corrupt = bad | lied | (verdict.flagged if verdict is not None else torch.zeros_like(bad))
        for j, n in enumerate(names):
            self.units_corrupt.setdefault(n, {})[ev.module] = bool(corrupt[j]) or turned[j]  # held on: stays held
        w, per_expert = self._weights(ev, idx, anomalous)
        ref_cos = [self.direction.ref_cosine(ev.module, s) for s in sk] if sk is not None else [None] * len(idx)
        self.direction.follow(ev.module, sk, w)
        d = Decision(ev.module, g.tolist(), w.tolist(), anomalous.tolist(), bool(anomalous.all()),
                     self._evidence(ev, idx, flags, (bad, lied, useless, held), verdict, ref_cos), per_expert)
        if log.isEnabledFor(logging.DEBUG):  # EDIT_TRAIN_DEBUG=edit_train.local_sgd.aggregation.verified: every decision
            pair = cosines(torch.as_tensor(ev.extra["gram"])[idx][:, idx]).tolist() if "gram" in ev.extra else None
            log.debug("decision %s: %s", ev.module, {n: {
                "w": round(float(w[j]), 4), "pair": [round(v, 3) for v in pair[j]] if pair else None,
                **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.evidence[j].items()}}
                for j, n in enumerate(names)})
        return spread(d, idx, len(ev.names), torch.as_tensor(ev.norms, dtype=torch.float64))

    @property
    def tally(self) -> dict[str, list[int]]:
        """Per cluster [units judged, units left out as corrupt] so far this sync (what a checkpoint keeps)."""
        return {n: [len(u), sum(u.values())] for n, u in self.units_corrupt.items()}

    def _turned(self, name: str, module: str) -> bool:
        """Within a sync: most of the units judged so far (at least two) left `name` out as corrupt — the rest of
        the sync holds it as probation would. A payload that turned, turned in most units; measured
        (benchmarks/false_positives.py, garbage at eight clusters): a liar let off probation was flagged in the
        three large units of a sync and accepted in the small output layer, where garbage looked like an honest
        site's spike (1 of 14 lying syncs, in about half the runs, by the threads' timing)."""
        seen = [c for unit, c in self.units_corrupt.get(name, {}).items() if unit != module]
        return len(seen) >= 2 and 2 * sum(seen) > len(seen)

    # ------------------------------------------------------------------ the tests
    def _misreported(self, ev: Evidence, g: Tensor, idx: list[int]) -> Tensor:
        """The reported norm against the measured one: gathered, the norm of what was sent (lossless links:
        `report_tolerance`); sketched, the norm of the proven sketch (within the sketch's own precision)."""
        reported = ev.extra.get("reported")
        if reported is None or "finite" not in ev.extra or not bool(ev.extra.get("exact", torch.tensor(True))):
            return torch.zeros(len(idx), dtype=torch.bool)
        r = torch.as_tensor(reported, dtype=torch.float64)[idx]
        tol = self.cfg.report_tolerance
        if "measured_norms" in ev.extra:
            g = torch.as_tensor(ev.extra["measured_norms"], dtype=torch.float64)[idx]
            tol = max(tol, float(ev.extra["measure_tolerance"]))
        gap = (r - g).abs() > tol * torch.maximum(g.abs(), torch.full_like(g, 1e-12))
        return gap & torch.isfinite(g)

    def _useless(self, ev: Evidence, idx: list[int]) -> Tensor:
        probe = ev.extra.get("probe")
        if probe is None:
            return torch.zeros(len(idx), dtype=torch.bool)
        p = torch.as_tensor(probe, dtype=torch.float64)[idx]
        return torch.isfinite(p) & (p > self.cfg.probe_tolerance)

    def _weights(self, ev: Evidence, idx: list[int], anomalous: Tensor) -> tuple[Tensor, list[list[float]] | None]:
        """The unit's weights, and (expert_weights=tokens, a unit with experts) each expert's [E][len(idx)]."""
        cfg = self.cfg
        claims = claimed_tokens(ev, idx) if cfg.weighting == "tokens" else torch.ones(len(idx), dtype=torch.float64)
        w = token_weights(claims, ~anomalous, cfg.max_token_ratio, cfg.left_out)
        if cfg.expert_weights != "tokens" or "expert_tokens" not in ev.extra:
            return w, None
        kept, rejected = token_backing(claims, ~anomalous, cfg.max_token_ratio, cfg.left_out)
        counts = torch.as_tensor(ev.extra["expert_tokens"], dtype=torch.float64)[idx]
        sent = torch.as_tensor(ev.extra["expert_sent"], dtype=torch.bool)[idx] if "expert_sent" in ev.extra \
            else torch.ones_like(counts, dtype=torch.bool)
        return w, expert_weights(counts, sent, kept, rejected).tolist()

    @staticmethod
    def _evidence(ev: Evidence, idx: list[int], flags: dict, hits: tuple[Tensor, Tensor, Tensor, Tensor],
                  verdict: Verdict | None, ref_cos: list[float | None]) -> list[dict[str, Any]]:
        bad = hits[0]
        out = []
        for j, i in enumerate(idx):
            why = [r for r, hit in zip(("non_finite", "misreported", "useless", "probation"), hits) if bool(hit[j])]
            e: dict[str, Any] = {"measured_norm": float(ev.norms[i])}
            for test, (an, z, thr, _) in flags.items():
                e[f"{test}_z"], e[f"{test}_threshold"] = float(z[j]), float(thr[j])
                if bool(an[j]) and not bool(bad[j]):
                    why.append(test)
            if verdict is not None and math.isfinite(float(verdict.agreement[j])):
                e["agreement"] = float(verdict.agreement[j])  # median cosine with the trusted others
            if ref_cos[j] is not None:
                e["cosine"] = ref_cos[j]  # with the reference direction
            for key in ("reported", "probe", "probe_raw"):  # probe: the score less the cluster's offset
                if key in ev.extra:
                    e[key] = float(ev.extra[key][i])
            e["reasons"] = why
            out.append(e)
        return out

    # ------------------------------------------------------------------ state
    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        for key, st in self.direction.stats.items():  # per-cluster rows grow lazily: every roster row is written
            if key.split("/", 1)[0] in DIRECTION_OWN and st.mu.numel() < len(self.clusters):
                st.grow(len(self.clusters) - st.mu.numel())
        stats = {**self.stats, **self.direction.stats}
        tensors = {f"{k}/{f}": getattr(st, f).clone().contiguous() for k, st in stats.items()
                   for f in EWMAStats.FIELDS}
        tensors.update({f"ref/{m}": r.clone().contiguous() for m, r in self.direction.refs.items()})
        return {"roster": list(self.clusters.names), "sync": self.sync, "probation": sorted(self.probation),
                "tally": self.tally, "accused": dict(self.direction.accused)}, tensors

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        roster = [str(n) for n in meta.get("roster", [])]
        stats: dict[str, EWMAStats] = {}
        refs: dict[str, Tensor] = {}
        for key, val in tensors.items():
            if key.startswith("ref/"):
                if val.dim() != 1 or val.numel() != self.sketch_dim:
                    raise ValueError(f"penalty state: {key!r} is not a {self.sketch_dim}-bucket sketch")
                if "#" not in key:  # "<unit>#<row>": a cluster's own past (retired with DIRECTION_RETIRED)
                    refs[key[4:]] = val.detach().cpu().to(torch.float64).clone()
                continue
            test, _, rest = key.partition("/")
            if test in DIRECTION_RETIRED:
                continue
            module, _, fname = rest.rpartition("/")
            rows = 1 if test == "pair" else len(roster)  # the pair's statistics are pooled per unit
            if test == "direction" and val.dim() == 1 and val.shape[0] == 1 < rows:
                val = val.expand(rows).clone()  # written when the excesses were pooled: every cluster from the pool's
            if test not in _TESTS or fname not in EWMAStats.FIELDS or val.dim() != 1 or val.shape[0] != rows:
                raise ValueError(f"penalty state: {key!r} does not fit a roster of {len(roster)} clusters")
            alpha = self.cfg.direction_alpha if test in DIRECTION_KEYS else \
                PROBE_RATE if test == "probe" else self.cfg.ewma_alpha
            st = stats.setdefault(f"{test}/{module}", EWMAStats(rows, alpha))
            setattr(st, fname, val.detach().cpu().to(torch.int64 if fname in ("count", "streak") else torch.float64))
        sync, probation, tally = meta.get("sync", -1), meta.get("probation", []), meta.get("tally", {})
        accused = meta.get("accused", {})  # absent in a state written before the pair's accused (issue 65)
        if not (isinstance(sync, int) and isinstance(probation, list) and isinstance(tally, dict)
                and all(isinstance(t, list) and len(t) == 2 and all(isinstance(v, int) for v in t)
                        for t in tally.values())):
            raise ValueError("penalty state: unreadable probation record")
        if not (isinstance(accused, dict) and all(isinstance(v, int) and 0 <= v < len(roster) for v in accused.values())):
            raise ValueError("penalty state: unreadable record of the pairs' accused clusters")
        self.clusters = ClusterRows(roster)
        self.stats = {k: v for k, v in stats.items() if k.startswith(_OWN)}
        self.direction.stats = {k: v for k, v in stats.items() if not k.startswith(_OWN)}
        self.direction.refs = refs
        self.direction.accused = {str(k): int(v) for k, v in accused.items()}
        self.sync, self.probation = sync, {str(n) for n in probation}
        # the counts stand for the units they counted (a checkpoint falls between syncs: only the counts matter)
        self.units_corrupt = {str(n): {f"#{k}": k < int(t[1]) for k in range(int(t[0]))} for n, t in tally.items()}


def claimed_tokens(ev: Evidence, idx: list[int]) -> Tensor:
    """The tokens contributors `idx` claim to have trained on (their local steps where no claim was sent)."""
    return torch.as_tensor(ev.extra.get("tokens", ev.steps), dtype=torch.float64)[idx]


def token_backing(tokens: Tensor, accepted: Tensor, cap_ratio: float, left_out: str = "zero") -> tuple[Tensor, Tensor]:
    """The tokens behind each contributor's share of a step: (kept, rejected). `kept`: an accepted claim capped at
    `cap_ratio` × the median accepted claim (a cluster cannot buy weight by exaggerating), 0 for the left out;
    `rejected`: what a left-out claim counts in the denominator — `left_out="zero"` at most the median accepted
    claim (its share is a zero update; an untrusted cluster cannot shrink the others' step by exaggerating
    either), `"others"` nothing (its share goes to the accepted, EDiT's renormalisation). Claims that are all
    zero count as one each. Nothing accepted: both zero."""
    t = torch.where(torch.isfinite(tokens), tokens.clamp_min(0.0), torch.zeros_like(tokens))
    if not bool(accepted.any()):
        return torch.zeros_like(t), torch.zeros_like(t)
    if not float(t[accepted].sum()) > 0:
        t = torch.ones_like(t)
    med = float(t[accepted].median())
    kept = torch.where(accepted, t.clamp_max(cap_ratio * med) if med > 0 else t, torch.zeros_like(t))
    if left_out != "zero":
        return kept, torch.zeros_like(t)
    return kept, torch.where(accepted, torch.zeros_like(t), t.clamp_max(med))


def token_weights(tokens: Tensor, accepted: Tensor, cap_ratio: float, left_out: str = "zero") -> Tensor:
    """The accepted contributors' weights from their claimed tokens (`token_backing`): with `left_out="zero"` the
    weights sum to the share of the judged tokens that was accepted, so the step shrinks with the tokens that back
    it (the linear-scaling rule for the outer step; measured in docs/sync_math.md); with `"others"` to 1."""
    kept, rejected = token_backing(tokens, accepted, cap_ratio, left_out)
    if not bool(accepted.any()):
        return kept
    return kept / (float(kept.sum()) + float(rejected.sum()))
