"""Stops during start-up, through the real launchers (issue 64): Ctrl-C while `edit-train`'s workers import torch is
one line (no traceback per worker, no torch FakeTensor statistics); under `launchers/torchrun_multinode.sh` a
Lighthouse address nobody listens on, or any configuration error a worker finds, is one line and exit 2, never
restarted by torchrun, and leaves run.dir reusable; ..."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_env, script_cmd, start_lighthouse
from edit_train.cli.checks import check_run_dir
from edit_train.federation import auth


def _pids_with(*needles: str) -> list[int]:
    """The processes whose command line holds every one of `needles` (this test's own excepted)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmdline for n in needles):
            out.append(int(proc.name))
    return out


def _maps_hold(pid: int, needle: str) -> bool:
    """Whether process `pid` has a shared object whose path holds `needle` mapped (it imported that extension)."""
    try:
        return needle in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _wait_for(cond, timeout: float, proc: subprocess.Popen) -> float:
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, f"exited early ({proc.returncode})"
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)
    return time.time() - t0


def _stop_says_one_line(out: str) -> str:
    """What a stop must look like: no traceback, no torch statistics, one `error:` line (the last)."""
    lines = [x for x in out.splitlines() if x.strip()]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    assert "FakeTensor" not in out and "cache_hits" not in out, out[-4000:]
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], out[-4000:]
    return errors[0]


# where the Ctrl-C lands: the launcher still composing / checking (before any worker), the workers importing torch
# (just after they appeared, on a loaded 2-core box 10 s and more) and the workers reading the data / building
@pytest.mark.parametrize("where, after_workers_s", [
    ("launcher", None), ("importing", 1.0), pytest.param("building", 6.0, marks=pytest.mark.slow)])
def test_ctrl_c_during_start_up_is_one_line(tmp_path: Path, small_corpus: str, where: str,
                                            after_workers_s: float | None) -> None:
    """SIGINT to `edit-train`'s process group (what Ctrl-C in a terminal does) during its start-up: exit 130 (the
    shell's code for SIGINT) and one line, whichever process was where; nothing left running."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*script_cmd("edit-train", "edit_train.cli.train"), "logger=none", "train.progress=false",
                             "model=tiny", f"data.source={small_corpus}", f"run.dir={run_dir}", "train.steps=50"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                            start_new_session=True)
    try:
        if after_workers_s is None:
            # inside the launcher's own code (its Ctrl-C handler is up once main() runs): Hydra's import maps PyYAML's
            # C loader. A fixed sleep could land in Python's start-up (`site`) on a loaded box, before any of ours
            _wait_for(lambda: _maps_hold(proc.pid, "_yaml"), 120, proc)
            time.sleep(0.5)  # composing the config
        else:
            _wait_for(lambda: _pids_with("edit_train.cli.worker", str(run_dir)), 180, proc)
            time.sleep(after_workers_s)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    line = _stop_says_one_line(out)
    assert proc.returncode == 130, out[-3000:]
    assert line.startswith("error: interrupted"), line
    time.sleep(0.5)
    assert _pids_with(str(run_dir)) == []


# --------------------------------------------------------------------------------------------------
# launchers/torchrun_multinode.sh: a configuration error is one line, never restarted by torchrun

REPO = Path(__file__).resolve().parents[2]
MULTINODE = REPO / "launchers" / "torchrun_multinode.sh"
KEY = str(auth.new_key(Path(tempfile.mkdtemp(prefix="edit-train-test-key-")) / "fed.key"))  # mode 0600


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster_job(name: str, lighthouse: str, *overrides: str, stdout: Any = subprocess.PIPE,
                 **env: str) -> subprocess.Popen:
    """torchrun_multinode.sh for cluster `name` (of a and b): one node, one worker, on loopback; its own process
    group."""
    full = cli_env(CLUSTER=name, LIGHTHOUSE=lighthouse, NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1",
                   RDZV_ENDPOINT=f"127.0.0.1:{_free_port()}", HOST_ADDR="127.0.0.1", MAX_RESTARTS="3",
                   GLOO_SOCKET_IFNAME="lo", KEY_FILE=KEY, **env)
    for var in ("EDIT_DRY_RUN", "EDIT_TRAIN_CLUSTER"):
        full.pop(var, None)
    return subprocess.Popen(["bash", str(MULTINODE), "logger=none", "train.progress=false", "model=tiny",
                             "cluster.clusters=[{name:a,ranks:1},{name:b,ranks:1}]", *overrides],
                            stdout=stdout, stderr=subprocess.STDOUT, text=True, env=full, cwd=REPO,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out


def _reusable(run_dir: Path) -> None:
    """run.dir takes the next launch: a whole run's check and a cluster job's find no run there."""
    check_run_dir(run_dir, "false", None)
    check_run_dir(run_dir, "false", "a")


def test_a_lighthouse_nobody_listens_on_is_one_line_before_torchrun(tmp_path: Path, small_corpus: str) -> None:
    """Issue 64: torchrun restarted the worker three times (four identical lines over 80 s) and left files in
    run.dir that refused the next launch there."""
    run_dir = tmp_path / "run"
    out = _finish(_cluster_job("a", f"127.0.0.1:{_free_port()}", f"data.source={small_corpus}", f"run.dir={run_dir}",
                               "train.steps=20"))
    line = _stop_says_one_line(out)
    assert "cannot reach the Lighthouse at 127.0.0.1:" in line and "Errno 111] Connection refused" in line, out
    assert line.count("Connection refused") == 1, line
    assert "rank 0 starting" not in out, out[-3000:]  # torchrun never started
    _reusable(run_dir)


def test_a_workers_configuration_error_is_not_restarted_by_torchrun(tmp_path: Path) -> None:
    """A configuration error only a worker finds (here: a corpus that is not there) ends the job in one line, exit 2,
    with torchrun's MAX_RESTARTS=3 unused: the worker started once."""
    run_dir = tmp_path / "run"
    house, address = start_lighthouse(tmp_path, f"federation.key_file={KEY}")
    try:
        proc = _cluster_job("a", address, f"data.source={tmp_path}/nothing/*.txt", f"run.dir={run_dir}")
        out = _finish(proc)
    finally:
        house.send_signal(signal.SIGTERM)
        house.wait(timeout=30)
    line = _stop_says_one_line(out)
    assert proc.returncode == 2, out[-3000:]
    assert "matched no files" in line, line
    assert out.count("rank 0 starting") == 1, out[-3000:]
    assert "torchrun was stopped" not in out and "torchrun exited" not in out, out[-3000:]
    _reusable(run_dir)


