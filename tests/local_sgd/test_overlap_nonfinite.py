"""Issue 10, weakness 4: in overlap mode θ ← θ̄_new + (θ − θ_snap) kept a NaN replica NaN forever; a
replica whose local progress is non-finite must restart from the new anchor at the next sync, as in
at_end mode. One process, one cluster without a federation (its collectives are local)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from edit_train.cluster.group import RankGroup
from edit_train.federation.transport import lighthouse_transport
from edit_train.local_sgd.sync.drivers import OverlapDriver
from edit_train.local_sgd.sync.outer import OuterConfig, OuterState
from edit_train.local_sgd.aggregation.rules import RuleConfig
from edit_train.local_sgd.sync.round import SyncCore, Unit
from edit_train.local_sgd.aggregation.rules import make_rule

EXTRA = [4.0, 0.01, 4.0, 0.0, 4.0]  # local steps, s/step, total steps, stop vote, tokens (round.EXTRA)


class _Overlap:
    """The overlap driver of a lone cluster (its collectives are local)."""

    def __init__(self, driver: OverlapDriver) -> None:
        self.driver, self.done = driver, 0

    def begin(self, sync: int) -> None:
        self.driver.begin(sync, 4, EXTRA)

    def land(self) -> bool:
        before = self.done
        self.driver.poll(block=True)
        return self.done == before + 1 and not self.driver.pending


def _setup(seed: int = 0) -> tuple[nn.Module, _Overlap, OuterState]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    units = [Unit(f"m{i}", m, list(m.parameters())) for i, m in enumerate(model)]
    outer = OuterState({u.name: u.live() for u in units}, OuterConfig(lr=1.0, momentum=0.0, nesterov=False))
    transport = lighthouse_transport("c0", RankGroup(), None)
    transport.form_start(0, {"local_steps": 4})
    core = SyncCore(units, outer, make_rule(RuleConfig()), transport, clip=10.0)
    ov = _Overlap(OverlapDriver(core, lambda _r: None, lambda _r, why: pytest.fail(why)))
    ov.driver.on_complete = lambda _r: setattr(ov, "done", ov.done + 1)
    return model, ov, outer


def _local_step(model: nn.Module, scale: float = 1e-2) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.ones_like(p))


@pytest.mark.parametrize("when", ["before_snapshot", "while_in_flight"])
def test_nonfinite_replica_is_reset_to_the_anchor(when: str) -> None:
    model, ov, outer = _setup()
    _local_step(model)
    with torch.no_grad():
        if when == "before_snapshot":
            model[0].weight[0, 0] = math.nan
    ov.begin(1)
    _local_step(model)  # local progress while the reduction is in flight
    with torch.no_grad():
        if when == "while_in_flight":
            model[0].bias[1] = math.inf
    assert ov.land()
    for p, a in zip(model[0].parameters(), outer.anchors["m0"]):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, a.to(p.dtype), rtol=0, atol=0)  # θ ← θ̄_new, progress dropped
    # the healthy module keeps θ̄_new + its in-flight progress
    for p, a in zip(model[1].parameters(), outer.anchors["m1"]):
        torch.testing.assert_close(p, a + 1e-2, rtol=0, atol=1e-6)
    # and training goes on from a finite replica: the next sync is normal
    _local_step(model)
    ov.begin(2)
    assert ov.land()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_healthy_overlap_carries_the_progress_over_exactly() -> None:
    model, ov, outer = _setup(1)
    _local_step(model)
    snap = [p.detach().clone() for p in model.parameters()]
    ov.begin(1)
    _local_step(model, 3e-2)
    assert ov.land()
    # one group, weight 1, outer SGD lr 1 without momentum: θ̄_new = θ_snap
    anchors = [a for n in ("m0", "m1") for a in outer.anchors[n]]
    for p, s, a in zip(model.parameters(), snap, anchors):
        torch.testing.assert_close(a, s)
        torch.testing.assert_close(p, s + 3e-2)
