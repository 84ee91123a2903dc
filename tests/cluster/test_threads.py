"""A cluster job's intra-op threads: the cores it may use, shared with the other training processes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edit_train.cluster.threads import AUTO, ThreadBudget, plan, training_processes


def test_plan_shares_the_cores() -> None:
    assert plan(0, 1, 0, 8).threads == 8
    assert plan(0, 2, 2, 8).threads == 2 and not plan(0, 2, 2, 8).oversubscribed
    assert plan(0, 1, 3, 2).threads == 1 and plan(0, 1, 3, 2).oversubscribed  # never below one thread
    assert plan(4, 1, 0, 2).threads == 4 and plan(4, 1, 0, 2).oversubscribed  # pinned by train.threads


def _proc(root: Path, pid: int, ppid: int, state: str = "S", env: bytes = b"HOME=/root\x00",
          cmdline: bytes = b"python\x00-c\x00pass\x00") -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_text(f"{pid} (py thon) {state} {ppid} 1 1 0")
    (d / "environ").write_bytes(env)
    (d / "cmdline").write_bytes(cmdline)


def test_training_processes_counts_ranks_and_lone_runs_not_launchers(tmp_path: Path) -> None:
    mark = b"EDIT_TRAIN_CLUSTER=c0\x00"
    _proc(tmp_path, 100, 1, cmdline=b"/usr/bin/python\x00/usr/local/bin/edit-train\x00cluster.only=c0\x00")  # launcher
    _proc(tmp_path, 101, 100, env=mark)  # its rank
    _proc(tmp_path, 102, 100, env=mark)  # its other rank
    _proc(tmp_path, 200, 1, cmdline=b"python\x00-m\x00edit_train.cli.train\x00experiment=single\x00")  # a lone run
    _proc(tmp_path, 300, 1)  # something else
    _proc(tmp_path, 400, 1, state="Z", env=mark)  # a dead rank
    _proc(tmp_path, 500, 101, env=mark,
          cmdline=b"/usr/lib/python3.11/site-packages/wandb/bin/wandb-core\x00--port-filename\x00f\x00")
    (tmp_path / "self").mkdir()  # 500: W&B's service, started by rank 101 with its environment: not a rank
    assert training_processes(proc=tmp_path) == 3
    assert training_processes({101}, proc=tmp_path) == 2
    assert training_processes(proc=tmp_path / "missing") == 0


def test_a_real_rank_on_this_host_is_seen() -> None:
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            env={**os.environ, "EDIT_TRAIN_CLUSTER": "c9"})
    try:
        time.sleep(0.3)
        assert training_processes() - training_processes({rank.pid}) == 1
    finally:
        rank.kill()
        rank.wait()


def test_budget_replans_when_others_come_and_go_and_warns_once(caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("edit_train.cluster.threads.cores_available", lambda: 4)
    others, applied = [0], []
    budget = ThreadBudget(0, 1, every_s=0.0, set_threads=applied.append, count=lambda: others[0])
    with caplog.at_level(logging.INFO, logger="edit_train.cluster.threads"):
        assert budget.apply().threads == 4
        others[0] = 1
        budget.maybe_replan()  # a second job started on the host: half the cores each
        others[0] = 7
        budget.maybe_replan()
        budget.maybe_replan()
    assert applied == [4, 2, 1]
    assert sum("oversubscribed" in r.getMessage() for r in caplog.records) == 1


def test_the_users_omp_num_threads_wins_over_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv(AUTO, raising=False)
    assert ThreadBudget(0, 1, set_threads=lambda n: None, count=lambda: 5).apply().threads == 3
    monkeypatch.setenv(AUTO, "1")  # chosen by our launcher: auto re-plans
    assert ThreadBudget(0, 1, set_threads=lambda n: None, count=lambda: 1).apply().threads >= 1
