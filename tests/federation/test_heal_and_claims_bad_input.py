"""The rest of issue 21's bad-input table as tests (the others live in test_stranger.py, test_tamper.py,
test_parsers.py and test_launchers.py): heal payloads that are well-framed but wrong — NaN or text where a
sync index goes, a NaN anchor, an int8 optimizer state, unknown keys — are a one-line `HealError` (the
healer stays out and retries at the next sync; nobody exits), and a misconfigured cluster is left out alone
(tests/local_sgd/test_claims.py has the rest of the claims rules)."""

from __future__ import annotations

import math

import pytest
import torch

from edit_train.federation.heal import HealError, decode, encode
from edit_train.local_sgd.errors import FederationError, FederationRefused
from edit_train.local_sgd.sync.healing import Healer
from edit_train.local_sgd.aggregation.claims import Terms, vet
from edit_train.local_sgd.protocols import Member, Quorum
from test_heal import _HostileTransport  # delivers what the peer sent (well framed: a key holder's bug)

LOCAL = {"outer/layers.0/anchor/0": (torch.zeros(4, 3), None), "param/layers.0.weight": (torch.zeros(4, 3), None)}
GOOD = {"outer/layers.0/anchor/0": torch.ones(4, 3), "param/layers.0.weight": torch.ones(4, 3),
        "optim/layers.0.weight/exp_avg": torch.zeros(4, 3)}


def _heal(meta: dict, tensors: dict) -> list:
    applied: list = []
    healer = Healer(_HostileTransport(encode(meta, tensors)), lambda: ({}, LOCAL),  # type: ignore[arg-type]
                    lambda m, t: applied.append(m), encode, decode)
    healer.run(Quorum(1, "q", [Member("c0", 9, 1, ""), Member("c1", 1, 1, "")], me=1), rejoining=True)  # a joiner
    return applied


def test_a_good_payload_is_adopted() -> None:
    (meta,) = _heal({"sync_index": 9, "total_steps": 72}, GOOD)
    assert meta["sync_index"] == 9
    assert meta["total_steps"] == 0  # the step a healer adopts is the others' claim (none here), not the source's


@pytest.mark.parametrize(("meta", "tensors", "needle"), [
    ({"sync_index": math.nan}, GOOD, "sync_index is float, not int"),
    ({"sync_index": "abc"}, GOOD, "sync_index is str, not int"),
    ({"total_steps": 10**30}, GOOD, "total_steps = "),
    ({"sync_index": True}, GOOD, "sync_index is bool"),
    ({}, {**GOOD, "outer/layers.0/anchor/0": torch.full((4, 3), math.nan)}, "is not finite"),
    ({}, {**GOOD, "optim/layers.0.weight/exp_avg": torch.zeros(4, 3, dtype=torch.int8)}, "not a floating-point"),
    ({}, {**GOOD, "param/layers.0.weight": torch.zeros(4, 3, dtype=torch.float64)}, "torch.float64"),
    ({}, {**GOOD, "param/evil": torch.zeros(2)}, "unexpected tensor 'param/evil'"),
    ({}, {**GOOD, "param/layers.0.weight": torch.zeros(5, 3)}, "(5, 3)"),
])
def test_a_wrong_payload_is_one_line_and_nothing_is_adopted(meta: dict, tensors: dict, needle: str) -> None:
    with pytest.raises(HealError) as err:
        _heal(meta, tensors)
    msg = str(err.value)
    assert needle in msg and "cluster c0" in msg and "\n" not in msg, msg
    assert isinstance(err.value, FederationError)  # survivable: the sync is skipped, the cluster retries


def _quorum(fps: list[str], syncs: list[int], me: int) -> Quorum:
    return Quorum(1, "q", [Member(f"c{i}", s, 1, "", {"fp": f}) for i, (f, s) in enumerate(zip(fps, syncs))], me)


def test_a_misconfigured_cluster_ahead_is_left_out_and_refuses_itself() -> None:
    """c2 runs another configuration and claims the newest sync: c0 and c1 leave it out (whichever sync it
    claims), it refuses itself (two of three run the other one)."""
    for honest in (0, 1):
        kept, why = vet(_quorum(["a", "a", "b"], [3, 3, 10**9], honest), Terms("a"))
        assert kept.names == ["c0", "c1"] and set(why) == {"c2"} and "another configuration" in why["c2"]
    with pytest.raises(FederationRefused, match="cluster c2 runs another configuration"):
        vet(_quorum(["a", "a", "b"], [3, 3, 10**9], 2), Terms("b"))
