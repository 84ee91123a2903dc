"""Issue 69, item 6: a `finished` notice ends nobody else's run on one member's word. A liar on the roster signs
`finished` for the run's fingerprint at the final step before an honest cluster (relaunched after a crash over its
own run.dir: its progress record) starts. Before, the honest cluster exited 0 at its relaunch (the issue's run: 9 of
32 steps). Now the gate's notices count only when a strict majority of the configured clusters signed one: the
honest cluster trains on and says, in one line, whose notice did not count (by roster key); a strict majority of
finished clusters still stops it (what a pair of colluders of three can do: docs/security.md). A real gate with a
roster, the product's start-up check (`cli.checks.nothing_left`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from edit_train.cli.checks import nothing_left
from edit_train.cli.common import compose
from edit_train.config import cluster_specs
from edit_train.federation import auth, enrol, gate
from edit_train.federation.quorum import tell_finished
from edit_train.federation.signed import Credentials, load_credentials
from edit_train.train.build import fingerprint
from edit_train.train.progress import record_path

KEY = auth.INSECURE


def _base(names: list[str]) -> list[str]:
    return ["cluster=local", f"cluster.clusters=[{','.join('{name:' + n + '}' for n in names)}]", "algo=diloco",
            "train.steps=32"]


def _creds(fed: Path, name: str) -> Credentials:
    return load_credentials(str(enrol.identity_path(fed, name)), str(fed / enrol.ROSTER), name)


def _relaunch(fed: Path, names: list[str], run_dir: Path, lighthouse: str, me: str,
              monkeypatch: pytest.MonkeyPatch) -> bool:
    """Does cluster `me`, relaunched over its own run (its progress record), stop at start (exit 0)?"""
    record_path(run_dir, me).parent.mkdir(parents=True, exist_ok=True)
    record_path(run_dir, me).write_text(json.dumps({"saved_at": time.time() - 60}))
    monkeypatch.setenv("EDIT_TRAIN_CLUSTER", me)
    cfg = compose([*_base(names), f"run.dir={run_dir}", "resume=auto", f"federation.lighthouse={lighthouse}",
                   f"federation.roster_file={fed / enrol.ROSTER}", f"federation.identity_file={fed / me}.identity"])
    try:
        nothing_left(cfg, cluster_specs(cfg), me)
    except SystemExit as exc:
        assert exc.code == 0
        return True
    return False


@pytest.mark.parametrize("n", [2, 3], ids=["2 clusters", "3 clusters"])
def test_one_members_finished_notice_ends_nobody_elses_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture, n: int) -> None:
    names = [f"c{i}" for i in range(n)]
    liar, me = names[-1], names[0]
    fed = tmp_path / "fed"
    enrol.make(fed, names, (fingerprint(compose(_base(names))), 32, "diloco"))
    gcreds = load_credentials(str(fed / enrol.GATE), str(fed / enrol.ROSTER), "gate", role="gate")
    g = gate.Gate("127.0.0.1:0", KEY, 1, 0.5, 5.0, gcreds, str(fed / enrol.ROSTER))
    try:
        assert tell_finished(g.address, liar, 32, KEY, _creds(fed, liar))  # the liar's own, signed, notice
        capsys.readouterr()
        assert not _relaunch(fed, names, tmp_path / f"site-{me}", g.address, me, monkeypatch)
        said = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        key = _creds(fed, me).key_id(liar)
        assert len(said) == 1 and f"{liar} at step 32 (roster key {key})" in said[0] and "not counted" in said[0], said
        assert not any(_creds(fed, me).key_id(h) in said[0] for h in names[:-1])  # no honest cluster named
        if n == 3:  # a strict majority of the configured clusters signed: the federation did finish
            assert tell_finished(g.address, "c1", 32, KEY, _creds(fed, "c1"))
            assert _relaunch(fed, names, tmp_path / f"site-{me}", g.address, me, monkeypatch)
            said = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
            assert len(said) == 1 and "finished without it (c1 at step 32, c2 at step 32, 2 of 3" in said[0], said
    finally:
        g.shutdown()
