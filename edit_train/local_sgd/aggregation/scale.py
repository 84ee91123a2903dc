"""Scale from the first sync: a contribution over `scale_bound` times the quorum's median counts as the median.

Whatever the rule and its warm-up, after it has decided a unit every contributor's norm per local step is
compared with the lower median of the quorum's. The statistic is the rule's own (`penalty.interval_norm`, one
law for both): `xᵢ = ‖Δᵢ‖ / sᵢ` for an interval of at least the reference `s₀`, `‖Δᵢ‖ / √(sᵢ·s₀)` for a shorter
one, with `s₀` the quorum's lower-median interval (local steps). An honest ‖Δ‖ grows between √s (noise) and s
(drift), so an A-EDiT cluster that takes 12 times the median's steps in the same seconds — drift-dominated, its
‖Δ‖ 12 times as large — has the median's x, not 12 times it (the √s law of before clipped it at sync 1); a
slower one than the median is not inflated either. **A claim of many steps buys bounded headroom**: the steps
counted are at most `multiple × s₀` (`claimed_steps`), so whatever a member claims, its x is at least
‖Δᵢ‖ / (multiple · s₀), and a contribution over multiple² times the median's norm per step at the median's
interval (multiple · s₀ · multiple · m) is clipped — checked by `test_insiders_scale.py`. The price: an honest
cluster more than multiple² (16) times as fast as the median, drift-dominated, is clipped too. A contribution
above `scale_bound` times the median is **clipped to the median** — its weight scaled so that it counts
as a contribution of the median's size in its own direction — not left out. Clipped, because an honest
cluster can be an outlier for an interval (a data shard of other statistics, a loss spike): it still moves
the anchor its way. To the median, not to the bound, because a size over the bound is the one thing about it
the quorum does not vouch for: clipped to the bound, a liar sending a consistent 10× payload (its reports
matching) would still pull `scale_bound` times as hard as an honest cluster at every sync (measured on the
toy federation: +1.4 % / +3.2 % loss with the bound at 2, against ±1.8 % clipped to the median). With two
clusters the lower medians are the smaller interval and the smaller x: the larger of two is what is bounded
(ties keep what you have). docs/sync_math.md has the arithmetic.

Norms are the rule's evidence: measured on what was sent when gathered, reported otherwise (a SUM: the
sketch check holds clusters to their reports above `gather_max`). A rule that merges the contributions itself
(`Combiner`) is not bounded here.
"""

from __future__ import annotations

import math

import torch

from edit_train.local_sgd.aggregator import Decision, Evidence
from edit_train.local_sgd.penalty import interval_norm

SCALE_BOUND = 4.0  # algo.rule.scale_bound's default


def _lower_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def claimed_steps(steps: list[float], multiple: float) -> tuple[list[float], float]:
    """(the steps the statistic counts, the reference s₀): each claim at most `multiple` times s₀, the lower
    median of the claims — a claim of many steps buys at most that factor of headroom."""
    s0 = _lower_median(steps)
    return [min(s, multiple * s0) for s in steps], s0


def bound_scale(d: Decision, ev: Evidence, multiple: float) -> dict[int, float]:
    """Clip `d` in place: every contributor whose norm per local step (`interval_norm` at the quorum's
    lower-median interval) is over `multiple` times the quorum's lower median has its weight (and expert
    weights) scaled by the median / its value. Returns {row: that factor} of the clipped; nothing when
    `multiple` is 0 (off) or fewer than two clusters contribute."""
    rows = [i for i in ev.contributors if math.isfinite(float(ev.norms[i])) and float(ev.steps[i]) > 0]
    if multiple <= 0 or len(rows) < 2:
        return {}
    steps, s0 = claimed_steps([float(ev.steps[i]) for i in rows], multiple)
    norms = torch.tensor([float(ev.norms[i]) for i in rows], dtype=torch.float64)
    x = dict(zip(rows, interval_norm(norms, steps, torch.full_like(norms, s0)).tolist()))
    median = _lower_median(list(x.values()))
    if median <= 0:
        return {}
    clipped = {i: median / v for i, v in x.items() if v > multiple * median and d.weights[i] != 0.0}
    for i, f in clipped.items():
        d.weights[i] *= f
        if d.expert_weights is not None:
            for row in d.expert_weights:
                row[i] *= f
    return clipped
