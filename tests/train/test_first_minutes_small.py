"""Issue 64 item 11, the smaller ones: past train.steps the progress lines off a terminal keep their pace
(EDIT_TRAIN_PROGRESS_EVERY_S), not one every logged step; "host oversubscribed" is said once per run and counts
this user's edit-train processes only."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import pytest

from edit_train.cluster.threads import ThreadBudget, training_processes
from edit_train.train.progress import Progress
from edit_train.train.trainer import says_once


def test_past_train_steps_the_lines_keep_their_pace(caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("edit_train.train.progress.time.monotonic", lambda: clock[0])
    bar = Progress(["c0"], total=20, desc="a_edit", stream=io.StringIO(), every_s=30.0)
    with caplog.at_level(logging.INFO, logger="edit_train.train.progress"):
        for step in range(10, 101, 10):  # a logged step every second: 20 is train.steps, the rest past it
            bar.report("c0", step, 2.0, 1000.0)
            clock[0] += 1.0
        clock[0] += 30.0
        bar.report("c0", 110, 2.0, 1000.0)  # 30 s later: due again
        bar.report("c0", 120, 2.0, 1000.0)
        bar.close()  # its last line
    said = [r.getMessage().split(" loss")[0] for r in caplog.records]
    assert said == ["cluster c0 step 10/20", "cluster c0 step 20/20",
                    "cluster c0 step 110 (past train.steps 20: a fast cluster trains on to the run's last sync)",
                    "cluster c0 step 120 (past train.steps 20: a fast cluster trains on to the run's last sync)"], said


def test_oversubscribed_is_said_once_per_run(caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("edit_train.cluster.threads.cores_available", lambda: 2)
    monkeypatch.setenv("EDIT_TRAIN_LAUNCHER_BAR", "1")  # the local launcher's clusters share one console
    ranks = [(leader, index) for index in (0, 1) for leader in (True, False)]  # two clusters of two ranks
    with caplog.at_level(logging.INFO, logger="edit_train.cluster.threads"):
        for leader, index in ranks:
            ThreadBudget(0, 2, set_threads=lambda n: None, count=lambda: 3, says=says_once(leader, index)).apply()
    said = [r.getMessage() for r in caplog.records if "oversubscribed" in r.getMessage()]
    assert len(said) == 1 and "this user's other edit-train processes" in said[0], said
    monkeypatch.delenv("EDIT_TRAIN_LAUNCHER_BAR")
    assert says_once(True, 1) and not says_once(False, 0)  # a cluster's own job: its leader says it


def test_training_processes_counts_this_users_only(tmp_path: Path) -> None:
    d = tmp_path / "100"
    d.mkdir()
    (d / "stat").write_text("100 (python) S 1 100 100 0")
    (d / "environ").write_bytes(b"EDIT_TRAIN_CLUSTER=c0\x00")
    (d / "cmdline").write_bytes(b"python\x00")
    mine = os.stat(d).st_uid
    assert training_processes(proc=tmp_path, uid=mine) == 1
    assert training_processes(proc=tmp_path, uid=mine + 1) == 0  # another user's rank


@pytest.mark.parametrize("lockstep, agreed, own, name", [(False, 201, 46, 201), (False, 30, 46, 46),
                                                         (True, 201, 46, 46)])
def test_a_checkpoint_is_named_by_the_agreed_step(monkeypatch: pytest.MonkeyPatch, lockstep: bool, agreed: int,
                                                   own: int, name: int) -> None:
    """Every checkpoint of a time-scheduled cluster (periodic, interrupted or the last) is named by the agreed
    step, never below its own; a lockstep cluster's own step is the agreed one. (The periodic ones were named
    by the cluster's own step and the last by the agreed: `c1/step_00000201` beside `c1/step_00000040`.)"""
    from types import SimpleNamespace

    from edit_train.timing import TimeAccount
    from edit_train.train import trainer as tr

    named: list[int] = []
    monkeypatch.setattr(tr, "save_checkpoint", lambda ckpt, step, *a: named.append(step) or Path(f"step_{step}"))
    fake = SimpleNamespace(_settle=lambda: True, timing=TimeAccount(), state=SimpleNamespace(step=own),
                           algo=SimpleNamespace(lockstep=lockstep, global_step=agreed), ckpt=None, resumable=None,
                           cfg=None, wandb=None, is_leader=True, topo=SimpleNamespace(name="c1"))
    tr.Trainer.save_checkpoint(fake)  # type: ignore[arg-type]
    assert named == [name] and fake._saved_step == own
