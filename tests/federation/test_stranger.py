"""A stranger who reaches the Lighthouse cannot steer, stop or slow a keyed federation (issue 21).

Two honest clusters run with the run's federation key (the local launcher makes one); a keyless stranger,
with nothing but torchft's public `LighthouseClient` and crafted bytes, tries in turn what once worked: a
quorum under a new name claiming `step=10**9` and a wrong config fingerprint, the honest name `c1`, an old
anchor, list-valued data, heartbeats under many names, frames signed with another key, a huge length
prefix, deep JSON. The honest clusters never refuse, never heal, never see the stranger in a quorum, are
not slowed (blocked time within a few points of the same run without it), and end on one anchor; the gate
logs the stranger's records as unauthenticated.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from edit_train.federation import auth, gate
from fed_utils import anchors, events, finish, same, start, wait_for

RUN = ["algo=edit", "cluster.count=2", "cluster.ranks=1", "train.steps=128", "algo.interval=8",
       "train.batch_size=2", "cluster.slowdown=[4,4]", "checkpoint.at_end=true", "federation.join_timeout_s=3"]


def _frame(body: object, key: bytes) -> bytes:
    raw = json.dumps(body).encode()  # the gate's own framing: tag ‖ JSON, signed with `key`
    return struct.pack(">I", auth.TAG_BYTES + len(raw)) + auth.tag(key, "gate/request", raw) + raw


def _answered(answer: bytes) -> bool:
    """Anything but silence or the gate's fixed, unsigned "unknown key" bytes (which carry nothing)."""
    return bool(answer) and answer != gate.UNKNOWN_KEY_FRAME


def _send(address: str, data: bytes) -> bytes:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.settimeout(5)
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            return sock.recv(1024)
    except OSError:
        return b""


def _stranger(address: str, attempts: list[str], stop: threading.Event, round_done: threading.Event) -> None:
    """Everything an outsider can try, in turn, until told to stop: crafted frames first (they are quick),
    then torchft's client; `round_done` is set after each full round."""
    from torchft.coordination import LighthouseClient

    other = secrets.token_bytes(32)  # a key, but not the federation's
    member = {"name": "evil", "sync": 10**9, "size": 1, "store": "127.0.0.1:1",
              "data": {"fp": "wrong", "total_steps": 10**12, "local_steps": 8, "incarnation": "x"}}
    tries: list[tuple[str, object]] = [
        ("torchft quorum step=1e9, wrong fingerprint", dict(replica_id="evil", step=10**9, data={"fp": "wrong"})),
        ("torchft quorum as c1", dict(replica_id="c1", step=10**9, data={"fp": "wrong"})),
        ("torchft quorum, old anchor", dict(replica_id="old", step=0)),
        ("torchft quorum, list data", dict(replica_id="lst", step=1, data=[1, 2, 3])),
    ]
    while not stop.is_set():
        now = time.time()
        for what, body, key in (
            ("quorum signed with another key", {"kind": "quorum", "name": "evil", "member": member, "timeout_s": 5,
                                                "ts": now, "nonce": secrets.token_hex(16)}, other),
            ("taken name c1, another key", {"kind": "quorum", "name": "c1", "member": {**member, "name": "c1"},
                                            "timeout_s": 5, "ts": now, "nonce": secrets.token_hex(16)}, other),
            ("list-valued data, unsigned", {"kind": "quorum", "name": "lst", "member": {**member, "data": [1]},
                                            "timeout_s": 5, "ts": now, "nonce": secrets.token_hex(16)}, b""),
            ("heartbeat, another key", {"kind": "heartbeat", "name": "evil", "ts": now,
                                        "nonce": secrets.token_hex(16)}, other),
        ):
            answer = _send(address, _frame(body, key))
            attempts.append(("ACCEPTED: " if _answered(answer) else "refused: ") + what)
        for what, raw in (("length 2**31", struct.pack(">I", 2**31) + b"x" * 64),
                          ("deep JSON", struct.pack(">I", 40_000) + b"[" * 20_000 + b"]" * 20_000),
                          ("garbage", os.urandom(256))):
            attempts.append(("ACCEPTED: " if _answered(_send(address, raw)) else "refused: ") + what)
        for what, kwargs in tries:
            try:
                client = LighthouseClient(address, datetime.timedelta(seconds=0.5))
                client.quorum(timeout=datetime.timedelta(seconds=0.5), **kwargs)  # type: ignore[arg-type]
                attempts.append(f"ACCEPTED: {what}")
            except Exception:  # noqa: BLE001 - refused, as it should be
                attempts.append(f"refused: {what}")
            try:
                LighthouseClient(address, datetime.timedelta(seconds=0.5)).heartbeat(f"hb{len(attempts)}")
                attempts.append("ACCEPTED: torchft heartbeat")
            except Exception:  # noqa: BLE001
                attempts.append("refused: torchft heartbeat")
        round_done.set()
        stop.wait(0.5)


