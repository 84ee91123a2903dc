"""The scale bound's statistic (issue 49 (e), local_sgd/aggregation/scale.py): the rule's own norm per local step
(`penalty.interval_norm` at the quorum's lower-median interval), so an honest A-EDiT cluster 12 times as fast as
the other is not clipped at sync 1 (the √steps law of before clipped it: a drift-dominated ‖Δ‖ grows like s), while
a claim of many steps buys at most a factor `scale_bound` of headroom (a norm over scale_bound² times the median's
at the median's interval is clipped, whatever the claim)."""

from __future__ import annotations

import torch

from edit_train.local_sgd.aggregator import Decision, Evidence
from edit_train.local_sgd.aggregation.scale import SCALE_BOUND, bound_scale


def _bound(norms: list[float], steps: list[float], multiple: float = SCALE_BOUND) -> dict[int, float]:
    n = len(norms)
    ev = Evidence("u", tuple(f"c{i}" for i in range(n)), torch.tensor(norms, dtype=torch.float64),
                  torch.tensor(steps, dtype=torch.float64), (True,) * n)
    d = Decision("u", list(norms), [1.0 / n] * n, [False] * n, False)
    return bound_scale(d, ev, multiple)[0]  # the clipped (no hold: spread 0)


def _pseudo_gradient(steps: int, seed: int) -> float:
    """‖anchor − params‖ after `steps` of minibatch SGD on a least-squares problem, from the same anchor (an
    honest cluster's interval, early in training: the drift dominates the noise)."""
    gen = torch.Generator().manual_seed(0)
    a, truth = torch.randn(512, 32, generator=gen, dtype=torch.float64), torch.randn(32, generator=gen,
                                                                                     dtype=torch.float64)
    b = a @ truth + 0.1 * torch.randn(512, generator=gen, dtype=torch.float64)
    anchor = torch.zeros(32, dtype=torch.float64)
    w = anchor.clone()
    batches = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 512, (16,), generator=batches)
        w -= 0.002 * a[idx].T @ (a[idx] @ w - b[idx]) / 16
    return float((anchor - w).norm())


def test_an_honest_1_to_12_pair_is_not_clipped_at_sync_1() -> None:
    slow, fast = _pseudo_gradient(4, seed=1), _pseudo_gradient(48, seed=2)
    assert fast > SCALE_BOUND * slow  # drift-dominated: ‖Δ‖ grows nearly like s (12x the steps, ~11x the norm)
    assert _bound([slow, fast], [4, 48]) == {}
    assert _bound([slow, fast, slow], [4, 48, 4]) == {}
    assert _bound([slow, fast, fast], [4, 48, 48]) == {}


def test_a_consistent_10x_payload_at_the_same_steps_is_clipped_to_the_median() -> None:
    clipped = _bound([1.0, 10.0], [8, 8])
    assert list(clipped) == [1] and abs(clipped[1] - 0.1) < 1e-12
    assert list(_bound([1.0, 1.1, 10.0], [8, 8, 8])) == [2]


def test_a_claim_of_many_steps_buys_at_most_a_factor_scale_bound() -> None:
    b = SCALE_BOUND
    for claim in (8 * b, 1e3, 2.0 ** 53):  # the liar took 8 steps like the others, and claims more
        # just over scale_bound² times the median's norm at the median's interval: clipped, whatever the claim
        assert list(_bound([1.0, 1.0, b * b * 1.01], [8, 8, claim])) == [2]
        assert list(_bound([1.0, b * b * 1.01], [8, claim])) == [1]
        assert list(_bound([1.0, 100.0], [8, claim])) == [1]
    # the headroom it does buy: up to scale_bound² instead of scale_bound at the honest claim
    assert list(_bound([1.0, b * 1.01], [8, 8])) == [1]
    assert _bound([1.0, b * 1.01], [8, 8 * b]) == {}
    # a claim of fewer steps than the median's is not inflated (G / √(s·s₀)), nor a cluster slower than the median
    assert _bound([1.0, 1.0, 0.5], [8, 8, 2]) == {}
