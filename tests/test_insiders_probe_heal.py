"""Issue 49, part B: the insiders' lies about probe scores, heartbeats and heals (one process each).

* heartbeats: a member on the roster that heartbeats through the gate but never asks for a quorum, and a
  keyless local process that heartbeats made-up names straight into the Lighthouse host's loopback: the
  honest clusters form their quorums anyway (`federation/gate.py`, `federation/inner.py`);
* probe scores: an evaluator that scores every other cluster's update +1000 % (2 and 3 clusters): nobody is
  flagged on its word alone, and it is named (`local_sgd/evidence.py`, `local_sgd/verified.py`);
* heals: with two clusters, a liar claiming to be one sync ahead with a noised anchor: the honest cluster keeps
  what it has (`local_sgd/healing.py`).
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from edit_train.federation import gate
from liar_utils import KEY, SYNCS, TOTAL, GateRun, Liar

# ----------------------------------------------------------------------------------- heartbeats


def _one_line_naming(records: list[logging.LogRecord], *needles: str) -> str:
    lines = [r.getMessage() for r in records if all(s in r.getMessage() for s in needles)]
    assert lines and all("\n" not in x for x in lines), [r.getMessage() for r in records][-20:]
    return lines[0]


def _all_syncs(outs: dict, names: list[str]) -> None:
    for n in names:
        o = outs[n]
        assert o.steps == TOTAL, (n, o.steps)
        syncs = [e for e in o.events if e["event"] == "sync"]
        assert len(syncs) == SYNCS and all(e["quorum"] == names for e in syncs), syncs


@pytest.mark.parametrize("honest", [1, 2], ids=["2 clusters", "3 clusters"])
def test_a_member_that_only_heartbeats_holds_nothing_back(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          honest: int) -> None:
    """The liar (on the roster, signing with its own key) heartbeats through the gate from the start and never
    asks. torchft counts every heartbeating name (askers must outnumber half of them): with two clusters the
    honest one alone never did, and got no quorum. The gate forwards no heartbeat of a name that has not
    asked, and says so naming it."""
    names = [f"c{i}" for i in range(honest + 1)]
    liar = names[-1]
    run = GateRun(tmp_path, names, honest=honest).start()
    beat = lambda: gate.call(run.address, {"kind": "heartbeat", "name": liar}, KEY, 5, run.creds[liar])  # noqa: E731
    try:
        with caplog.at_level(logging.WARNING), Liar(beat) as lying:
            outs = run.train()
    finally:
        run.close()
    assert lying.answered > 0  # the gate took its heartbeats (signed, on the roster) and dropped them
    _all_syncs(outs, names[:honest])
    _one_line_naming(caplog.records, f"heartbeats of cluster {liar}", f"roster key {liar}", "not forwarded")


def _loopback_listeners() -> set[int]:
    """The TCP ports this process and its children listen on at 127.0.0.1, as a local user finds them
    (/proc/net/tcp of this host's network namespace, matched to our sockets so no one else's is touched)."""
    pids = [str(os.getpid())]
    for task in os.listdir("/proc/self/task"):
        try:
            pids += Path(f"/proc/self/task/{task}/children").read_text().split()
        except OSError:
            pass
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            pass
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        local, state, inode = f[1], f[3], f[9]
        if state == "0A" and local.startswith("0100007F:") and inode in inodes:
            ports.add(int(local.split(":")[1], 16))
    return ports


def _namespaces() -> bool:
    """Does this host let an unprivileged process have a network namespace of its own?"""
    code = ("import ctypes,sys; libc=ctypes.CDLL(None); "
            "sys.exit(0 if libc.unshare(0x10000000|0x40000000)==0 or libc.unshare(0x40000000)==0 else 1)")
    return subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_keyless_local_heartbeats_do_not_hold_back_the_first_quorum(tmp_path: Path) -> None:
    """Acceptance 2: a local process without the key finds every loopback port the Lighthouse's process tree
    listens on and heartbeats 4 made-up names into each (torchft's client: a port that is torchft's Lighthouse
    takes them) from before the first quorum to the end. Before, the Lighthouse listened on loopback: 2 askers
    against 6 heartbeating names never made a quorum. Now it is in a network namespace only the gate reaches:
    every quorum forms (each within quorum_timeout_s; the first after the grace window at most)."""
    if not _namespaces():
        pytest.skip("no user namespaces on this host: the Lighthouse listens on loopback (the gate says so)")
    from torchft.coordination import LighthouseClient

    run = GateRun(tmp_path, ["c0", "c1"], join_timeout_s=2.0).start()
    gate_port = int(run.address.rpartition(":")[2])
    stop, hits = threading.Event(), [0]

    def flood() -> None:
        while not stop.is_set():
            for port in _loopback_listeners() - {gate_port}:
                try:
                    client = LighthouseClient(f"http://127.0.0.1:{port}", datetime.timedelta(seconds=1))
                    for i in range(4):
                        client.heartbeat(f"evil{i}", timeout=datetime.timedelta(seconds=1))
                    hits[0] += 1
                except Exception:  # noqa: BLE001 - not a Lighthouse: nothing to heartbeat into
                    pass
            stop.wait(0.2)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        outs = run.train()
    finally:
        stop.set()
        flooder.join(10)
        run.close()
    _all_syncs(outs, ["c0", "c1"])
    assert hits[0] == 0  # nothing on this host's loopback took a heartbeat
