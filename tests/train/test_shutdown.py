"""Clean shutdown: SIGINT to `edit-train cluster=local_2x2` stops every process quickly, leaves no
orphans and no half-written checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edit_train.train.checkpoint import CheckpointManager


def _processes_mentioning(needle: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_sigint_stops_everything_cleanly(tmp_path: Path, small_corpus: str) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "edit_train.cli.train", "cluster=local_2x2", "algo=edit", "logger=none",
           "train.progress=false", f"data.source={small_corpus}", f"run.dir={run_dir}", "train.seq_len=32",
           "train.batch_size=2", "train.eval_every=0", "train.eval_batches=1", "train.steps=100000",
           "algo.interval=2", "checkpoint.every=2", "checkpoint.keep=3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.time() + 180
        ckpts = CheckpointManager(run_dir / "checkpoints" / "c0")  # a federation: checkpoints/<cluster>/
        while time.time() < deadline and len(ckpts.list_steps()) < 2:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        assert len(ckpts.list_steps()) >= 2, "no checkpoint appeared"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        t0 = time.time()
        _, err = proc.communicate(timeout=30)
        assert time.time() - t0 < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "Traceback" not in err.splitlines()[-1] if err.strip() else True
    time.sleep(1.0)
    assert _processes_mentioning(str(run_dir)) == []
    newest = ckpts.step_dir(ckpts.list_steps()[-1])
    ckpts.verify(newest)  # complete: every file present with its checksum
    assert ckpts.latest_valid() == newest
    last = err.strip().splitlines()[-1]  # what Ctrl-C says: the checkpoint resume=auto continues from
    assert last.startswith("error: interrupted") and "intact" in last and "step_" in last, last
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert not (run_dir / "summary.json").exists()
