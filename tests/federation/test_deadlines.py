"""No wait without an end (issue 21): a store that accepts and stays silent, a Lighthouse (or a peer) that
never answers, a cluster leader that stalled or died — each wait ends within its configured deadline, with
one line that names what never came."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from edit_train.cluster.group import RankGroup
from edit_train.federation.forming import Forming
from edit_train.federation.lanes import BoundGloo, Lanes
from edit_train.federation.link import LinkClock
from edit_train.local_sgd.errors import ClusterError, FederationError
from edit_train.local_sgd.protocols import Member, Quorum
from mp_utils import free_port
from silent_listener import silent_listener


@pytest.fixture
def silent_store():  # type: ignore[no-untyped-def]
    """A TCP server that accepts every connection and never says a word."""
    with silent_listener() as addr:
        yield addr


def _issued(store: str) -> dict:
    q = Quorum(7, "n" * 32, [Member("a", 3, 1, store), Member("b", 3, 1, store)], me=1)
    return {"ok": True, "m": q.to_json()}


def _forming(ask, connect, lanes: Lanes, deadlines: tuple[float, float]) -> Forming:  # type: ignore[no-untyped-def]
    return Forming(RankGroup(), LinkClock(None), ask, connect, lanes.abort, deadlines=deadlines)


@pytest.mark.parametrize("block", [True, False])
def test_lanes_to_a_silent_store_give_up_at_their_deadline(silent_store: str, block: bool) -> None:
    lanes = Lanes(lambda: BoundGloo("127.0.0.1", datetime.timedelta(seconds=120)))  # gloo alone would wait 120 s
    forming = _forming(lambda: _issued(silent_store), lambda q: lanes.configure(q, 0, 1, 1) or True, lanes,
                       deadlines=(10.0, 2.0))
    t0 = time.monotonic()
    with pytest.raises(FederationError) as err:
        while not forming.poll(block=block):
            time.sleep(0.05)
    took = time.monotonic() - t0
    assert took < 2.0 + 3.0, took
    msg = str(err.value)
    assert "every peer of quorum 7 to connect its lanes did not come within 2 s" in msg and "\n" not in msg
    assert not lanes.groups  # nothing half-connected is left behind


@pytest.mark.parametrize("block", [True, False])
def test_a_lighthouse_that_never_answers_is_given_up_at_the_deadline(block: bool) -> None:
    never = threading.Event()
    lanes = Lanes(lambda: None)
    forming = _forming(lambda: never.wait() and {}, lambda q: True, lanes, deadlines=(1.5, 5.0))
    t0 = time.monotonic()
    with pytest.raises(FederationError, match="the Lighthouse's answer .* did not come within 1.5 s"):
        while not forming.poll(block=block):
            time.sleep(0.05)
    assert time.monotonic() - t0 < 1.5 + 2.0
    never.set()


def _cluster_rank(rank: int, port: int, out: str, leader: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3))
    group = RankGroup(dist.group.WORLD, rank, 2, timeout_s=3.0)
    group.agree(True)  # both are up
    if rank == 0:
        if leader == "died":
            os._exit(0)  # noqa: SLF001 - the leader's process vanishes
        time.sleep(12)  # stalled: never reaches the broadcast
        os._exit(0)
    t0 = time.monotonic()
    try:
        group.broadcast_json(None)
        result = {"error": None}
    except ClusterError as exc:
        result = {"error": str(exc)}
    result["took"] = time.monotonic() - t0
    Path(out).write_text(json.dumps(result))
    os._exit(0)


@pytest.mark.parametrize("leader", ["stalled", "died"])
def test_a_cluster_whose_leader_stalled_or_died_stops_waiting_at_cluster_timeout(leader: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "rank1.json")
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_cluster_rank, args=(r, port, out, leader)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
        result = json.loads(Path(out).read_text())
    assert result["error"] is not None and result["took"] < 3.0 + 4.0, result
    msg = result["error"]
    assert "cluster broadcast across 2 ranks did not complete within 3 s (cluster.timeout_s)" in msg, msg
    assert "its leader (rank 0) died or stalled" in msg and "\n" not in msg
