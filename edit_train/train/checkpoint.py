"""Checkpoints: safetensors for tensors, JSON for metadata, a checksummed manifest written last.

Layout: `run.dir/checkpoints/step_NNNNNNNN/` holding, per rank, `rank{r}-{part}.safetensors` (model
shard, inner optimizer, outer state, penalty statistics, RNG) and `rank{r}-state.json`, plus
`manifest.json` (size + SHA-256 of every file). Every rank writes into `step_NNNNNNNN.tmp/`, fsyncs,
meets the others at a barrier, then rank 0 writes the manifest and renames the directory into place:
a crash mid-save leaves the previous checkpoint as the newest complete one. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from edit_train.fsutil import fsync_dir, fsync_file

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, corrupt, incompatible); the message names the file."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _contiguous_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}


class CheckpointManager:
    """Atomic multi-rank save, verified discovery, pickle-free load."""

    def __init__(self, root: str | Path, rank: int = 0, world_size: int = 1, keep: int = 2,
                 barrier: Callable[[], None] | None = None) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.barrier = barrier or (lambda: None)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    # ------------------------------------------------------------------ save
    def save(self, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
             crash_after_files: int | None = None) -> Path:
        """Write this rank's parts; every rank must call it. Returns the final directory.

        `crash_after_files` (tests only) raises after writing that many files, simulating a crash.
        """
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.barrier()
        written = 0
        for part, tdict in tensors.items():
            path = tmp / f"rank{self.rank}-{part}.safetensors"
            save_file(_contiguous_cpu(tdict), str(path), metadata={"step": str(step), "part": part})
            fsync_file(path)
            written += 1
            if crash_after_files is not None and written >= crash_after_files:
                raise RuntimeError(f"injected crash while saving checkpoint step {step}")
        state_path = tmp / f"rank{self.rank}-state.json"
        state_path.write_text(json.dumps(state, indent=1, sort_keys=True))
        fsync_file(state_path)
        self.barrier()
        if self.rank == 0:
            files = sorted(p for p in tmp.iterdir() if p.is_file())
            manifest = {"step": step, "world_size": self.world_size,
                        "files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}}
            mpath = tmp / MANIFEST
            mpath.write_text(json.dumps(manifest, indent=1, sort_keys=True))
            fsync_file(mpath)
            fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        complete = self.list_steps()
        for step in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------- discovery
    def list_steps(self) -> list[int]:
        """Steps of directories that have a manifest (not yet verified), oldest first."""
        if not self.root.is_dir():
            return []
        steps = []
        for p in self.root.iterdir():
            m = STEP_RE.match(p.name)
            if m and (p / MANIFEST).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def verify(self, path: Path) -> None:
        """Raise CheckpointError naming the first missing / truncated / corrupt file."""
        mpath = path / MANIFEST
        try:
            manifest = json.loads(mpath.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{mpath}: unreadable manifest ({exc})") from None
        for name, info in manifest.get("files", {}).items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in the manifest but missing")
            if f.stat().st_size != info["bytes"]:
                raise CheckpointError(f"{f}: size {f.stat().st_size} != {info['bytes']} in the manifest (truncated)")
            if sha256_file(f) != info["sha256"]:
                raise CheckpointError(f"{f}: SHA-256 mismatch with the manifest (corrupt)")

    def latest_valid(self) -> Path | None:
        """Newest checkpoint whose manifest verifies; corrupt ones are reported in one line and skipped."""
        for step in reversed(self.list_steps()):
            path = self.step_dir(step)
            try:
                self.verify(path)
            except CheckpointError as exc:
                log.warning("skipping checkpoint: %s", exc)
                continue
            return path
        return None

    # ------------------------------------------------------------------ load
    def load(self, path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """This rank's tensor parts (safetensors only) and JSON state."""
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("world_size") != self.world_size:
            raise CheckpointError(
                f"{path}: saved with {manifest.get('world_size')} processes, this run has {self.world_size}; "
                f"resume with the same cluster.groups x cluster.shard_size")
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        prefix = f"rank{self.rank}-"
        for name in manifest["files"]:
            if not name.startswith(prefix):
                continue
            if name.endswith(".safetensors"):
                try:
                    tensors[name[len(prefix):-len(".safetensors")]] = load_file(str(path / name))
                except Exception as exc:  # noqa: BLE001 - safetensors refuses anything else (no unpickling)
                    raise CheckpointError(f"{path / name}: not a valid safetensors file ({exc}); delete this "
                                          f"checkpoint or resume from an older one") from None
            elif not name.endswith("-state.json"):
                raise CheckpointError(f"{path / name}: unexpected file type; only safetensors and JSON are loaded")
        state_path = path / f"{prefix}state.json"
        try:
            state = json.loads(state_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{state_path}: unreadable ({exc})") from None
        return tensors, state