@pytest.mark.slow  # the default suite's 20-minute budget: the SIGINT/SIGTERM start-up stops above stay in it
def test_kill_9_of_a_cluster_job_while_its_worker_starts_leaves_no_worker(tmp_path: Path, small_corpus: str) -> None:
    """Issue 64: `kill -9` of a cluster's torchrun process group while its worker was still starting left the worker
    alive (it set its parent-death signal only once running, and took a dead parent for pid 1, which a container's
    subreaper is not). tests/helpers/orphan_probe.py is that subreaper; it holds the worker before it runs any of our code."""
    house, address = start_lighthouse(tmp_path, f"federation.key_file={KEY}")
    env = cli_env(CLUSTER="a", LIGHTHOUSE=address, NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1",
                  RDZV_ENDPOINT=f"127.0.0.1:{_free_port()}", HOST_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
                  KEY_FILE=KEY)
    for var in ("EDIT_DRY_RUN", "EDIT_TRAIN_CLUSTER"):
        env.pop(var, None)
    result = tmp_path / "probe.json"
    try:
        probe = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "helpers" / "orphan_probe.py"), str(result), "--",
                                "bash", str(MULTINODE), "logger=none", "model=tiny", f"data.source={small_corpus}",
                                f"run.dir={tmp_path / 'run'}", "cluster.clusters=[{name:a,ranks:1},{name:b,ranks:1}]"],
                               capture_output=True, text=True, env=env, cwd=REPO, timeout=400)
    finally:
        house.send_signal(signal.SIGTERM)
        house.wait(timeout=30)
    assert probe.returncode == 0, probe.stderr[-3000:]
    got = json.loads(result.read_text())
    assert got["worker"] is not None, got
    assert got["alive_after_10s"] is False, got


def _events(run_dir: Path, cluster: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(None, lines)) if e.get("cluster") == cluster]


@pytest.mark.slow  # two launches of a cluster job, the second trains to the end: ~2 min on 2 busy cores
def test_a_cluster_job_stopped_during_start_up_is_relaunched_with_the_same_command(tmp_path: Path,
                                                                                   small_corpus: str) -> None:
    """Issue 64: a cluster job stopped (Ctrl-C) while it waited to join its federation left its first event and no
    record; relaunched, it was refused once ("already holds cluster b's run …"), then restarted by torchrun, trained,
    and its summary counted a restart. Now: one line says what it continues, torchrun starts it once, no restart is
    counted. (Cluster a never comes: b trains alone after federation.quorum_timeout_s.)"""
    run_dir = tmp_path / "run"
    args = [f"data.source={small_corpus}", f"run.dir={run_dir}", "algo=edit", "algo.interval=4", "train.steps=12",
            "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.seq_len=32",
            "train.batch_size=2", "federation.min_clusters=1", "federation.quorum_timeout_s=20"]
    house, address = start_lighthouse(tmp_path, f"federation.key_file={KEY}")
    log = tmp_path / "first.log"
    try:
        with open(log, "w") as sink:
            first = _cluster_job("b", address, *args, stdout=sink, EDIT_TRAIN_WAIT_EVERY_S="2")
            _wait_for(lambda: "waiting for the federation" in log.read_text(), 300, first)
            os.killpg(first.pid, signal.SIGINT)  # Ctrl-C while it waits to join: before its first record
            first.wait(timeout=120)
        out1 = log.read_text()
        assert [e["event"] for e in _events(run_dir, "b")] == ["eval"], out1[-3000:]  # what the stop leaves
        assert not (run_dir / "clusters" / "b.progress.json").exists(), out1[-3000:]
        second = _cluster_job("b", address, *args)
        out2 = _finish(second, 400)
    finally:
        house.send_signal(signal.SIGTERM)
        house.wait(timeout=30)
    assert second.returncode == 0, out2[-4000:]
    assert "already holds" not in out2 and "Traceback" not in out2, out2[-4000:]
    assert out2.count("rank 0 starting") == 1, out2[-4000:]  # torchrun started it once: no restart
    said = [x for x in out2.splitlines() if "holds only its earlier start" in x]
    assert len(said) == 1 and said[0].startswith("cluster b: run.dir "), out2[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["per_cluster"]["b"]["restarts"] == 0 and summary["per_cluster"]["b"]["steps"] == 12, summary
