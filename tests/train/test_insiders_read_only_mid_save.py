"""Issue 49 (c): `checkpoints/` turning read-only *during* a save (not from the start) ends in one line, exit 2,
naming the path and what is intact (the previous checkpoint). The fault is a real one — the directory is
remounted read-only (a bind mount in a mount namespace of the run's own) between two files of the step-4 save,
or after its manifest, just before the rename — injected at the writer by a `sitecustomize` in the run's
processes; and in process, a writer that fails with EROFS between parts."""

from __future__ import annotations

import errno
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import cli_env, script_cmd
from edit_train.cli.common import one_line
from edit_train.train import checkpoint
from edit_train.train.checkpoint import CheckpointError, CheckpointManager
from test_operator_failures import LONE, TRAIN, _mounts, _one_error_line

# every Python process of the run: after the fsync of the file the fault names, remount checkpoints/ read-only
_SITE = '''
import os
if os.environ.get("FAULT_DIR"):
    import subprocess
    from edit_train.train import checkpoint as c
    fsync = c.fsync_file
    def fsync_file(path):
        fsync(path)
        if "step_00000004.tmp" in str(path) and os.path.basename(str(path)) == os.environ["FAULT_AFTER"]:
            subprocess.run(["mount", "-o", "remount,bind,ro", os.environ["FAULT_DIR"]], check=True)
    c.fsync_file = fsync_file
'''


@pytest.mark.parametrize("after", ["rank0-model.safetensors", "manifest.json"], ids=["between parts", "at the rename"])
def test_checkpoints_turning_read_only_mid_save_is_one_line_and_keeps_the_last(tmp_path: Path, after: str) -> None:
    prefix = _mounts()
    if prefix is None:
        pytest.skip("no mount namespaces on this host (unshare)")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITE)
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True)
    p = shlex.quote(str(ckpt))
    cmd = " ".join(shlex.quote(a) for a in [*script_cmd(*TRAIN), *LONE, "train.steps=4", "checkpoint.every=2",
                                             f"run.dir={run_dir}"])
    env = cli_env()
    env.update(FAULT_DIR=str(ckpt), FAULT_AFTER=after,
               PYTHONPATH=f"{site}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(site))
    proc = subprocess.run([*prefix, "sh", "-c", f"set -e; mount --bind {p} {p}; exec {cmd}"], capture_output=True,
                          text=True, timeout=300, env=env)
    line = _one_error_line(proc, "cannot save checkpoint step 4", str(ckpt / "step_00000004"), "Read-only file system",
                           f"the last complete checkpoint {ckpt / 'step_00000002'} is intact", "resume=auto")
    assert line.count("Read-only file system") == 1, line  # said once, not again from a chained error
    assert (ckpt / "step_00000002" / "manifest.json").is_file()
    assert CheckpointManager(ckpt).latest_valid() == ckpt / "step_00000002"  # the partial save is never loaded


def test_a_writer_failing_between_parts_names_the_file_and_the_last_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(tmp_path / "checkpoints")
    parts = {"model": {"w": torch.ones(4)}, "optim": {"m": torch.zeros(4)}}
    first = mgr.save(2, parts, {"step": 2})
    real = checkpoint.save_file

    def save_file(tensors: Any, path: str, metadata: Any = None) -> None:
        if path.endswith("rank0-optim.safetensors"):
            raise OSError(errno.EROFS, "Read-only file system", path)
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    with pytest.raises(CheckpointError) as err:
        mgr.save(4, parts, {"step": 4})
    line = one_line(err.value)
    assert line == str(err.value) and "\n" not in line, line  # nothing chained onto the line
    assert "step_00000004.tmp/rank0-optim.safetensors: Read-only file system" in line, line
    assert f"the last complete checkpoint {first} is intact" in line, line
    assert mgr.latest_valid() == first
