"""Paired comparison of two arms run on the same seeds (same data order): the mean paired gain and its 95 %
confidence interval from Student's t distribution, with no dependency beyond the standard library.

For n paired differences dₛ = lossₛ(default) − lossₛ(arm) (positive: the arm is better), the interval is
d̄ ± t₀.₉₇₅,ₙ₋₁ · s / √n with s the sample standard deviation. The t quantile is the root of the two-sided
probability A(t | ν) = P(|T| < t) = 0.95, whose integer-ν series is finite (Abramowitz & Stegun 26.7.3/26.7.4,
θ = atan(t / √ν)):

    ν = 1:         A = 2θ / π
    ν odd > 1:     A = (2/π) [θ + sin θ cos θ (1 + (2/3) cos²θ + … + (2·4·…·(ν−3)) / (1·3·…·(ν−2)) cos^(ν−3) θ)]
    ν even:        A = sin θ (1 + (1/2) cos²θ + … + (1·3·…·(ν−3)) / (2·4·…·(ν−2)) cos^(ν−2) θ)

solved by bisection (A rises with t).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

LEVEL = 0.95


def t_two_sided(t: float, df: int) -> float:
    """A(t | ν) = P(|T| < t) for Student's t with ν = df ≥ 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:  # odd
        if df == 1:
            return 2 * theta / math.pi
        term, total = 1.0, 1.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + s * math.cos(theta) * total)
    term, total = 1.0, 1.0
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def t_quantile(df: int, level: float = LEVEL) -> float:
    """The t with A(t | df) = level (two-sided: t₀.₉₇₅ for level 0.95)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    lo, hi = 0.0, 1.0
    while t_two_sided(hi, df) < level:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


def paired_gain(default: dict[int, float], arm: dict[int, float], level: float = LEVEL) -> dict[str, Any]:
    """The gain default − arm over the seeds both ran: per seed, its mean, sample std and the `level` CI
    (``ci`` [low, high]; None below two seeds), and whether the interval lies above 0 (``pays``) or below it."""
    seeds = sorted(set(default) & set(arm))
    diffs = [default[s] - arm[s] for s in seeds]
    if not diffs:
        return {}
    out: dict[str, Any] = {"seeds": seeds, "per_seed": diffs, "n": len(diffs), "mean": statistics.fmean(diffs)}
    out.update(interval(diffs, level))
    return out


def interval(xs: Sequence[float], level: float = LEVEL) -> dict[str, Any]:
    """Mean ± t · s / √n of a sample (its ``std``, ``half_width``, ``ci``, ``pays``: CI above 0, ``costs``: below)."""
    n = len(xs)
    if n < 2:
        return {"std": None, "half_width": None, "ci": None, "pays": None, "costs": None, "level": level}
    mean, std = statistics.fmean(xs), statistics.stdev(xs)
    half = t_quantile(n - 1, level) * std / math.sqrt(n)
    return {"std": std, "half_width": half, "ci": [mean - half, mean + half], "pays": mean - half > 0,
            "costs": mean + half < 0, "level": level}
