"""Shared fixtures: an isolated data cache, a small deterministic corpus, tiny-run overrides, CLI helpers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import pytest

# The smallest training run that still exercises log / eval / checkpoint paths.
TINY = [
    "algo=ddp",  # one process in this interpreter unless a test asks for more (the default run is 2 clusters)
    "cluster=local",
    "model=tiny",
    "train.steps=6",
    "train.batch_size=2",
    "train.seq_len=32",
    "train.eval_every=3",
    "train.eval_batches=2",
    "train.log_every=2",
    "logger=none",
    "train.progress=false",
    "train.threads=1",  # two shared cores: one intra-op thread per in-process run
]

CORPUS_FILES = 30
CORPUS_MIN_BYTES = 300_000


@pytest.fixture(scope="session", autouse=True)
def edit_train_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every test (and every subprocess it starts) uses a fresh cache, never ~/.cache/edit-train: a CI
    machine must prepare corpora itself."""
    cache = tmp_path_factory.mktemp("edit-train-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDIT_TRAIN_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`data.source` glob of ~30 stdlib modules (sorted, so deterministic for a Python version), >= 300 KB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    total = n = 0
    for f in sorted(root.glob("*.py")):
        size = f.stat().st_size
        if 5_000 <= size <= 40_000:
            shutil.copyfile(f, out / f.name)
            total += size
            n += 1
            if n >= CORPUS_FILES and total >= CORPUS_MIN_BYTES:
                break
    assert total >= CORPUS_MIN_BYTES, f"stdlib too small for the test corpus ({total} bytes in {n} files)"
    return f"{out}/*.py"


@pytest.fixture(params=["fused", "eager"])
def both_codecs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a sparse-codec test with numba's one-pass CPU codec and with the eager torch path (the GPU's)."""
    from edit_train.codec import sparse, sparse_fused

    if request.param == "fused" and not sparse_fused.AVAILABLE:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(sparse, "FUSED", request.param == "fused")
    return str(request.param)


@pytest.fixture(scope="module")
def torch_one_thread():
    """Two shared cores: torch's default of one intra-op thread per core oversubscribes them badly
    (a tiny step goes from ~0.05 s to ~1 s under load). In-process runs use one thread; restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_overrides(run_dir: Path | str, source: str | None = None, *extra: str) -> list[str]:
    """TINY plus run.dir, the data source and any overrides (later ones win)."""
    out = [*TINY, f"run.dir={run_dir}"]
    if source is not None:
        out.append(f"data.source={source}")
    return [*out, *extra]


def run_train(overrides: list[str]) -> dict[str, Any]:
    """Compose the config as `edit-train` would and train in this process."""
    from edit_train.cli.common import compose
    from edit_train.train.trainer import train

    return train(compose(overrides))


def read_events(path: Path | str) -> list[dict[str, Any]]:
    """Every line of a metrics.jsonl, strictly (a line that is not JSON fails the test)."""
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
                "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"})
    env.update(extra)
    return env


def script_cmd(script: str, module: str) -> list[str]:
    """The installed console script if it is on PATH, else `python -m module`."""
    exe = shutil.which(script)
    return [exe] if exe else [sys.executable, "-m", module]


def start_lighthouse(tmp_path: Path, *overrides: str, join_timeout_s: float = 5.0) -> tuple[subprocess.Popen, str]:
    """An edit-train-lighthouse on 127.0.0.1 (a free port), its address once it wrote it (60 s at most)."""
    addr_file = tmp_path / "lighthouse.addr"
    proc = subprocess.Popen([*script_cmd("edit-train-lighthouse", "edit_train.cli.lighthouse"),
                             "--bind", "127.0.0.1:0", "--address-file", str(addr_file),
                             "federation.heartbeat_timeout_s=2", f"federation.join_timeout_s={join_timeout_s:g}",
                             *overrides],
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.time() + 60
    while not addr_file.exists() or not addr_file.read_text().strip():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    return proc, addr_file.read_text().strip()


def run_cli(script: str, module: str, args: list[str], timeout: float = 180, cwd: Path | None = None,
            **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*script_cmd(script, module), *args], capture_output=True, text=True,
                          timeout=timeout, env=cli_env(**env), cwd=cwd)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`data.source` glob of the first 40 stdlib modules (sorted): the federation tests' corpus."""
    src = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus40")
    for f in sorted(src.glob("*.py"))[:40]:
        (out / f.name).write_bytes(f.read_bytes())
    return str(out / "*.py")


def resumed_bit_identically(tmp_path: Path, corpus, *common: str) -> list[dict[str, Any]]:
    """9 steps uninterrupted == 6 steps (checkpoint every 3) then resume=auto to 9, every checkpointed tensor bit for
    bit (asserted). Returns the step-9 checkpoint's files, loaded, for the caller's own checks."""
    import torch
    from safetensors.torch import load_file

    full, seg = tmp_path / "full", tmp_path / "seg"
    s_full = run_train(tiny_overrides(full, corpus, *common, "train.steps=9", "checkpoint.every=9"))
    run_train(tiny_overrides(seg, corpus, *common, "train.steps=6", "checkpoint.every=3"))
    s2 = run_train(tiny_overrides(seg, corpus, *common, "train.steps=9", "checkpoint.every=3", "resume=auto"))
    assert s2["steps"] == 9 and s2["final_val_loss"] == s_full["final_val_loss"]
    a_files = sorted((full / "checkpoints").glob("step_00000009/**/*.safetensors"))
    b_files = sorted((seg / "checkpoints").glob("step_00000009/**/*.safetensors"))
    assert a_files and [f.relative_to(full) for f in a_files] == [f.relative_to(seg) for f in b_files]
    loaded = []
    for fa, fb in zip(a_files, b_files):
        a, b = load_file(str(fa)), load_file(str(fb))
        assert a.keys() == b.keys(), fa.name
        assert not [k for k in a if not torch.equal(a[k], b[k])], fa.name
        loaded.append(a)
    return loaded


@pytest.fixture(autouse=True)
def _no_stop_left_over():
    """A test that stops an in-process run by a signal (train/signals.py) sets the process's `waits.STOP`; the next
    test's waits for the federation would give up at once. Every test starts and ends without it."""
    from edit_train.local_sgd.sync import waits

    waits.STOP.clear()
    yield
    waits.STOP.clear()
