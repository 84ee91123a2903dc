"""Issue 49 (b): a lane's silent store. The lanes of a quorum rendezvous in its first member's store (the address
its signed member record names, federation/lanes.py). A member that names a store which accepts connections and
never answers — torch's TCPStore client would wait for its handshake for ever — must not stall the honest
clusters beyond the documented deadline (`federation.collective_timeout_s`): the first sync it hosts is lost
within the store probe's time (at most that deadline), the honest clusters leave it out of the next quorums,
name it with its roster key, and go on among themselves.

Real gloo lanes and real TCPStores on 127.0.0.1, a real gate with a roster; the liar is `c0` (its name sorts
first, so it hosts every quorum's rendezvous) and its store address is a TCP listener that accepts and stays
silent."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edit_train.cluster.group import RankGroup
from edit_train.cluster.mesh import bound_store
from edit_train.federation.lanes import BoundGloo, Lanes, store_answers
from edit_train.federation.transport import LaneTransport
from silent_listener import silent_listener
from liar_utils import KEY, SYNCS, TOTAL, GateRun, run_threads, toy_config
from toy_federation import Outcome, train_cluster

DEADLINE_S = 4.0  # federation.collective_timeout_s of every cluster here


@pytest.fixture
def silent() -> Iterator[str]:
    """A TCP listener on 127.0.0.1 that accepts every connection and never sends a byte."""
    with silent_listener() as addr:
        yield addr


def _transport(run: GateRun, name: str, store_addr: str | None = None) -> LaneTransport:
    timeout = datetime.timedelta(seconds=DEADLINE_S)
    store = bound_store("127.0.0.1", 0, 1, True, timeout)
    return LaneTransport(name, RankGroup(), Lanes(lambda: BoundGloo("127.0.0.1", timeout)), True, run.client(name),
                         store_addr or f"127.0.0.1:{store.port}", key=KEY, quorum_timeout_s=30.0,
                         connect_timeout_s=DEADLINE_S, store=store)


def test_the_store_probe_tells_a_silent_listener_from_a_store(silent: str) -> None:
    timeout = datetime.timedelta(seconds=5)
    store = bound_store("127.0.0.1", 0, 1, True, timeout)
    assert store_answers(f"127.0.0.1:{store.port}/edit-train/x/lane0", 5.0)
    t0 = time.monotonic()
    assert not store_answers(silent, 1.0)
    assert time.monotonic() - t0 < 3.0


# the default suite's 20-minute budget (CI: 1,246 s at the last stop): the 3-cluster case, which has a majority to
# judge by, stays in it
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3], ids=["2 clusters", "3 clusters"])
def test_a_member_naming_a_silent_store_is_left_out_and_named(tmp_path: Path, silent: str, n: int,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    names = [f"c{i}" for i in range(n)]  # c0 lies
    honest = names[1:]
    run = GateRun(tmp_path, names, honest=n).start()
    try:
        transports: dict[str, Any] = {m: _transport(run, m, silent if m == "c0" else None) for m in names}
        cfg = toy_config(tuple(names))
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            outs: dict[str, Outcome] = run_threads(
                {m: (lambda i=i, m=m: train_cluster(i, transports[m], cfg)) for i, m in enumerate(names)},
                timeout=240.0)
        took = time.monotonic() - t0
    finally:
        run.close()
    key = run.creds["c0"].key_id("c0")
    lines = [r.getMessage() for r in caplog.records if "cluster c0's lanes' store" in r.getMessage()
             and f"roster key {key}" in r.getMessage() and "left out of the next" in r.getMessage()]
    assert lines and all("\n" not in x for x in lines), [r.getMessage() for r in caplog.records][-20:]
    for m in honest:
        o = outs[m]
        assert o.steps == TOTAL, (m, o.steps)
        syncs = [e for e in o.events if e["event"] == "sync"]
        lost = [e for e in o.events if e["event"] == "sync_aborted"]
        # at most the first sync lost (the one c0 hosted); every later one without c0
        assert len(syncs) >= SYNCS - 1 and all("c0" not in e["quorum"] for e in syncs), (m, syncs, lost)
        if n == 3:
            assert all(e["quorum"] == honest for e in syncs), syncs
    # one lost sync costs at most one deadline (the probe's), not one per sync
    assert took < 60.0 + DEADLINE_S * 2, took
