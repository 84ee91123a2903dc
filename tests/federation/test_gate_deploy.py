"""The gate as a deployment meets it: a cluster holding another key is told so (after a bounded wait) and
stops with one line; a stranger learns nothing more than a closed connection told it; the Lighthouse
restarts on its port at once; a rank dials torchft's Lighthouse on the loopback it is bound to."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edit_train.federation import auth, gate
from edit_train.federation.quorum import QuorumClient, check_key
from edit_train.local_sgd.errors import FederationRefused

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def keys(tmp_path: Path) -> tuple[bytes, bytes]:
    return auth.load_key(auth.new_key(tmp_path / "fed.key")), auth.load_key(auth.new_key(tmp_path / "other.key"))


def test_a_cluster_with_another_key_is_refused_after_the_grace(keys: tuple[bytes, bytes]) -> None:
    right, wrong = keys
    g = gate.Gate("127.0.0.1:0", right, min_clusters=1, join_timeout_s=0.2, heartbeat_timeout_s=5)
    try:
        assert check_key(g.address, "a", right, "federation.key_file=fed.key", refuse_after_s=1.5) is True
        t0 = time.monotonic()
        with pytest.raises(FederationRefused) as exc:
            check_key(g.address, "b", wrong, "federation.key_file=/keys/other.key", refuse_after_s=1.5)
        took = time.monotonic() - t0
        msg = str(exc.value)
        assert took >= 1.5  # one refusal proves nothing: it asked again for the whole grace before stopping
        assert "\n" not in msg and "/keys/other.key" in msg and g.address in msg
        assert auth.fingerprint(wrong) in msg and auth.fingerprint(right) not in msg  # ours only
        # a rank's quorum request: the same (the refusal mid-run stops the cluster with the same line)
        client = QuorumClient(g.address, "b", wrong, key_source="federation.key_file=/keys/other.key",
                              refuse_after_s=1.0)
        with pytest.raises(FederationRefused, match="holds another federation key"):
            client.request(0, 1, "127.0.0.1:1", {"local_steps": 0}, timeout_s=5)
        client.close()
    finally:
        g.shutdown()


def test_an_unreachable_gate_is_not_a_refusal(keys: tuple[bytes, bytes]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed: nothing listens
    assert check_key(f"127.0.0.1:{port}", "a", keys[0], "k", refuse_after_s=1.0) is False


def test_a_stranger_gets_the_same_fixed_bytes_and_nothing_reaches_the_lighthouse(keys: tuple[bytes, bytes]) -> None:
    right, wrong = keys
    g = gate.Gate("127.0.0.1:0", right, min_clusters=1, join_timeout_s=0.2, heartbeat_timeout_s=5)
    try:
        answers = set()
        for body in (b'{"kind":"heartbeat","name":"x"}', b'{"kind":"hello","name":"y","ts":1}', b"not json"):
            frame = auth.tag(wrong, "gate/request", body) + body
            with socket.create_connection(("127.0.0.1", int(g.address.rpartition(":")[2])), timeout=5) as s:
                s.sendall(struct.pack(">I", len(frame)) + frame)
                answers.add(s.recv(4096))
        assert answers == {gate.UNKNOWN_KEY_FRAME}  # one fixed answer, whatever was sent: no tag, no detail
        assert gate.UNKNOWN_KEY_FRAME == struct.pack(">I", 32 + len(gate.UNKNOWN_KEY)) + bytes(32) + gate.UNKNOWN_KEY
        # a forged "unknown key" is only ever a reason to ask again: a right-key request still works
        assert check_key(g.address, "a", right, "k", refuse_after_s=1.0) is True
    finally:
        g.shutdown()


def test_the_gate_rebinds_its_port_at_once_after_serving(keys: tuple[bytes, bytes]) -> None:
    """Connections the gate closed sit in TIME-WAIT for about a minute; a restarted Lighthouse binds anyway."""
    right, _ = keys
    g = gate.Gate("127.0.0.1:0", right, min_clusters=1, join_timeout_s=0.2, heartbeat_timeout_s=5)
    address = g.address
    for _ in range(3):
        assert check_key(address, "a", right, "k", refuse_after_s=1.0) is True  # the gate closes each connection
    g.shutdown()
    again = gate.Gate(address, right, min_clusters=1, join_timeout_s=0.2, heartbeat_timeout_s=5)
    try:
        assert again.address == address
        assert check_key(address, "a", right, "k", refuse_after_s=1.0) is True
    finally:
        again.shutdown()


_DIAL = """
import sys
from edit_train.federation import auth, gate
from edit_train.federation.quorum import QuorumClient
key = bytes(32)
g = gate.Gate("127.0.0.1:0", key, min_clusters=1, join_timeout_s=0.2, heartbeat_timeout_s=5)
q = QuorumClient(g.address, "a", key).request(0, 1, "127.0.0.1:1", {"local_steps": 0, "incarnation": "i"}, 10)
print("members", q.names, "dashboard", g.dashboard)
g.shutdown()
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare --uts")
def test_the_gate_dials_its_lighthouse_on_loopback() -> None:
    """torchft names its Lighthouse by this host's name, which on a real node resolves to the LAN address
    (or 127.0.1.1) where nothing listens. Here the hostname resolves to nothing at all (its own UTS
    namespace): a gate that dialled that name would fail to start."""
    proc = subprocess.run(["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
                           "edit-train-nowhere.invalid", sys.executable, "-c", _DIAL],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "members ['a'] dashboard 127.0.0.1:" in proc.stdout, proc.stdout
