"""Issue 64 item 3: Ctrl-C under the default `checkpoint.every=0` (with `checkpoint.at_end` on) keeps what the run
trained: the stop at a step boundary writes a checkpoint, and `resume=auto` continues from it. Issue 69 item 8: a
signal while a cluster shuts down after its work is one line, not a KeyboardInterrupt traceback from an atexit
callback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import TINY, cli_env, read_events, script_cmd

LONE = ["experiment=single", "model=tiny", "logger=none", "train.progress=false", "train.seq_len=32",
        "train.batch_size=2", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1"]


def _trained(run_dir: Path) -> int:
    """The newest step metrics.jsonl says was trained (0: none yet)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    events = [json.loads(line) for line in lines[:-1]]  # the last may be half-written
    return max((e.get("step", 0) for e in events if e.get("event") == "train"), default=0)


def test_ctrl_c_saves_a_checkpoint_and_resume_continues_from_it(tmp_path: Path, small_corpus: str) -> None:
    run_dir = tmp_path / "run"
    cmd = [*script_cmd("edit-train", "edit_train.cli.train"), *LONE, "train.steps=100000",
           f"data.source={small_corpus}", f"run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                            start_new_session=True, cwd=tmp_path)
    try:
        deadline = time.time() + 240
        while _trained(run_dir) < 3:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and (saved[0] / "manifest.json").is_file(), err[-3000:]
    at = int(saved[0].name.removeprefix("step_"))
    assert at >= 3
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: interrupted") and f"{saved[0]} is intact" in last, last
    assert "nothing to resume" not in err

    resumed = subprocess.run([*script_cmd("edit-train", "edit_train.cli.train"), f"run.dir={run_dir}",
                              "resume=auto", f"train.steps={at + 2}"],
                             capture_output=True, text=True, env=cli_env(), cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {saved[0]} (step {at})" in resumed.stderr, resumed.stderr[-3000:]
    trains = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "train"]
    after = [e["step"] for e in trains if e["tokens"] > 0][-2:]
    assert after == [at + 1, at + 2]  # continued from the interrupt's checkpoint, not from step 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == at + 2 and summary["tokens"] == (at + 2) * 2 * 32


AFTER_THE_WORK = textwrap.dedent("""
    import atexit, sys, time
    from edit_train.cli.common import compose
    from edit_train.train.trainer import train

    train(compose(sys.argv[1:]))

    def shutting_down():  # what a cluster's shutdown may wait on (a federation's threads, the process group)
        print("shutting down", flush=True)
        time.sleep(120)

    atexit.register(shutting_down)
""")


def test_sigterm_while_shutting_down_after_the_work_is_one_line(tmp_path: Path, small_corpus: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", AFTER_THE_WORK, *TINY, f"run.dir={tmp_path / 'run'}",
                             f"data.source={small_corpus}", "train.steps=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                            start_new_session=True, cwd=tmp_path)
    try:
        line = ""
        while "shutting down" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.communicate()[1][-3000:]
        assert (tmp_path / "run" / "summary.json").is_file()
        for _ in range(2):  # a launcher's SIGTERM, then its second one
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                pass
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    tail = [line for line in err.splitlines() if "shutting down" in line]
    assert len(tail) == 1 and tail[0] == err.strip().splitlines()[-1], err[-3000:]
    assert "SIGTERM while shutting down after its work" in tail[0]
    assert proc.returncode == 128 + signal.SIGTERM


def test_the_same_stop_passed_on_is_not_a_second_stop(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A terminal's Ctrl-C reaches the local launcher and its workers; the launcher passes it on (SIGTERM) at
    once. That second signal is the same stop, not an impatient second one: the worker still stops at the step
    boundary and saves. A second signal later gives up at once."""
    from edit_train.train import signals

    clock = [100.0]
    monkeypatch.setattr(signals.time, "monotonic", lambda: clock[0])
    stop = signals.StopSignal.__new__(signals.StopSignal)
    stop.signum, stop.at, stop.who = None, 0.0, ""
    stop._handle(signal.SIGINT, None)
    clock[0] += 0.3
    stop._handle(signal.SIGTERM, None)  # the launcher's, 0.3 s later: nothing raised
    assert stop.signum == signal.SIGINT
    clock[0] += signals.SAME_STOP_S
    try:
        stop._handle(signal.SIGINT, None)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("a second stop must give up at once")


@pytest.mark.slow  # the default suite's 20-minute budget: one cluster's Ctrl-C save and resume stays in it
def test_ctrl_c_of_a_local_federation_saves_every_cluster(tmp_path: Path, small_corpus: str) -> None:
    """The demo's case: Ctrl-C (SIGINT to the process group: the local launcher and both clusters) under the
    default checkpoint.every=0 leaves a checkpoint of each cluster, and the last line says resume=auto
    continues every cluster from its own."""
    run_dir = tmp_path / "run"
    cmd = [*script_cmd("edit-train", "edit_train.cli.train"), "cluster.count=2", "cluster.ranks=1", "algo=edit",
           "algo.interval=4", *LONE[1:], "train.steps=100000", f"data.source={small_corpus}", f"run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                            start_new_session=True, cwd=tmp_path)

    def trained(cluster: str) -> int:
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]
        except OSError:
            return 0
        return max((e["step"] for e in map(json.loads, lines)
                    if e.get("event") == "train" and e.get("cluster") == cluster), default=0)

    try:
        deadline = time.time() + 300
        while min(trained("c0"), trained("c1")) < 6:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for cluster in ("c0", "c1"):
        saved = [p for p in (run_dir / "checkpoints" / cluster).glob("step_*") if (p / "manifest.json").is_file()]
        assert len(saved) == 1, (cluster, out[-3000:])
    last = out.strip().splitlines()[-1]
    assert "complete checkpoints are intact" in last and "resume=auto continues every cluster" in last, last
