"""Penalty statistics per cluster name over a changing quorum (local_sgd/roster.py)."""

from __future__ import annotations

import torch

from edit_train.local_sgd.penalty import PenaltyConfig, PseudoGradAggregator
from edit_train.local_sgd.roster import RosterAggregator


def _norms(seed: int, n: int) -> torch.Tensor:
    return 1 + 0.05 * torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_full_quorum_matches_the_plain_aggregator() -> None:
    cfg = PenaltyConfig(warmup_syncs=3)
    plain, roster = PseudoGradAggregator(cfg, 3), RosterAggregator(cfg)
    for k in range(20):
        g = _norms(k, 3) * (4.0 if k == 15 else 1.0)
        a = plain.decide("m", g)
        b = roster.decide("m", g, ["a", "b", "c"], [True] * 3)
        assert a.weights == b.weights and a.anomalous == b.anomalous


def test_absent_cluster_keeps_its_statistics_and_returns_to_them() -> None:
    roster = RosterAggregator(PenaltyConfig(warmup_syncs=2))
    for k in range(5):
        roster.decide("m", _norms(k, 2), ["a", "b"], [True, True])
    before = {k: v[1].clone() for k, v in roster.state_tensors().items()}
    for k in range(5, 10):  # b is away
        d = roster.decide("m", _norms(k, 1), ["a"], [True])
        assert d.weights == [1.0]
    after = {k: v[1] for k, v in roster.state_tensors().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    d = roster.decide("m", _norms(11, 2), ["a", "b"], [True, True])
    assert not any(d.anomalous) and abs(sum(d.weights) - 1) < 1e-9


def test_newcomer_and_non_contributor() -> None:
    roster = RosterAggregator(PenaltyConfig())
    roster.decide("m", _norms(0, 2), ["a", "b"], [True, True])
    d = roster.decide("m", torch.tensor([1.0, 0.0, 1.1]), ["a", "b", "c"], [True, False, True])
    assert roster.roster == ["a", "b", "c"]
    assert d.weights[1] == 0.0 and not d.anomalous[1] and abs(d.weights[0] + d.weights[2] - 1) < 1e-9
    nobody = roster.decide("m", torch.zeros(2), ["a", "b"], [False, False])
    assert nobody.all_anomalous and nobody.weights == [0.0, 0.0]


def test_state_round_trip() -> None:
    roster = RosterAggregator(PenaltyConfig())
    roster.decide("m", _norms(0, 2), ["x", "y"], [True, True])
    other = RosterAggregator(PenaltyConfig())
    other.load(list(roster.roster), roster.state_tensors())
    a = roster.decide("m", _norms(1, 2), ["x", "y"], [True, True])
    b = other.decide("m", _norms(1, 2), ["x", "y"], [True, True])
    assert a.weights == b.weights
