"""The direction test of the `verified` rule: does a cluster's contribution point where the others' do?

Judged on what was sent, exactly: the pairwise cosines Cᵢⱼ of the gathered contributions come from their
Gram matrix (no sketch, no claim). For unit m, with T the *trusted* contributors (finite, truthful about
their norm, not harmful on the probe, not on probation):

* agreement distance  xᵢ = lower median over j ∈ T, j ≠ i of (1 − Cᵢⱼ) — how far i is from the typical
  other cluster (a minority of bad clusters cannot pull an honest one's median);
* three or more contributors, two or more of them trusted: the excess eᵢ = xᵢ − lower median of x over T
  is tested against the unit's pooled history of accepted excesses (what training does to every cluster
  alike cancels);
* exactly two contributors, both trusted: x is one number for the pair; when it is anomalous against the
  pooled history of pair distances (z above `direction_z`, σ at least a tenth of the mean distance), the one further from the *reference* (an EWMA of the accepted
  aggregates' directions, kept as a count sketch) is flagged; without a reference yet, both are. The
  reference only breaks such ties: when the pair agrees as usual, a cluster that was left out for a while
  (whose direction the reference did not follow) is not held against it;
* exactly two contributors, one trusted and one on probation: the same pair test, and only the one on
  probation can be flagged (so a cluster that keeps sending a wrong direction stays on probation).

Statistics pool every accepted value of the module (one row, `direction_alpha` per value, winsorized at
μ + `direction_z`·σ so that a bad value accepted while the bound is still wide cannot drag it), so a cluster
new to the federation meets a warm test, and a cluster left out cannot bias its own baseline. Flags are never
re-admitted: a lasting disagreement of one cluster with the others is what the test is for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from edit_train.local_sgd.evidence import cosine
from edit_train.local_sgd.penalty_stats import EWMAStats

SIGMA = 0.02  # cosine units: the spread below which two directions are not told apart
PAIR_FLOOR = 0.1  # the pair's σ is at least this fraction of its mean distance
KEYS = ("direction", "pair")  # pooled statistics per module: excesses (3+ trusted), pair distances (2)


@dataclass
class Verdict:
    """Per contributor: flagged, z, bound, agreement (1 − x; NaN without a comparator); and what the pooled
    statistics learn once the decision is known: `(key, values, members)`."""

    flagged: Tensor
    z: Tensor
    bound: Tensor
    agreement: Tensor
    learn: tuple[str, Tensor, list[int]] | None = None


def _lower_median(v: Tensor) -> float:
    v = v[torch.isfinite(v)]
    return float(v.sort().values[(v.numel() - 1) // 2]) if v.numel() else math.nan


def cosines(gram: Tensor) -> Tensor:
    """Pairwise cosines from a Gram matrix (NaN for a non-finite or zero contribution)."""
    g = gram.double()
    d = g.diagonal()
    ok = torch.isfinite(d) & (d > 0)
    s = torch.where(ok, d, torch.ones_like(d)).sqrt()
    c = (g / s[:, None] / s[None, :]).clamp(-1.0, 1.0)
    bad = ~(ok[:, None] & ok[None, :]) | ~torch.isfinite(c)
    return torch.where(bad, torch.full_like(c, math.nan), c)


class DirectionParams(Protocol):
    """The parameters of the direction test (fields of the `verified` rule's config)."""

    anomaly: bool
    warmup_syncs: int
    direction_rate: float  # EWMA rate of the reference direction (accepted aggregates)
    direction_alpha: float  # EWMA rate per accepted value of a unit's pooled statistics
    direction_z: float  # nominal z (agreements have heavier tails than norms)


class DirectionTest:
    def __init__(self, cfg: DirectionParams) -> None:
        self.cfg = cfg
        self.stats: dict[str, EWMAStats] = {}  # "<key>/<unit>" -> one pooled row
        self.refs: dict[str, Tensor] = {}  # unit -> unit-norm reference direction (sketch)

    def _stat(self, key: str, module: str) -> EWMAStats:
        return self.stats.setdefault(f"{key}/{module}", EWMAStats(1, self.cfg.direction_alpha))

    def _test(self, st: EWMAStats, x: Tensor, widen: bool = True, noise: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
        """z = (x − μ)/σ_eff against the Student-t predictive bound of `direction_z` (`widen`), or against
        `direction_z` itself with σ_eff at least a tenth of μ (the pair: one value per sync, too few for a
        t-bound to be useful within a run's first syncs). σ_eff is at least the measurement's own noise."""
        n = x.numel()
        count = int(st.count[0])
        floor = 0.0 if widen else PAIR_FLOOR
        z = st.zscore(x, floor, max(SIGMA, noise)) if count else torch.zeros(n, dtype=torch.float64)
        warm = self.cfg.anomaly and count >= max(self.cfg.warmup_syncs, 2)
        if not warm:
            bound = torch.full((1,), math.inf, dtype=torch.float64)
        elif widen:
            bound = st.threshold(self.cfg.direction_z)
        else:
            bound = torch.full((1,), self.cfg.direction_z, dtype=torch.float64)
        bound = bound.expand(n).clone()
        return torch.isfinite(x) & (z > bound), z, bound

    def judge(self, module: str, gram: Tensor, trusted: Tensor, sketches: list[Tensor] | None,
              suspect: Tensor | None = None, noise: float = 0.0) -> Verdict:
        """The verdict on the contributors whose Gram matrix is `gram` (rows: contributors). `suspect`: those
        on probation — judged, never a comparator (with one trusted other: the pair test, see `_suspect`).
        `noise`: the std of a distance measured from sketches rather than exactly (0: exact)."""
        n = gram.shape[0]
        c = cosines(gram)
        t_idx = [j for j in range(n) if bool(trusted[j]) and math.isfinite(float(c[j, j]))]
        if len(t_idx) == 1 and suspect is not None:
            held = [j for j in range(n) if bool(suspect[j]) and j != t_idx[0] and math.isfinite(float(c[j, j]))]
            if len(held) == 1:
                return self._suspect(module, c, t_idx[0], held[0])
        x = torch.full((n,), math.nan, dtype=torch.float64)
        for i in range(n):
            others = [j for j in t_idx if j != i]
            if others and math.isfinite(float(c[i, i])):
                x[i] = _lower_median(1.0 - c[i, others])
        none = torch.zeros(n, dtype=torch.bool)
        inf = torch.full((n,), math.inf, dtype=torch.float64)
        judged = int(torch.isfinite(x).sum())
        if len(t_idx) >= 3 or (len(t_idx) == 2 and judged >= 3):  # a majority to measure against
            med = _lower_median(x[t_idx])
            e = x - med
            flagged, z, bound = self._test(self._stat("direction", module), e, noise=noise)
            # the median's own excess is 0 by construction (and two trusted share their pair's x): learn the
            # others' only, so that the spread is not understated
            centre = next(j for j in t_idx if float(x[j]) == med)
            learn = [j for j in t_idx if j != centre]
            return Verdict(flagged, z, bound, 1.0 - x, ("direction", e, learn) if len(t_idx) >= 3 else None)
        if len(t_idx) == 2:
            a, b = t_idx
            flagged, z, bound = self._test(self._stat("pair", module), x, widen=False)
            if bool(flagged[a]):  # the pair disagrees unusually: the one further from the reference is off
                ref = self.refs.get(module)
                if ref is not None and sketches is not None:
                    far = a if cosine(sketches[a], ref) < cosine(sketches[b], ref) else b
                    flagged[a if far == b else b] = False
            return Verdict(flagged, z, bound, 1.0 - x, ("pair", x, t_idx))
        return Verdict(none, torch.zeros(n, dtype=torch.float64), inf, 1.0 - x)

    def _suspect(self, module: str, c: Tensor, honest: int, held: int) -> Verdict:
        """Two contributors, one of them on probation: their distance against the pooled pair history flags
        the one on probation only, and nothing is learned. Without this, a cluster on probation in a pair
        went unjudged, was let off the next sync, and was held again the sync after (every other sync in)."""
        n = c.shape[0]
        x = torch.full((n,), math.nan, dtype=torch.float64)
        x[honest] = x[held] = 1.0 - float(c[honest, held])
        flagged, z, bound = self._test(self._stat("pair", module), x, widen=False)
        flagged[honest] = False
        return Verdict(flagged, z, bound, 1.0 - x)

    def learn(self, module: str, verdict: Verdict, accepted: Tensor) -> None:
        """Fold the accepted values into the pooled statistics, one at a time in contributor order (the pair's
        single distance once, when both were accepted)."""
        if verdict.learn is None:
            return
        key, vals, members = verdict.learn
        if key == "pair":
            members = members[:1] if all(bool(accepted[j]) for j in members) else []
        st, one = self._stat(key, module), torch.ones(1, dtype=torch.bool)
        for j in members:
            if bool(accepted[j]) and math.isfinite(float(vals[j])):
                v = vals[j:j + 1]
                if int(st.count[0]) >= 2:  # winsorized: a value accepted under a wide early bound moves the
                    floor = PAIR_FLOOR if key == "pair" else 0.0  # statistics only so far
                    v = torch.minimum(v, st.mu + self.cfg.direction_z * st.sigma_eff(floor, SIGMA))
                st.update(v, one)

    def follow(self, module: str, sketches: list[Tensor] | None, weights: Tensor) -> None:
        """The reference moves toward the accepted aggregate's direction."""
        if sketches is None or not bool((weights > 0).any()):
            return
        agg = sum(float(weights[j]) * sketches[j] for j in range(len(sketches)) if float(weights[j]) > 0)
        norm = float(agg.norm())  # type: ignore[union-attr]
        if not norm > 0 or not math.isfinite(norm):
            return
        direction = agg / norm
        ref = self.refs.get(module)
        a = self.cfg.direction_rate
        ref = direction if ref is None else (1 - a) * ref + a * direction
        self.refs[module] = ref / max(float(ref.norm()), 1e-300)

    def ref_cosine(self, module: str, sketch: Tensor) -> float | None:
        ref = self.refs.get(module)
        return None if ref is None else cosine(sketch, ref)
