"""Per-cluster statistics of the per-step pseudo-gradient norms and the Student-t predictive bound used by
the anomaly test of :mod:`edit_train.local_sgd.penalty` (pure math; exact formulas in docs/sync_math.md)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["EWMAStats", "t_quantile"]


# ----------------------------------------------------------------------------- Student-t predictive bound
def _t_sf(t: float, nu: int) -> float:
    """P(T > t) for Student's t with integer ``nu`` >= 1 dof and t >= 0 (closed-form finite series)."""
    theta = math.atan(t / math.sqrt(nu))
    s, c = math.sin(theta), math.cos(theta)
    total, coef = 0.0, 1.0
    if nu % 2:  # odd: A = (2/π)(θ + s·Σ_{k=1,3,..,ν-2} coef_k c^k)
        k, cp = 1, c
        while k <= nu - 2:
            total += coef * cp
            coef *= (k + 1) / (k + 2)
            cp *= c * c
            k += 2
        a = 2.0 / math.pi * (theta + s * total)
    else:  # even: A = s·Σ_{k=0,2,..,ν-2} coef_k c^k
        k, cp = 0, 1.0
        while k <= nu - 2:
            total += coef * cp
            coef *= (k + 1) / (k + 2)
            cp *= c * c
            k += 2
        a = s * total
    return max(0.0, (1.0 - a) / 2.0)


@lru_cache(maxsize=4096)
def t_quantile(p_tail: float, nu: int) -> float:
    """t with P(T > t) = p_tail (bisection on :func:`_t_sf`; ``nu`` is capped at 1000 ≈ normal)."""
    nu = max(1, min(int(nu), 1000))
    lo, hi = 0.0, 1.0
    while _t_sf(hi, nu) > p_tail:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_sf(mid, nu) > p_tail:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return hi


