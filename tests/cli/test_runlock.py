"""One writer per cluster and run.dir (issue 22, items 1 and 4): `run.dir/clusters/<name>.lock`, held by each
cluster job's rank 0 while it trains; a second launch on the same cluster is refused in one line naming the
holder's PID and host, and writes nothing; a killed holder blocks nobody. A cluster job started by hand on a
shared run.dir looks at its own cluster's traces only."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_env, script_cmd, start_lighthouse
from edit_train.train import runlock

TINY = ["model=tiny", "logger=none", "train.progress=false", "train.seq_len=32", "train.batch_size=2",
        "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "train.threads=1"]
LONE = ["algo=ddp", "cluster=local", *TINY]
TRAIN = ("edit-train", "edit_train.cli.train")


def _hold_in_child(run_dir: Path, cluster: str = "c0") -> subprocess.Popen:
    """Another process holding `cluster`'s lock (as a cluster job's rank 0 does), until killed."""
    code = ("import sys, time\nfrom edit_train.train.runlock import acquire\n"
            f"acquire({str(run_dir)!r}, {cluster!r})\nprint('held', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*script_cmd(*TRAIN), *args], capture_output=True, text=True, timeout=timeout,
                          env=cli_env())


def _one_line_refusal(proc: subprocess.CompletedProcess[str], pid: int) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("error: run.dir ") and f"PID {pid} on host {socket.gethostname()}" in line, line
    assert "stop it first or pick another run.dir" in line
    return line


# ------------------------------------------------------------------------------------------------ the lock


def test_second_process_is_refused_and_a_killed_holder_blocks_nobody(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = _hold_in_child(run_dir)
    try:
        meta = json.loads(runlock.lock_path(run_dir, "c0").read_text())
        assert meta["pid"] == holder.pid and meta["host"] == socket.gethostname() and meta["cluster"] == "c0"
        assert runlock.held_by(run_dir, "c0")["pid"] == holder.pid
        with pytest.raises(runlock.RunLocked) as info:
            runlock.acquire(run_dir, "c0")
        msg = str(info.value)
        assert "\n" not in msg and f"PID {holder.pid} on host {socket.gethostname()}" in msg
        assert msg.startswith(f"run.dir {run_dir}: cluster c0 is being written by") and "since" in msg
        runlock.release(runlock.acquire(run_dir, "c1"))  # another cluster of the same run.dir is free
    finally:
        _kill(holder)  # SIGKILL: no cleanup ran, the file still names it
    assert json.loads(runlock.lock_path(run_dir, "c0").read_text())["pid"] == holder.pid
    assert runlock.held_by(run_dir, "c0") is None  # the OS released it: free, whatever the file says
    key = runlock.acquire(run_dir, "c0")
    try:
        assert json.loads(runlock.lock_path(run_dir, "c0").read_text())["pid"] == os.getpid()
        assert runlock.acquire(run_dir, "c0") == key  # the holder itself takes it again (sequential runs)
        runlock.release(key)
        assert runlock.held_by(run_dir, "c0") is None  # held by this process: not in its own way
    finally:
        runlock.release(key)
    assert runlock.lock_path(run_dir, "c0").read_text() == ""  # released: no stale metadata left behind


def test_probe_creates_nothing_and_stale_metadata_is_no_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    runlock.check_free(run_dir, ["c0", "c1"])
    assert not run_dir.exists()
    path = runlock.lock_path(run_dir, "c0")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": 1, "host": "gone-host", "started": "long ago", "cluster": "c0"}))
    runlock.check_free(run_dir, ["c0"])  # a dead host's file, not locked by anyone: free
    with runlock.hold(run_dir, "c0"):
        assert json.loads(path.read_text())["host"] == socket.gethostname()
    # a holder that never lets go (a dead host's lock the file server keeps): deleting the file is the way out
    holder = _hold_in_child(run_dir)
    try:
        path.unlink()
        assert runlock.held_by(run_dir, "c0") is None
        with runlock.hold(run_dir, "c0"):
            assert json.loads(path.read_text())["pid"] == os.getpid()
    finally:
        _kill(holder)


def test_refusal_names_another_host_and_the_way_out(tmp_path: Path) -> None:
    msg = runlock._message(tmp_path, "c0", {"pid": 7, "host": "node-17", "started": "2026-01-01 00:00:00"})
    assert "PID 7 on host node-17 (since 2026-01-01 00:00:00)" in msg and "node-17 is down" in msg
    assert str(runlock.lock_path(tmp_path, "c0")) in msg and "\n" not in msg


def test_local_run_dir_guard_ignores_lock_files(tmp_path: Path) -> None:
    from edit_train.cli.checks import RunDirGuard

    created = tmp_path / "created"
    guard = RunDirGuard.before(created)
    with runlock.hold(created, "c0"):  # a run that failed before writing anything but its lock
        pass
    assert guard.cleanup() and not created.exists()


# ------------------------------------------------------------------------------------------ end to end: item 1


def _wait_for_event(run_dir: Path, proc: subprocess.Popen, pred, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    if pred(json.loads(line)):
                        return
                except ValueError:
                    pass
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError("timed out waiting for an event")


def test_second_launch_on_a_running_run_dir_is_refused_and_writes_nothing(tmp_path: Path, small_corpus: str) -> None:
    """A lone run trains (its process holds clusters/c0.lock); `edit-train … resume=auto` on the same run.dir
    is refused in one line naming it; the directory is as it was. Killed with SIGKILL, it blocks nobody: the
    next resume=auto trains."""
    run_dir = tmp_path / "intr"
    args = [*LONE, f"data.source={small_corpus}", f"run.dir={run_dir}"]
    first = subprocess.Popen([*script_cmd(*TRAIN), *args, "train.steps=100000"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=cli_env())
    try:
        _wait_for_event(run_dir, first, lambda e: e.get("event") == "train")
        assert runlock.held_by(run_dir, "c0")["pid"] == first.pid
        first.send_signal(signal.SIGSTOP)  # frozen (still holding): the directory cannot change under us
        try:
            before = _snapshot(run_dir)
            second = _cli([*args, "train.steps=4", "resume=auto"])
            _one_line_refusal(second, first.pid)
            assert _snapshot(run_dir) == before  # nothing written, nothing touched
            whole = _cli([*args, "train.steps=4", "cluster=local_2x1", "algo=diloco",
                          "resume=auto"])  # the local launcher with every cluster: refused before it writes
            _one_line_refusal(whole, first.pid)
            assert _snapshot(run_dir) == before
        finally:
            first.send_signal(signal.SIGCONT)
    finally:
        _kill(first)
    assert json.loads(runlock.lock_path(run_dir, "c0").read_text())["pid"] == first.pid  # stale metadata
    third = _cli([*args, "train.steps=3", "resume=auto"])
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    assert (run_dir / "summary.json").is_file() and runlock.held_by(run_dir, "c0") is None


# ------------------------------------------------------------------------------------------ end to end: item 4


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_cluster_started_by_hand_on_a_shared_run_dir_checks_its_own_traces(tmp_path: Path,
                                                                           small_corpus: str) -> None:
    """c0 is up (cluster.only=c0, an edit-train-lighthouse; it wrote config.json and metrics.jsonl and waits for
    c1): cluster.only=c1 on the same run.dir is accepted without resume (c1 never ran) and both train, while a
    second c0 is refused by c0's lock, even with resume=auto."""
    from edit_train.federation import auth

    key = str(auth.new_key(tmp_path / "fed.key"))
    house, address = start_lighthouse(tmp_path, f"federation.key_file={key}", join_timeout_s=2)
    run_dir = tmp_path / "fed"
    fed = [*TINY, "algo=diloco", "algo.interval=4", "cluster=local_2x1",
           "federation.min_clusters=1", "federation.heartbeat_timeout_s=2", "federation.join_timeout_s=2",
           f"federation.lighthouse={address}", f"federation.key_file={key}", f"data.source={small_corpus}",
           f"run.dir={run_dir}"]
    procs: list[subprocess.Popen] = []
    try:
        c0 = subprocess.Popen([*script_cmd(*TRAIN), *fed, "cluster.only=c0", "train.steps=100000"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                              start_new_session=True)
        procs.append(c0)
        deadline = time.time() + 90  # c0 is up (holds its lock, opened metrics.jsonl) and waits for c1
        while not (runlock.held_by(run_dir, "c0") and (run_dir / "metrics.jsonl").exists()):
            assert c0.poll() is None and time.time() < deadline, c0.communicate()[0][-3000:]
            time.sleep(0.2)
        holder = runlock.held_by(run_dir, "c0")
        assert holder and holder["pid"] != c0.pid  # held by c0's rank 0, a worker of c0's launcher
        again = _cli([*fed, "cluster.only=c0", "train.steps=4", "resume=auto"])
        _one_line_refusal(again, holder["pid"])
        c1 = subprocess.Popen([*script_cmd(*TRAIN), *fed, "cluster.only=c1", "train.steps=100000"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                              start_new_session=True)
        procs.append(c1)
        _wait_for_event(run_dir, c1, lambda e: e.get("event") == "train" and e.get("cluster") == "c1")
        _wait_for_event(run_dir, c0, lambda e: e.get("event") == "train" and e.get("cluster") == "c0")
        assert runlock.held_by(run_dir, "c1")["pid"] not in (c1.pid, holder["pid"])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        house.send_signal(signal.SIGTERM)
        house.wait(timeout=30)
    out = procs[-1].stdout.read() if procs[-1].stdout else ""
    assert "already holds" not in out, out[-3000:]


def test_cluster_job_rule_is_the_same_for_cluster_only_and_the_launchers(tmp_path: Path, monkeypatch) -> None:
    """check_run_dir: a cluster job (cluster.only or EDIT_TRAIN_CLUSTER) is refused only over its own traces
    (checkpoints, records or events); a whole run over anything."""
    from edit_train.cli.checks import RunDirError, check_run_dir

    monkeypatch.delenv("EDIT_TRAIN_CLUSTER", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    (tmp_path / "metrics.jsonl").write_text('{"event":"train","step":1,"cluster":"c0"}\n')
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "c0.lock").write_text("")
    check_run_dir(tmp_path, "false", "c1")
    with pytest.raises(RunDirError, match="an unfinished run"):
        check_run_dir(tmp_path, "false")
    with pytest.raises(RunDirError, match=r"cluster c0's run \(metrics.jsonl\)"):
        check_run_dir(tmp_path, "false", "c0")  # its events alone (died before its first record)
    (tmp_path / "clusters" / "c1.progress.json").write_text("{}")
    with pytest.raises(RunDirError, match=r"cluster c1's run \(clusters/c1.progress.json\)"):
        check_run_dir(tmp_path, "false", "c1")
    check_run_dir(tmp_path, "auto", "c1")
    monkeypatch.setenv("EDIT_TRAIN_CLUSTER", "c2")  # torchrun / Slurm: the same rule by its environment
    check_run_dir(tmp_path, "false")
