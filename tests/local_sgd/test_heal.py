"""Healing payloads are safetensors + JSON; anything else (a pickle above all) is refused unexecuted."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from edit_train.cluster.group import RankGroup
from edit_train.federation.heal import HealError, decode, encode
from edit_train.local_sgd.sync.healing import Healer
from edit_train.local_sgd.protocols import Member, Quorum


class _Boom:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # what an attacker's payload would run on unpickling
        return (os.mkdir, (self.path,))


def test_round_trip() -> None:
    t = {"outer/layers.0/anchor/0": torch.randn(4, 3), "penalty/x/mu": torch.zeros(2, dtype=torch.float64)}
    meta, back = decode(encode({"sync_index": 7}, t))
    assert meta["sync_index"] == 7 and all(torch.equal(t[k], back[k]) for k in t)


def test_pickle_payload_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Boom(str(marker)))
    with pytest.raises(HealError) as err:
        decode(payload, peer="cluster evil")
    assert "pickle" in str(err.value) and "cluster evil" in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("payload", [b"", b"\x00" * 7, b"\xff" * 64, b"\x05\x00\x00\x00\x00\x00\x00\x00{}"])
def test_garbage_is_refused(payload: bytes) -> None:
    with pytest.raises(HealError):
        decode(payload)


class _HostileTransport:
    """The receiving side of a heal over a transport that delivers what a hostile peer sent."""

    name = "c1"
    cluster = RankGroup()

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def recv_bytes(self, src: int, max_bytes: int = 1 << 40) -> bytes:
        return self.payload


def test_healer_refuses_a_pickle_from_a_peer(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    applied = []
    healer = Healer(_HostileTransport(pickle.dumps(_Boom(str(marker)))), lambda: ({}, {}),  # type: ignore[arg-type]
                    lambda meta, tensors: applied.append(meta), encode, decode)
    q = Quorum(1, "q", [Member("c0", 3, 1, ""), Member("c1", 1, 1, "")], me=1)
    with pytest.raises(HealError, match="pickle"):
        healer.run(q)
    assert not applied and not marker.exists()


def test_shard_takes_this_ranks_fsdp_shard() -> None:
    full = torch.arange(10.0).reshape(5, 2)
    assert torch.equal(RankGroup(None, 0, 2).shard(full, torch.empty(3, 2)), full[:3])
    assert torch.equal(RankGroup(None, 1, 2).shard(full, torch.empty(2, 2)), full[3:])
    with pytest.raises(ValueError, match="does not shard"):
        RankGroup(None, 0, 2).shard(full, torch.empty(4, 2))