class EWMAStats:
    """Weighted mean/variance of the per-step norms ``x`` for one unit, vectorised over clusters (float64).

    The n-th accepted value enters with rate ``a = max(α, 1/n)``: ``d = x − μ; μ ← μ + a·d;
    S ← (1 − a)(S + a·d²)``. ``S`` is the weighted (population) second moment; with ``W2 = Σ wⱼ²`` of the
    normalised weights (``1/n`` while ``a = 1/n``, then ``W2 ← (1−α)²W2 + α²``) the unbiased variance is
    ``S/(1 − W2)`` (reliability weights), i.e. the sample variance for the first values and the unbiased
    EWMA variance afterwards. ``W2`` depends on ``count`` only, so it is not stored. A per-cluster streak
    (count, mean, S) of consecutive flagged values supports re-admission after a lasting shift."""

    def __init__(self, num_clusters: int, alpha: float) -> None:
        self.alpha = float(alpha)
        z = torch.zeros(num_clusters, dtype=torch.float64)
        self.mu, self.m2 = z.clone(), z.clone()
        self.count = torch.zeros(num_clusters, dtype=torch.int64)
        self.streak = torch.zeros(num_clusters, dtype=torch.int64)
        self.streak_mu, self.streak_m2 = z.clone(), z.clone()
        m = max(1, int(1.0 / self.alpha))  # last n with 1/n >= α (the update's own comparison)
        while 1.0 / (m + 1) >= self.alpha:
            m += 1
        while m > 1 and 1.0 / m < self.alpha:
            m -= 1
        self._m = m

    FIELDS = ("mu", "m2", "count", "streak", "streak_mu", "streak_m2")

    def select(self, rows: Tensor) -> EWMAStats:
        """The statistics of the clusters ``rows`` (a copy), e.g. the clusters of one sync."""
        sub = EWMAStats(rows.numel(), self.alpha)
        for f in self.FIELDS:
            setattr(sub, f, getattr(self, f).index_select(0, rows).clone())
        return sub

    def assign(self, rows: Tensor, sub: EWMAStats) -> None:
        """Write ``sub`` (from :meth:`select`, then updated) back into the rows it came from."""
        for f in self.FIELDS:
            full = getattr(self, f).clone()
            full[rows] = getattr(sub, f)
            setattr(self, f, full)

    def grow(self, n: int) -> None:
        """Add ``n`` clusters with empty statistics (clusters seen for the first time)."""
        for f in self.FIELDS:
            val = getattr(self, f)
            setattr(self, f, torch.cat([val, torch.zeros(n, dtype=val.dtype)]))

    @property
    def w2(self) -> Tensor:
        """``Σ wⱼ²`` of the normalised weights of the values in the statistics (1 when count ≤ 1)."""
        n = self.count.to(torch.float64).clamp_min(1.0)
        a, m = self.alpha, self._m
        ss = a / (2.0 - a)
        late = ss + (1.0 / m - ss) * (1.0 - a) ** (2.0 * (n - m).clamp_min(0.0))
        return torch.where(n <= m, 1.0 / n, late)

    @property
    def var(self) -> Tensor:
        """Unbiased variance ``S/(1 − W2)`` (0 with fewer than 2 values)."""
        denom = (1.0 - self.w2).clamp_min(1e-300)
        return torch.where(self.count >= 2, self.m2.clamp_min(0.0) / denom, torch.zeros_like(self.m2))

    @property
    def sigma(self) -> Tensor:
        return self.var.sqrt()

    def sigma_eff(self, floor: float, floor_abs: float = 0.0) -> Tensor:
        """``max(σ, floor·|μ|, floor_abs)``: a near-constant history cannot make σ ~ 0."""
        return torch.maximum(torch.maximum(self.sigma, floor * self.mu.abs()), torch.full_like(self.mu, floor_abs))

    def zscore(self, x: Tensor, floor: float = 0.0, floor_abs: float = 0.0) -> Tensor:
        """``(x − μ)/σ_eff``; with σ_eff == 0: 0 if x == μ, ±inf otherwise (NaN stays NaN)."""
        x = x.to(torch.float64)
        d = x - self.mu
        sigma = self.sigma_eff(floor, floor_abs)
        z = d / torch.where(sigma > 0, sigma, torch.ones_like(sigma))
        inf = torch.full_like(d, math.inf)
        flat = torch.where(d > 0, inf, torch.where(d < 0, -inf, torch.where(d == 0, 0.0, d)))
        return torch.where(sigma > 0, z, flat)

    def threshold(self, z_nominal: float) -> Tensor:
        """Per-cluster predictive bound: the Student-t quantile with ``ν = ⌊1/W2⌋ − 1`` dof at the tail
        probability of ``z_nominal`` under N(0,1), times ``√(1 + W2)`` (the new value is not in μ)."""
        p = 0.5 * math.erfc(z_nominal / math.sqrt(2.0))
        w2 = self.w2
        out = []
        for w in w2.tolist():
            nu = int(math.floor(1.0 / w + 1e-9)) - 1
            out.append(t_quantile(p, nu) * math.sqrt(1.0 + w) if nu >= 1 else math.inf)
        return torch.tensor(out, dtype=torch.float64)

    def update(self, x: Tensor, accept: Tensor) -> None:
        """Fold ``x[i]`` into cluster i's statistics where ``accept[i]`` (non-finite never accepted)."""
        x = x.to(torch.float64)
        accept = accept.bool() & torch.isfinite(x)
        a = torch.maximum(torch.full_like(x, self.alpha), 1.0 / (self.count.to(torch.float64) + 1.0))
        xs = torch.where(accept, x, self.mu)  # keep NaN out of the arithmetic
        d = xs - self.mu
        self.mu = torch.where(accept, self.mu + a * d, self.mu)  # a = 1 for the first value: μ = x, S = 0
        self.m2 = torch.where(accept, (1.0 - a) * (self.m2 + a * d * d), self.m2)
        self.count = self.count + accept.to(torch.int64)

    def rescale(self, c: float) -> None:
        """A regime change by factor ``c`` shared by the module: μ ← c·μ, S ← c²·S (streaks too)."""
        self.mu, self.m2 = self.mu * c, self.m2 * (c * c)
        self.streak_mu, self.streak_m2 = self.streak_mu * c, self.streak_m2 * (c * c)

    def reset(self) -> None:
        """Forget everything (the previous level carries no information, e.g. μ = 0)."""
        self.__init__(self.mu.numel(), self.alpha)  # type: ignore[misc]

    def track_streak(self, x: Tensor, flagged: Tensor) -> None:
        """Plain running mean/S of each cluster's current run of consecutive flagged (finite) values."""
        x = x.to(torch.float64)
        n = torch.where(flagged, self.streak + 1, torch.zeros_like(self.streak))
        a = 1.0 / n.to(torch.float64).clamp_min(1.0)
        d = torch.where(flagged, x, self.streak_mu) - self.streak_mu
        zero = torch.zeros_like(self.streak_mu)
        self.streak_mu = torch.where(flagged, self.streak_mu + a * d, zero)
        self.streak_m2 = torch.where(flagged, (1.0 - a) * (self.streak_m2 + a * d * d), zero)
        self.streak = n

    def rebase(self, which: Tensor) -> None:
        """Clusters ``which`` adopt their streak as their statistics (the new level) and clear it."""
        self.mu = torch.where(which, self.streak_mu, self.mu)
        self.m2 = torch.where(which, self.streak_m2, self.m2)
        self.count = torch.where(which, self.streak, self.count)
        zero = torch.zeros_like(self.streak_mu)
        self.streak = torch.where(which, torch.zeros_like(self.streak), self.streak)
        self.streak_mu = torch.where(which, zero, self.streak_mu)
        self.streak_m2 = torch.where(which, zero, self.streak_m2)


class ClusterRows:
    """Which row of per-cluster statistics is whose: cluster names in order of first appearance (the same on
    every cluster, because a cluster that missed a quorum heals the rule's state before it takes part again)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.names: list[str] = []
        self._row: dict[str, int] = {}
        self.add(names)

    def add(self, names: Iterable[str]) -> int:
        """Give every new name a row; returns how many were new (the statistics grow by that many rows)."""
        new = [n for n in dict.fromkeys(names) if n not in self._row]
        for n in new:
            self._row[n] = len(self.names)
            self.names.append(n)
        return len(new)

    def rows(self, names: Iterable[str]) -> Tensor:
        return torch.tensor([self._row[n] for n in names], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.names)
