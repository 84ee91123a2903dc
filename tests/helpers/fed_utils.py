"""Helpers for federation tests: start `edit-train` (a Lighthouse + cluster jobs) in the background, follow
its metrics.jsonl, find a cluster's processes by `EDIT_TRAIN_CLUSTER`, read anchors from checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

BASE = ["cluster=local", "model=tiny", "logger=none", "train.progress=false", "train.seq_len=32", "train.eval_batches=1",
        "train.eval_every=0", "train.log_every=2",
        "federation.heartbeat_timeout_s=2", "federation.collective_timeout_s=15", "run.restart_delay_s=1"]


def start(run_dir: Path, corpus: str, *overrides: str, start_new_session: bool = False) -> subprocess.Popen:
    """`start_new_session`: the run gets its own process group (`os.killpg(proc.pid, …)` ends all of it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "edit_train.cli.train", *BASE, f"data.source={corpus}", f"run.dir={run_dir}",
           *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=start_new_session)


def finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"federation did not finish in {timeout}s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out[-4000:]
    return out


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def wait_for(run_dir: Path, pred: Any, timeout: float = 300, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(pred(e) for e in events(run_dir)):
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"federation exited early:\n{proc.stdout.read()[-4000:] if proc.stdout else ''}")
        time.sleep(0.2)
    raise AssertionError("timed out waiting for an event")


def cluster_pids(name: str, run_dir: Path) -> list[int]:
    """Processes whose environment says EDIT_TRAIN_CLUSTER=<name> and whose command line is this run's."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f"EDIT_TRAIN_CLUSTER={name}".encode() in env and str(run_dir) in cmd:
            pids.append(int(entry.name))
    return pids


def kill_cluster(name: str, run_dir: Path) -> list[int]:
    pids = cluster_pids(name, run_dir)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def anchors(run_dir: Path, cluster: str, ranks: int = 1) -> dict[str, torch.Tensor]:
    """A cluster's final anchor (full tensors, shards concatenated along dim 0)."""
    ckpt = sorted((run_dir / "checkpoints" / cluster).glob("step_*[0-9]"))[-1]
    shards = [load_file(str(ckpt / f"rank{r}-outer.safetensors")) for r in range(ranks)]
    return {k: torch.cat([s[k] for s in shards]) if shards[0][k].dim() else shards[0][k]
            for k in shards[0] if "/anchor/" in k}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def syncs(evs: list[dict[str, Any]], cluster: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["event"] == "sync" and e.get("cluster") == cluster]


def max_gap(evs: list[dict[str, Any]], cluster: str, start_step: int = 0) -> float:
    walls = [e["wall"] for e in evs if e["event"] == "train" and e.get("cluster") == cluster and e["step"] > start_step]
    return max(b - a for a, b in zip(walls, walls[1:])) if len(walls) > 1 else 0.0
