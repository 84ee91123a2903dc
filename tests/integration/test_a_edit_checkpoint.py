"""A-EDiT checkpoints mid-run (issue 35): each cluster saves at its own pace, right after a sync, so that a
crash loses at most `checkpoint.every` of its steps; `resume=auto` brings a whole federation back, each
cluster from its own newest checkpoint, even when those were taken at different syncs."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from edit_train.local_sgd.sync.pacer import PaceConfig, Pacer
from edit_train.local_sgd.sync.schedule import ScheduleConfig
from fed_utils import cluster_pids, events, finish, start, wait_for


class _Lone:
    size = 1


def _rows(steps: int, secs: float, total: int) -> torch.Tensor:
    return torch.tensor([[float(steps), secs, float(total), 0.0, float(steps)]], dtype=torch.float64)


def test_pacer_saves_at_the_last_sync_before_every_steps_would_pass() -> None:
    """H = 4 planned steps per interval, every = 10: saves at total 8 (12 would be 12 > 10 steps unsaved), then
    at 16 (8 + 10 = 18 < 20), 24, ...; never more than `every` steps between two saves."""
    sched = ScheduleConfig(kind="time", sync_time_s=0.4)
    p = Pacer(PaceConfig(sched, checkpoint_every=10), _Lone())  # type: ignore[arg-type]
    saved = []
    for total in range(4, 60, 4):
        p.total_steps, p.local_steps = total, 0
        p.exchanged(_rows(4, 0.1, total), 0, False)  # 0.4 s / 0.1 s per step: 4 steps to the next sync
        assert p.planned == 4
        if p.checkpoint_due:
            saved.append(total)
            p.checkpoint_due = False
    assert saved == [8, 16, 24, 32, 40, 48, 56]
    assert p.state_json()["checkpoint_step"] == 56
    # cut off: the missed sync counts as a sync (its local progress is saved too)
    p.local_steps, p.total_steps = 4, 66
    p.missed()
    assert p.checkpoint_due
    # an interval longer than `every`: a save at every sync
    q = Pacer(PaceConfig(sched, checkpoint_every=3), _Lone())  # type: ignore[arg-type]
    q.total_steps = 4
    q.exchanged(_rows(4, 0.1, 4), 0, False)
    assert q.checkpoint_due
    off = Pacer(PaceConfig(sched), _Lone())  # type: ignore[arg-type]
    off.total_steps = 40
    off.exchanged(_rows(4, 0.1, 40), 0, False)
    assert not off.checkpoint_due


EVERY = 6
FED = ["algo=a_edit", "cluster.count=2", "cluster.ranks=1", "cluster.slowdown=[3,6]", "train.batch_size=2",
       "train.log_every=1", "algo.sync_time_s=0.6", f"checkpoint.every={EVERY}", "checkpoint.keep=2",
       "federation.join_timeout_s=5", "algo.rule.verified.probe_tokens=0"]


def _own_step(ckpt: Path) -> int:
    return int(json.loads((ckpt / "rank0-state.json").read_text())["step"])


def _newest(run_dir: Path, cluster: str) -> Path | None:
    done = sorted(p for p in (run_dir / "checkpoints" / cluster).glob("step_*[0-9]") if (p / "manifest.json").is_file())
    return done[-1] if done else None


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_a_edit_federation_killed_whole_resumes_each_cluster_from_its_newest_checkpoint(tmp_path: Path,
                                                                                         corpus: str) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, corpus, *FED, "train.steps=60", start_new_session=True)

    def has_checkpoints() -> bool:
        newest = [_newest(run_dir, c) for c in ("c0", "c1")]
        return all(n is not None and _own_step(n) >= 1 for n in newest)

    deadline = time.time() + 240
    while not has_checkpoints():
        assert proc.poll() is None, proc.stdout.read()[-4000:] if proc.stdout else ""
        assert time.time() < deadline, "no checkpoint of every cluster in time"
        time.sleep(0.2)
    time.sleep(1.0)  # a few steps past them
    pids = {proc.pid, *cluster_pids("c0", run_dir), *cluster_pids("c1", run_dir)}
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher, the Lighthouse inside it and both clusters, at once
    for pid in pids:  # (the cluster jobs are in the launcher's process group; this is belt and braces)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=30)
    deadline = time.time() + 30
    while cluster_pids("c0", run_dir) or cluster_pids("c1", run_dir):  # gone before the resume starts
        assert time.time() < deadline
        time.sleep(0.1)
    assert not (run_dir / "summary.json").exists()

    before = events(run_dir)
    done_at_kill = {c: max(e["step"] for e in before if e["event"] == "train" and e.get("cluster") == c)
                    for c in ("c0", "c1")}
    resumed_from = {c: _own_step(_newest(run_dir, c)) for c in ("c0", "c1")}  # type: ignore[arg-type]

    finish(start(run_dir, corpus, *FED, "train.steps=60", "resume=auto"), timeout=300)
    after = events(run_dir)[len(before):]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"]
    for c in ("c0", "c1"):
        steps = [e["step"] for e in after if e["event"] == "train" and e.get("cluster") == c]
        # it continued from its own newest checkpoint (log_every=1: the first step after it is logged)...
        assert steps and steps[0] == resumed_from[c] + 1, (c, steps[:3], resumed_from)
        # ...and redid no more than checkpoint.every of the steps it had taken before the kill
        redone = done_at_kill[c] - resumed_from[c]
        assert 0 <= redone <= EVERY, (c, done_at_kill, resumed_from)
        assert not any(e["event"] == "eval" and e.get("cluster") == c and e["step"] == 0 for e in after)
    # the federation came back together: syncs with both clusters after the resume, one anchor at the end
    both = [e for e in after if e["event"] == "sync" and len(e.get("quorum", [])) == 2]
    assert both, [e for e in after if e["event"] == "sync"][:4]
    assert max(c["steps"] for c in summary["per_cluster"].values()) >= 60
