"""The direction test of the `verified` rule: does a cluster's contribution point where the others' do — as
far as *it* usually does?

Judged on what was sent, exactly: the pairwise cosines Cᵢⱼ of the gathered contributions come from their
Gram matrix (no sketch, no claim). For unit m, with T the *trusted* contributors (finite, truthful about
their norm, not harmful on the probe, not on probation):

* agreement distance  xᵢ = lower median over j ∈ T, j ≠ i of (1 − Cᵢⱼ) — how far i is from the typical
  other cluster (a minority of bad clusters cannot pull an honest one's median);
* three or more contributors, two or more of them trusted: the excess eᵢ = xᵢ − lower median of x over T
  (what training does to every cluster alike cancels) is tested against *cluster i's own* history of accepted
  excesses in the unit: flagged when eᵢ − μᵢ > max(`direction_floor`, `direction_z`·σᵢ);
* exactly two contributors, both trusted: x is one number for the pair; when it is anomalous against the
  pooled history of pair distances (z above `direction_z`, σ at least a tenth of the mean distance), the one
  whose distance to the *reference* — an EWMA of the accepted aggregates' directions, kept as a count sketch:
  the anchor's own path, which every member computes from what it accepted — rose further above *its own*
  history of such distances is flagged, when its rise passes the other's (or 0) by `PAIR_MARGIN`, or, when
  that does not tell them apart, the member the pair test flagged in an earlier unit of the same sync (it
  turned there: a liar's first lying sync is then left out in every unit); otherwise nobody. The reference
  only breaks such ties: when the pair agrees as usual, a cluster that was left out for a while (whose
  direction the reference did not follow) is not held against it. A member once flagged stays the unit's
  accused (`DirectionTest.accused`);
* exactly two contributors, one trusted and one on probation: the pair test, and only the one on probation can
  be flagged (so a cluster that keeps sending a wrong direction stays on probation).

Why each cluster's own history: sites with their own data disagree with the others persistently — at the
federation's fixed point their updates point apart by construction (each toward its own optimum; the sum
cancels) — so a test against the pool of every cluster's values left honest unlike sites out
(benchmarks/false_positives.py: 26 of 320 decisions of a four-language 1:8 federation, with honest excesses
up to 0.7 above the site's own mean). A payload that *turns* is far outside what that cluster sent before: a
sign flip ≥ 1.06, the first syncs of training on garbage ≈ 1. The floor keeps a site whose history is quiet
from being flagged for an ordinary swing. A cluster is judged once its own history holds `warmup_syncs` (at
least 2) accepted values: a cluster new to the federation, or one lying from its first sync, is left to the
norm, report, claims, scale and probe tests until then. Values are learned winsorized at μ + the bound, so a
bad value accepted early cannot drag the history; flags are never re-admitted.
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
# how much further than the other a pair member's distance to the reference must rise above its own history to
# be the one flagged (cosine units). Measured (benchmarks/false_positives.py, seeds 0-2, every two-cluster
# setting): in the 49 honest unit-syncs where the pair test fired, the two rises differed by at most 0.22 (mostly
# both rose together: the pair turned, nobody alone); a sign flip rose 0.5-1.06 above the other, garbage 0.1-0.43.
# The distance to a cluster's *own* past updates, tried before, told them apart in none of the flip's syncs:
# consecutive honest updates in a unit are nearly orthogonal (cosine 0.1-0.3), so a flip hardly moves it
PAIR_MARGIN = 0.3
# A cluster that turned, turned in most of its units: a sign flip rose 1.2-1.7 above its own history in every
# unit, garbage data 1.0-1.1 in every unit at its first lying sync. An honest site with its own data spikes in one
# small unit: measured (benchmarks/false_positives.py, 3 seeds, four and eight sites with shifted inputs) a 132-
# parameter output layer rose 0.53-0.58 over a quiet history (σ 0.03-0.09) while the site's other units rose
# −0.04 to 0.33. So at three or more clusters a rise past the bound flags a unit only when the lower median of the
# cluster's rises in the units judged so far this sync (this one included) is above CORROBORATE × the floor, or
# the rise alone is above ALONE × the floor (no honest rise above 0.70 was measured: a one-unit sign flip is
# still flagged wherever it sits). The lower median of an honest cluster's rises reached 0.27 (eight IID sites at
# 1:12, seed 1: the slowest, 1 step an interval, rose 0.54 in the output layer and 0.21-0.28 in the others — left
# out at a threshold of 0.25); a liar's sits at 1.0 or more, so the threshold is 0.4 (CORROBORATE 0.8 × the floor)
CORROBORATE, ALONE = 0.8, 2.0
# The pair test (two clusters) corroborates the same way, in units of its bound: two honest sites with their own
# data and equal weights (`weighting=uniform`) drift toward opposite directions as the anchor nears the point
# where their pulls cancel, one unit at a time — measured (benchmarks/false_positives.py, four-language sites at
# 1:8, seed 1): one hidden layer's pair distance jumped to 1.37x the bound while the other units stood at
# 0.3-0.7x, and once its faster site was left out, the pair's frozen history kept it out for 14 syncs. A
# payload that turned (a sign flip, garbage) moves the pair's distance in every unit. So a unit's pair
# anomaly flags only when the lower median of the pair's ratios this sync (this unit's included) is above 1, or
# the ratio alone is above PAIR_ALONE
PAIR_ALONE = 2.0
# statistics per module: each cluster's excesses (3+ trusted) and distances to the reference (1 − cosine with
# the EWMA of the accepted aggregates); the pair's distances (2 contributors), pooled
KEYS = ("direction", "reference", "pair")
OWN_KEYS = ("direction", "reference")  # one row per cluster (the pair's: one row)
RETIRED_KEYS = ("self",)  # statistics of distances to a cluster's own past (issue 65's first pair test): read, dropped


@dataclass
class Verdict:
    """Per contributor: flagged, z, bound, agreement (1 − x; NaN without a comparator); and what the pooled
    statistics learn once the decision is known: `(key, values, members)`."""

    flagged: Tensor
    z: Tensor
    bound: Tensor
    agreement: Tensor
    learn: tuple[str, Tensor, list[int]] | None = None
    rows: Tensor | None = None  # the contributors' rows of the per-cluster statistics
    ref: Tensor | None = None  # each contributor's distance to the reference (NaN: none yet)
    accuse: int | None = None  # the row a pair test flagged (it stays the unit's accused: see `accused`)


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
    direction_floor: float  # the least rise above its own history (cosine units) that flags a cluster


class DirectionTest:
    def __init__(self, cfg: DirectionParams) -> None:
        self.cfg = cfg
        self.stats: dict[str, EWMAStats] = {}  # "<key>/<unit>" -> one row per cluster (the pair's: one row)
        self.refs: dict[str, Tensor] = {}  # unit -> unit-norm reference direction (sketch)
        # unit -> the row a two-cluster test flagged there first. From then on a pair test in that unit flags only
        # that row: once a pair member has turned, what it sent since is in the reference at its weight (a garbage
        # site accepted again when it stopped standing out drags the reference toward itself), and the other
        # member's distance to it rises — measured: the honest cluster of a garbage pair flagged in 5 syncs of a
        # unit. This only ever takes a flag away, so it costs an honest pair nothing
        self.accused: dict[str, int] = {}
        self.sync_rises: dict[int, dict[str, float]] = {}  # row -> unit -> its rise above its own history in this
        # sync's units judged so far (`new_sync` clears them; every member judges the units in the same order; a
        # unit decided twice — a sketched SUM's provisional and final decision — counts once)
        self.sync_accused: set[int] = set()  # rows a two-cluster test flagged in a unit of this sync
        self.sync_pair: dict[str, float] = {}  # unit -> the pair test's z over its bound there, this sync

    def _stat(self, key: str, module: str, rows: int = 1) -> EWMAStats:
        """The statistics of `key` for `module` (per cluster: at least `rows` rows, grown empty)."""
        st = self.stats.setdefault(f"{key}/{module}", EWMAStats(rows if key in OWN_KEYS else 1,
                                                                self.cfg.direction_alpha))
        if key in OWN_KEYS and rows > st.mu.numel():
            st.grow(rows - st.mu.numel())
        return st

    def _test(self, st: EWMAStats, x: Tensor, noise: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
        """The pair's pooled test: z = (x − μ)/σ_eff against `direction_z`, σ_eff at least a tenth of μ and at
        least the measurement's own noise."""
        n = x.numel()
        count = int(st.count[0])
        z = st.zscore(x, PAIR_FLOOR, max(SIGMA, noise)) if count else torch.zeros(n, dtype=torch.float64)
        warm = self.cfg.anomaly and count >= max(self.cfg.warmup_syncs, 2)
        bound = torch.full((n,), self.cfg.direction_z if warm else math.inf, dtype=torch.float64)
        return torch.isfinite(x) & (z > bound), z, bound

    def _rise(self, st: EWMAStats, noise: float = 0.0) -> tuple[Tensor, Tensor]:
        """(σ_eff, the largest rise above μ a row lets pass): max(`direction_floor`, `direction_z`·σ_eff), σ_eff
        at least the measurement's noise."""
        sigma = st.sigma_eff(0.0, max(SIGMA, noise))
        return sigma, torch.clamp(self.cfg.direction_z * sigma, min=self.cfg.direction_floor)

    def _own(self, key: str, module: str, x: Tensor, rows: Tensor, noise: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
        """Each contributor against its own history (`rows`): z = (x − μ)/σ_eff, flagged when x − μ passes its
        row's rise (`_rise`) — the bound in z units; a row with fewer than `warmup_syncs` (at least 2) values
        is not judged."""
        st = self._stat(key, module, int(rows.max()) + 1 if rows.numel() else 0).select(rows)
        sigma, rise = self._rise(st, noise)
        diff = x.to(torch.float64) - st.mu
        z = torch.where(st.count > 0, diff / sigma, torch.zeros_like(diff))
        warm = (st.count >= max(self.cfg.warmup_syncs, 2)) & torch.tensor(bool(self.cfg.anomaly))
        bound = torch.where(warm, rise / sigma, torch.full_like(sigma, math.inf))
        return torch.isfinite(x) & (z > bound), z, bound

    def judge(self, module: str, gram: Tensor, trusted: Tensor, sketches: list[Tensor] | None,
              suspect: Tensor | None = None, noise: float = 0.0, rows: Tensor | None = None) -> Verdict:
        """The verdict on the contributors whose Gram matrix is `gram` (rows: contributors). `suspect`: those
        on probation — judged, never a comparator (with one trusted other: the pair test, see `_suspect`).
        `noise`: the std of a distance measured from sketches rather than exactly (0: exact). `rows`: each
        contributor's row of the per-cluster statistics (default: its position)."""
        n = gram.shape[0]
        rows = torch.arange(n) if rows is None else rows
        c = cosines(gram)
        ref = self.refs.get(module)
        dist = torch.tensor([1.0 - cosine(s, ref) for s in sketches], dtype=torch.float64) \
            if sketches is not None and ref is not None else torch.full((n,), math.nan, dtype=torch.float64)
        t_idx = [j for j in range(n) if bool(trusted[j]) and math.isfinite(float(c[j, j]))]
        if len(t_idx) == 1 and suspect is not None:
            held = [j for j in range(n) if bool(suspect[j]) and j != t_idx[0] and math.isfinite(float(c[j, j]))]
            if len(held) == 1:
                v = self._suspect(module, c, t_idx[0], held[0])
                v.rows, v.ref = rows, dist
                v.accuse = int(rows[held[0]]) if bool(v.flagged[held[0]]) else None
                if v.accuse is not None:
                    self.sync_accused.add(v.accuse)
                return v
        x = torch.full((n,), math.nan, dtype=torch.float64)
        for i in range(n):
            others = [j for j in t_idx if j != i]
            if others and math.isfinite(float(c[i, i])):
                x[i] = _lower_median(1.0 - c[i, others])
        none = torch.zeros(n, dtype=torch.bool)
        inf = torch.full((n,), math.inf, dtype=torch.float64)
        judged = int(torch.isfinite(x).sum())
        if len(t_idx) >= 3 or (len(t_idx) == 2 and judged >= 3):  # a majority to measure against
            e = x - _lower_median(x[t_idx])
            flagged, z, bound = self._own("direction", module, e, rows, noise)
            flagged &= self._corroborated(module, e, rows)
            # two trusted share their pair's x: their excesses say nothing of either, nothing is learned
            return Verdict(flagged, z, bound, 1.0 - x, ("direction", e, t_idx) if len(t_idx) >= 3 else None,
                           rows, dist)
        if len(t_idx) == 2:
            a, b = t_idx
            flagged, z, bound = self._test(self._stat("pair", module), x)
            if not self._pair_corroborated(module, float(z[a] / bound[a])):
                flagged[:] = False
            if bool(flagged[a]):  # the pair disagrees unusually: the one whose distance to the reference rose
                # further above its own history, by PAIR_MARGIN more than the other's, is off; otherwise neither
                flagged[:] = False
                far = self._turned(module, dist, rows, a, b)
                if far is None:  # not told apart here: the one flagged in an earlier unit of this sync turned there
                    seen = [j for j in (a, b) if int(rows[j]) in self.sync_accused]
                    far = seen[0] if len(seen) == 1 else None
                if far is not None and self.accused.get(module, int(rows[far])) == int(rows[far]):
                    flagged[far] = True
                    self.sync_accused.add(int(rows[far]))
                    return Verdict(flagged, z, bound, 1.0 - x, ("pair", x, t_idx), rows, dist, int(rows[far]))
            return Verdict(flagged, z, bound, 1.0 - x, ("pair", x, t_idx), rows, dist)
        return Verdict(none, torch.zeros(n, dtype=torch.float64), inf, 1.0 - x, None, rows, dist)

    def new_sync(self) -> None:
        """A new sync's units are about to be judged: the rises and accusations of the last one's are forgotten."""
        self.sync_rises, self.sync_accused, self.sync_pair = {}, set(), {}

    def _pair_corroborated(self, module: str, ratio: float) -> bool:
        """Is a pair's distance in this unit (`ratio`: its z over the bound, 0 while the test warms up) anomalous and
        backed by the pair's other units this sync — the lower median of the ratios so far, this one included, above 1 — or large enough
        alone (above ALONE)? A pair whose members turned apart turned in most units; two honest sites with their
        own data drift apart one unit at a time (see PAIR_ALONE). Records this unit's ratio."""
        ratio = ratio if math.isfinite(ratio) else 0.0
        self.sync_pair[module] = ratio
        seen = torch.tensor(list(self.sync_pair.values()), dtype=torch.float64)
        return ratio > 1.0 and (ratio > PAIR_ALONE or _lower_median(seen) > 1.0)

    def _corroborated(self, module: str, e: Tensor, rows: Tensor) -> Tensor:
        """Per contributor: is a rise past the bound here backed by the cluster's other units this sync (the lower
        median of its rises so far, this one included, above CORROBORATE × `direction_floor`) or large enough
        alone (above ALONE × the floor)? Records this unit's rises of warm rows."""
        st = self._stat("direction", module, int(rows.max()) + 1 if rows.numel() else 0).select(rows)
        warm = st.count >= max(self.cfg.warmup_syncs, 2)
        rise = e.to(torch.float64) - st.mu
        floor = self.cfg.direction_floor
        out = torch.ones(e.numel(), dtype=torch.bool)
        for j in range(e.numel()):
            r = float(rise[j])
            if not (bool(warm[j]) and math.isfinite(r)):
                continue
            seen = self.sync_rises.setdefault(int(rows[j]), {})
            seen[module] = r
            out[j] = r > ALONE * floor or \
                _lower_median(torch.tensor(list(seen.values()), dtype=torch.float64)) > CORROBORATE * floor
        return out

    def _turned(self, module: str, dist: Tensor, rows: Tensor, a: int, b: int) -> int | None:
        """Of a pair whose distance is anomalous, the member that turned away from the anchor's path: its
        distance to the reference rose above its own mean by `PAIR_MARGIN` more than the other's did (a rise
        below 0 counts as 0); None when neither did, or a member's history holds fewer than `warmup_syncs`
        (at least 2) values."""
        st = self._stat("reference", module, int(rows.max()) + 1).select(rows)
        if not self.cfg.anomaly or int(st.count[[a, b]].min()) < max(self.cfg.warmup_syncs, 2):
            return None
        rise = dist - st.mu
        if not (math.isfinite(float(rise[a])) and math.isfinite(float(rise[b]))):
            return None
        far, near = (a, b) if float(rise[a]) >= float(rise[b]) else (b, a)
        return far if float(rise[far]) - max(float(rise[near]), 0.0) > PAIR_MARGIN else None

    def _suspect(self, module: str, c: Tensor, honest: int, held: int) -> Verdict:
        """Two contributors, one of them on probation: their distance against the pooled pair history flags
        the one on probation only, and nothing is learned. Without this, a cluster on probation in a pair
        went unjudged, was let off the next sync, and was held again the sync after (every other sync in)."""
        n = c.shape[0]
        x = torch.full((n,), math.nan, dtype=torch.float64)
        x[honest] = x[held] = 1.0 - float(c[honest, held])
        flagged, z, bound = self._test(self._stat("pair", module), x)
        flagged[honest] = False
        return Verdict(flagged, z, bound, 1.0 - x)

    def learn(self, module: str, verdict: Verdict, accepted: Tensor) -> None:
        """Fold the accepted values in: each contributor's excess and distance to the reference into its own row
        (winsorized at its μ + the bound once the row holds two values); the pair's single distance once into
        the pooled pair row, when both were accepted (winsorized at μ + `direction_z`·σ)."""
        if verdict.rows is not None and verdict.ref is not None:
            self._learn_own("reference", module, verdict.ref, verdict.rows, accepted)
        if verdict.accuse is not None:
            self.accused.setdefault(module, verdict.accuse)
        if verdict.learn is None:
            return
        key, vals, members = verdict.learn
        if key == "direction" and verdict.rows is not None:
            take = torch.zeros(vals.numel(), dtype=torch.bool)
            take[members] = True
            self._learn_own(key, module, vals, verdict.rows, accepted & take)
            return
        if key != "pair" or not all(bool(accepted[j]) for j in members):
            return
        st, v = self._stat("pair", module), vals[members[0]:members[0] + 1]
        if not math.isfinite(float(v)):
            return
        if int(st.count[0]) >= 2:  # a value accepted under a wide early bound moves the statistics only so far
            v = torch.minimum(v, st.mu + self.cfg.direction_z * st.sigma_eff(PAIR_FLOOR, SIGMA))
        st.update(v, torch.ones(1, dtype=torch.bool))

    def _learn_own(self, key: str, module: str, vals: Tensor, rows: Tensor, take: Tensor) -> None:
        take = take.bool() & torch.isfinite(vals)
        if not bool(take.any()):
            return
        st = self._stat(key, module, int(rows.max()) + 1)
        sub = st.select(rows)
        cap = sub.mu + self._rise(sub)[1]
        v = torch.where((sub.count >= 2) & take, torch.minimum(vals.to(torch.float64), cap), vals.to(torch.float64))
        sub.update(torch.where(take, v, torch.zeros_like(v)), take)
        st.assign(rows, sub)

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
