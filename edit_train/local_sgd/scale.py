"""Scale from the first sync: a contribution over `scale_bound` times the quorum's median counts as the median.

Whatever the rule and its warm-up, after it has decided a unit every contributor's norm per √(local step)
(`xᵢ = ‖Δᵢ‖ / √stepsᵢ`: the √steps law of SGD noise, so that A-EDiT's clusters with longer intervals are not
mistaken for liars; the steps claimed are taken at most at the quorum's lower median, so a claim of many
steps buys no headroom, and a cluster faster than the median gains √(its steps / the median's) in x, well
inside the bound for the speed ratios A-EDiT runs) is compared with the lower median of the quorum's. A
contribution above `scale_bound` times it is **clipped to the median** — its weight scaled so that it counts
as a contribution of the median's size in its own direction — not left out. Clipped, because an honest
cluster can be an outlier for an interval (a data shard of other statistics, a loss spike): it still moves
the anchor its way. To the median, not to the bound, because a size over the bound is the one thing about it
the quorum does not vouch for: clipped to the bound, a liar sending a consistent 10× payload (its reports
matching) would still pull `scale_bound` times as hard as an honest cluster at every sync (measured on the
toy federation: +1.4 % / +3.2 % loss with the bound at 2, against ±1.8 % clipped to the median). With two
clusters the lower median is the smaller norm: the larger of two is what is bounded (ties keep what you
have). docs/sync_math.md has the arithmetic.

Norms are the rule's evidence: measured on what was sent when gathered, reported otherwise (a SUM: the
sketch check holds clusters to their reports above `gather_max`). A rule that merges the contributions itself
(`Combiner`) is not bounded here.
"""

from __future__ import annotations

import math

from edit_train.local_sgd.aggregator import Decision, Evidence

SCALE_BOUND = 4.0  # algo.rule.scale_bound's default


def bound_scale(d: Decision, ev: Evidence, multiple: float) -> dict[int, float]:
    """Clip `d` in place: every contributor whose ‖Δ‖/√steps is over `multiple` times the quorum's lower median
    has its weight (and expert weights) scaled by the median / its value. Returns {row: that factor} of the clipped;
    nothing when `multiple` is 0 (off) or fewer than two clusters contribute."""
    rows = [i for i in ev.contributors if math.isfinite(float(ev.norms[i])) and float(ev.steps[i]) > 0]
    if multiple <= 0 or len(rows) < 2:
        return {}
    steps = sorted(float(ev.steps[i]) for i in rows)
    most = steps[(len(steps) - 1) // 2]  # a claim of more local steps than the median's buys no headroom
    x = {i: float(ev.norms[i]) / math.sqrt(min(float(ev.steps[i]), most)) for i in rows}
    ordered = sorted(x.values())
    median = ordered[(len(ordered) - 1) // 2]
    if median <= 0:
        return {}
    clipped = {i: median / v for i, v in x.items() if v > multiple * median and d.weights[i] != 0.0}
    for i, f in clipped.items():
        d.weights[i] *= f
        if d.expert_weights is not None:
            for row in d.expert_weights:
                row[i] *= f
    return clipped
