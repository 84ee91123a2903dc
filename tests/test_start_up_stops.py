"""Stops during start-up, through the real launchers (issue 64): Ctrl-C while `edit-train`'s workers import torch is
one line (no traceback per worker, no torch FakeTensor statistics); ..."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import cli_env, script_cmd


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
            time.sleep(3.0)  # importing Hydra / composing the config: ~6 s on 2 loaded cores
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
