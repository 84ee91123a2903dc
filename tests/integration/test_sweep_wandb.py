"""Hydra multirun sweeps and one W&B run per worker group (offline)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_trainer import _wandb_records

QUICK = ["logger=none", "train.progress=false", "train.seq_len=32", "train.batch_size=2", "train.eval_every=0",
         "train.eval_batches=1", "train.steps=4", "algo.interval=2"]


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", "edit_train.cli.train", *args], capture_output=True, text=True,
                          env=env, timeout=400, cwd=tmp)


def test_multirun_gives_each_job_its_own_complete_run_dir(tmp_path: Path, small_corpus: str) -> None:
    sweep = tmp_path / "sweep"
    proc = _run(["-m", "algo=ddp,edit", "cluster=local_2x1", *QUICK, f"data.source={small_corpus}",
                 f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    algos = []
    for job in ("0", "1"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["completed"] and set(summary["per_cluster"]) == {"c0", "c1"}
        algos.append(summary["algo"])
    assert algos == ["ddp", "edit"]


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_wandb_one_offline_run_per_cluster_in_one_group(tmp_path: Path, small_corpus: str) -> None:
    run_dir = tmp_path / "run"
    args = ["cluster=local_2x1", "algo=edit", *QUICK, "logger=wandb", "run.name=exp-42",
            f"data.source={small_corpus}", f"run.dir={run_dir}"]
    args.remove("logger=none")
    proc = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2, files
    groups, job_types, synced = set(), set(), []
    for f in files:
        records = _wandb_records(Path(f))
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        groups.add(run.run_group)
        job_types.add(run.job_type)
        keys = {("/".join(i.nested_key) if i.nested_key else i.key)
                for r in records if r.WhichOneof("record_type") == "history" for i in r.history.item}
        assert {"train/loss", "sync/pseudo_grad_norm", "sync/sync"} <= keys, keys
        synced.append(keys)
    assert groups == {"exp-42"}
    assert job_types == {"local_2x1-c0", "local_2x1-c1"}  # one W&B run per cluster
