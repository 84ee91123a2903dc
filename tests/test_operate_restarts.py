"""Issue 48, restarts and failures under our launchers: Ctrl-C during start-up is one line, a relaunched cluster
resumes its own record, a worker dies with its launcher, a finished run or federation says so and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import cli_env, script_cmd

LONE = ["cluster=local", "algo=edit", "logger=none", "train.progress=false", "train.seq_len=32",
        "train.batch_size=2", "train.eval_every=0", "train.eval_batches=1"]


@pytest.mark.parametrize("after_s", [1.0, 3.0, 7.0])
def test_ctrl_c_during_start_up_is_one_line(tmp_path: Path, small_corpus: str, after_s: float) -> None:
    """Acceptance 3: Ctrl-C (SIGINT to the process group, as a terminal sends it) 1, 3 and 7 s after `edit-train`
    starts — during its imports, composing the config, building the model — ends in one line, no traceback."""
    proc = subprocess.Popen([*script_cmd("edit-train", "edit_train.cli.train"), *LONE, "train.steps=100000",
                             f"data.source={small_corpus}", f"run.dir={tmp_path / 'run'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                            start_new_session=True, cwd=tmp_path)
    try:
        time.sleep(after_s)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in out, out[-3000:]
    said = [line for line in out.splitlines() if "interrupted" in line]
    assert len(said) == 1 and said[0] == out.strip().splitlines()[-1], out[-3000:]
    assert proc.returncode == 130, out[-3000:]
