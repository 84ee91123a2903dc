"""Step-time distributions: one rank's step, and a cluster's step as the slowest of its ranks.

One rank's step time is a lognormal (median `median_s`, log-σ `sigma`) mixed with a straggler component: with
probability `p_slow` the step takes `slow_factor` times as long (a throttled device, a noisy neighbour, a
retransmit). Draws are independent per rank and step (transient stragglers; a persistently slow cluster is
a cluster with its own distribution). A cluster's step is the **maximum over its n ranks** (FSDP and the
gradient reduce wait for the slowest), whose CDF is F(t)ⁿ: its quantile function is F⁻¹(u^{1/n}), which
makes drawing from it O(1) after a table of quantiles is built once per (distribution, n). That order
statistic is what makes a synchronous step over many accelerators slower than the same step over few.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np

_N01 = NormalDist()
GRID = 2048  # quantile table resolution (midpoints of GRID equal-probability cells)


@dataclass(frozen=True)
class StepDist:
    """One rank's step time: lognormal(median_s, sigma), slowed `slow_factor`× with probability `p_slow`."""

    median_s: float
    sigma: float = 0.0
    p_slow: float = 0.0
    slow_factor: float = 1.0

    def __post_init__(self) -> None:
        if not (self.median_s > 0 and math.isfinite(self.median_s)):
            raise ValueError(f"step time: median_s must be > 0 seconds, got {self.median_s}")
        if self.sigma < 0 or not 0 <= self.p_slow < 1 or self.slow_factor < 1:
            raise ValueError("step time: sigma must be >= 0, p_slow in [0, 1), slow_factor >= 1")

    def scaled(self, factor: float) -> StepDist:
        return StepDist(self.median_s * factor, self.sigma, self.p_slow, self.slow_factor)

    def cdf(self, t: float) -> float:
        if t <= 0:
            return 0.0
        return (1 - self.p_slow) * self._ln_cdf(t) + self.p_slow * self._ln_cdf(t / self.slow_factor)

    def _ln_cdf(self, t: float) -> float:
        if self.sigma == 0:
            return 1.0 if t >= self.median_s else 0.0
        return _N01.cdf((math.log(t) - math.log(self.median_s)) / self.sigma)

    def quantile(self, q: float) -> float:
        """F⁻¹(q) (bisection on log t; exact for the pure lognormal)."""
        q = min(max(q, 1e-12), 1 - 1e-12)
        if self.p_slow == 0:
            return self.median_s * math.exp(self.sigma * _N01.inv_cdf(q)) if self.sigma > 0 else self.median_s
        lo = math.log(self.median_s) - 12 * max(self.sigma, 1e-3)
        hi = math.log(self.median_s * self.slow_factor) + 12 * max(self.sigma, 1e-3)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if self.cdf(math.exp(mid)) < q else (lo, mid)
        return math.exp(0.5 * (lo + hi))

    def max_table(self, n: int) -> np.ndarray:
        """Quantiles of the maximum of `n` independent draws at the GRID cell midpoints."""
        return _table(self, max(int(n), 1))

    def sample_max(self, rng: np.random.Generator, n: int, size: int) -> np.ndarray:
        """`size` draws of the slowest of `n` ranks."""
        if self.sigma == 0 and self.p_slow == 0:
            return np.full(size, self.median_s)
        table = self.max_table(n)
        idx = rng.random(size) * (GRID - 1)
        lo = idx.astype(np.int64)
        frac = idx - lo
        return table[lo] * (1 - frac) + table[np.minimum(lo + 1, GRID - 1)] * frac

    def mean_max(self, n: int) -> float:
        return float(self.max_table(n).mean())

    def std_max(self, n: int) -> float:
        return float(self.max_table(n).std())

    def to_json(self) -> dict[str, float]:
        return asdict(self)


@lru_cache(maxsize=512)
def _table(d: StepDist, n: int) -> np.ndarray:
    u = (np.arange(GRID) + 0.5) / GRID
    q = u ** (1.0 / n)
    if d.p_slow == 0:
        if d.sigma == 0:
            return np.full(GRID, d.median_s)
        z = np.array([_N01.inv_cdf(float(min(max(x, 1e-15), 1 - 1e-15))) for x in q])
        return d.median_s * np.exp(d.sigma * z)
    # mixture: invert the CDF on a fine log grid by interpolation (monotone)
    lo = math.log(d.median_s) - 10 * max(d.sigma, 1e-3)
    hi = math.log(d.median_s * d.slow_factor) + 10 * max(d.sigma, 1e-3)
    logt = np.linspace(lo, hi, 8192)
    if d.sigma > 0:
        cdf = np.array([d.cdf(math.exp(x)) for x in logt])
    else:
        cdf = np.where(logt >= math.log(d.median_s * d.slow_factor), 1.0,
                       np.where(logt >= math.log(d.median_s), 1 - d.p_slow, 0.0))
    cdf = np.maximum.accumulate(cdf + np.linspace(0, 1e-12, cdf.size))
    return np.exp(np.interp(q, cdf, logt))


def fit_max(mean_s: float, std_s: float, n: int, p_slow: float = 0.0, slow_factor: float = 1.0) -> StepDist:
    """The per-rank distribution whose slowest-of-`n` has this mean and standard deviation (lognormal body,
    with an optional fixed straggler component). A cluster measured at one size then predicts another."""
    if mean_s <= 0:
        raise ValueError(f"cannot fit a step time from a mean of {mean_s}")
    cv = max(std_s, 0.0) / mean_s

    def ratio(sigma: float) -> float:
        d = StepDist(1.0, sigma, p_slow, slow_factor)
        return d.std_max(n) / d.mean_max(n)

    lo, hi = 0.0, 2.0
    if cv <= ratio(0.0) + 1e-9:
        sigma = 0.0
    else:
        for _ in range(50):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if ratio(mid) < cv else (lo, mid)
        sigma = 0.5 * (lo + hi)
    unit = StepDist(1.0, sigma, p_slow, slow_factor)
    return StepDist(mean_s / unit.mean_max(n), sigma, p_slow, slow_factor)
