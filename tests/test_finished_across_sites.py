"""A federation that finished, across sites (issue 48, 2): each cluster has its own run.dir, so a cluster
relaunched after its peers finished learns it from the gate — each cluster tells it, in a request signed by its
own roster identity, that it finished — and exits 0 in one line instead of training alone to the end. A name
cannot mark another finished, and a cluster that never trained here is not stopped."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from edit_train.cli.checks import nothing_left
from edit_train.cli.common import compose
from edit_train.config import cluster_specs
from edit_train.federation import auth, enrol, gate
from edit_train.federation.quorum import finished_peers, tell_finished
from edit_train.federation.signed import Credentials, load_credentials
from edit_train.train.build import fingerprint
from edit_train.train.progress import record_path

KEY = auth.INSECURE  # every address is this machine's loopback: the key a cluster without key_file resolves
NAMES = ["a", "b"]
BASE = ["cluster=local", "cluster.clusters=[{name:a},{name:b}]", "algo=diloco", "train.steps=20"]


@pytest.fixture
def fed(tmp_path: Path) -> Path:
    cfg = compose(BASE)
    d = tmp_path / "fed"
    enrol.make(d, NAMES, (fingerprint(cfg), cfg.train.steps, cfg.algo.name))
    return d


def _creds(fed: Path, name: str) -> Credentials:
    return load_credentials(str(enrol.identity_path(fed, name)), str(fed / enrol.ROSTER), name)


def _serve(fed: Path, bind: str = "127.0.0.1:0") -> gate.Gate:
    creds = load_credentials(str(fed / enrol.GATE), str(fed / enrol.ROSTER), "gate", role="gate")
    return gate.Gate(bind, KEY, 1, 0.5, 5.0, creds, str(fed / enrol.ROSTER))


def test_a_cluster_marks_only_itself_finished_and_the_gate_keeps_it(fed: Path) -> None:
    g = _serve(fed)
    try:
        assert finished_peers(g.address, "b", KEY, _creds(fed, "b")) == {}
        # b, holding its own identity and the federation key, claims a's name: the gate refuses the request
        with pytest.raises(gate.IdentityRefused):
            gate.call(g.address, {"kind": "finished", "name": "a", "steps": 20}, KEY, 5.0, _creds(fed, "b"))
        assert not tell_finished(g.address, "a", 20, KEY, _creds(fed, "b"))
        assert finished_peers(g.address, "b", KEY, _creds(fed, "b")) == {}
        assert tell_finished(g.address, "a", 20, KEY, _creds(fed, "a"))
        assert finished_peers(g.address, "b", KEY, _creds(fed, "b")) == {"a": 20}
        address = g.address
    finally:
        g.shutdown()
    g = _serve(fed, address)  # a restarted gate still knows (a JSON file beside the roster)
    try:
        assert finished_peers(g.address, "b", KEY, _creds(fed, "b")) == {"a": 20}
        assert json.loads((fed / (enrol.ROSTER + ".finished.json")).read_text()) == {"a": 20}
    finally:
        g.shutdown()


def _relaunch(fed: Path, run_dir: Path, lighthouse: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDIT_TRAIN_CLUSTER", "b")
    cfg = compose([*BASE, f"run.dir={run_dir}", "resume=auto", f"federation.lighthouse={lighthouse}",
                   f"federation.roster_file={fed / enrol.ROSTER}", f"federation.identity_file={fed / 'b'}.identity"])
    nothing_left(cfg, cluster_specs(cfg), "b")


def test_a_cluster_resumed_after_its_peers_finished_elsewhere_exits_0_in_one_line(
        fed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    g = _serve(fed)
    try:
        run_b = tmp_path / "site-b"  # b's own run.dir: no record of a in it
        record_path(run_b, "b").parent.mkdir(parents=True)
        record_path(run_b, "b").write_text(json.dumps({"saved_at": time.time() - 60}))
        _relaunch(fed, run_b, g.address, monkeypatch)  # a has not finished: b trains (returns)
        assert tell_finished(g.address, "a", 20, KEY, _creds(fed, "a"))
        start = time.monotonic()
        with pytest.raises(SystemExit) as code:
            _relaunch(fed, run_b, g.address, monkeypatch)
        assert code.value.code == 0 and time.monotonic() - start < 30
        lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(lines) == 1 and "cluster b: its federation finished without it (a at step 20" in lines[0], lines
        # a cluster that never trained here (no progress record) is not stopped by the gate's word
        _relaunch(fed, tmp_path / "fresh", g.address, monkeypatch)
    finally:
        g.shutdown()