def _blocked(run_dir: Path) -> float:
    per = json.loads((run_dir / "summary.json").read_text())["per_cluster"]
    return max(c["blocked_frac"] for c in per.values())


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_a_keyless_stranger_cannot_join_steer_stop_or_slow_the_federation(tmp_path: Path, corpus: str) -> None:
    clean = tmp_path / "clean"
    finish(start(clean, corpus, *RUN))
    run_dir = tmp_path / "stranger"
    proc = start(run_dir, corpus, *RUN)
    attempts: list[str] = []
    stop, round_done = threading.Event(), threading.Event()
    try:
        wait_for(run_dir, lambda e: e["event"] == "sync", proc=proc)  # the federation is up
        address = json.loads((run_dir / "federation.json").read_text())["lighthouse"]
        assert (run_dir / "federation.key").stat().st_mode & 0o777 == 0o600  # the launcher made a key
        thread = threading.Thread(target=_stranger, args=(address, attempts, stop, round_done), daemon=True)
        thread.start()
        assert round_done.wait(timeout=120), attempts  # at least one full round while the run was up
        assert proc.poll() is None, "the run ended before the stranger finished one round: lengthen RUN"
    finally:
        stop.set()
    out = finish(proc)
    thread.join(timeout=60)
    assert attempts and not [a for a in attempts if a.startswith("ACCEPTED")], attempts
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"]
    for name, c in summary["per_cluster"].items():  # nobody refused, restarted or healed from anyone
        assert c["restarts"] == 0 and not c["healed_from"], (name, c)
    syncs = [e for e in events(run_dir) if e["event"] == "sync"]
    assert syncs and all(e["quorum"] == ["c0", "c1"] for e in syncs)
    assert summary["syncs"] == json.loads((clean / "summary.json").read_text())["syncs"]
    assert same(anchors(run_dir, "c0"), anchors(run_dir, "c1")) == 0.0
    assert _blocked(run_dir) <= _blocked(clean) + 0.05, (_blocked(run_dir), _blocked(clean))
    assert "unauthenticated record from 127.0.0.1" in out and "'evil'" in out, out[-3000:]
    assert "Traceback" not in out


def test_the_gate_strips_members_who_reached_torchft_directly() -> None:
    """Defence in depth: where torchft's Lighthouse is not isolated (no user namespaces: it listens on loopback),
    a process on its host that joins it directly is never in a quorum the gate signs."""
    from torchft.coordination import LighthouseClient

    key = auth.INSECURE
    g = gate.Gate("127.0.0.1:0", key, min_clusters=2, join_timeout_s=0.5, heartbeat_timeout_s=5, isolate=False)
    try:
        inner = f"http://{g.dashboard}"  # what a local attacker would find
        sneaky = threading.Thread(target=lambda: LighthouseClient(inner, datetime.timedelta(seconds=5)).quorum(
            replica_id="sneaky", timeout=datetime.timedelta(seconds=10), store_address="127.0.0.1:1", step=5,
            world_size=1), daemon=True)
        sneaky.start()
        time.sleep(0.3)
        member = {"name": "c0", "sync": 5, "size": 1, "store": "127.0.0.1:2", "data": {}}
        answer = gate.call(g.address, {"kind": "quorum", "name": "c0", "member": member, "timeout_s": 10}, key, 15)
        assert answer["kind"] == "quorum", answer
        assert [m["name"] for m in answer["members"]] == ["c0"]
    finally:
        g.shutdown()
