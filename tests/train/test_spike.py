"""Loss-spike guard: tolerate a blip, skip and re-queue a persistent spike, accept a new level."""

from __future__ import annotations

import torch

from edit_train.train.spike import SpikeGuard


def _b(v: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 2), v), torch.full((1, 2), v))]


def test_persistent_spike_skips_and_requeues() -> None:
    g = SpikeGuard(factor=2.0, patience=3, requeue_after=10, warmup=5)
    for s in range(10):
        assert not g.check(1.0, s, _b(s))
    assert not g.check(5.0, 10, _b(10)) and not g.check(5.0, 11, _b(11))  # tolerated
    assert g.check(5.0, 12, _b(12))  # the third consecutive spike: skipped
    assert g.check(5.0, 13, _b(13))
    assert not g.check(1.0, 14, _b(14))  # back to normal
    assert g.skipped == 2 and [due for due, _ in g.queue] == [22, 23]
    assert g.pop_due(21) is None
    assert int(g.pop_due(22)[0][0][0, 0]) == 12
    assert g.mean == 1.0  # spiking losses never entered the running mean


def test_a_new_level_is_accepted_not_skipped_forever() -> None:
    g = SpikeGuard(factor=2.0, patience=2, requeue_after=5, warmup=3)
    for s in range(5):
        g.check(1.0, s, _b(s))
    skips = [g.check(4.0, s, _b(s)) for s in range(5, 20)]
    assert sum(skips) == 4 and not any(skips[6:])
    assert g.mean is not None and g.mean > 2.0


def test_off_and_state_round_trip() -> None:
    assert not SpikeGuard(factor=0.0).check(1e9, 100, _b(0))
    g = SpikeGuard(factor=2.0, patience=1, requeue_after=3, warmup=1)
    g.check(1.0, 0, _b(0))
    g.check(1.0, 1, _b(1))
    assert g.check(9.0, 2, _b(7))
    h = SpikeGuard(factor=2.0, patience=1, requeue_after=3, warmup=1)
    h.load(g.state_json(), g.state_tensors())
    assert h.state_json() == g.state_json() and torch.equal(h.pop_due(5)[0][0], g.pop_due(5)[0][0])
