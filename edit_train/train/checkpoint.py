"""Checkpoints: safetensors for tensors, JSON for metadata, a checksummed manifest written last.

Layout: `run.dir/checkpoints/step_NNNNNNNN/` holding, per rank, `rank{r}-{part}.safetensors` (model
shard, inner optimizer, outer state, penalty statistics, RNG) and `rank{r}-state.json`, plus
`manifest.json` (size + SHA-256 of every file). Every rank writes into `step_NNNNNNNN.tmp/`, fsyncs,
meets the others at a barrier, then rank 0 writes the manifest and renames the directory into place:
a crash mid-save leaves the previous checkpoint as the newest complete one. Nothing is unpickled.

What is read back is parsed totally: the manifest and the state JSON are read with a size cap before
parsing and a bounded nesting depth, the manifest must have the writer's schema, and every file it names
must be a plain name that (symlinks resolved) stays inside its checkpoint directory, which stays inside the
root. Any violation is one `CheckpointError` line naming the file; `latest_valid()` skips that checkpoint.

What is loaded is checked too (`check_tensors`): every floating-point value finite, and every tensor of a dtype
its part holds (floating point for model, optimizer, outer state and residuals; counts for the aggregation
rule's statistics and the requeued batches; bytes for the RNG) — a checkpoint holding NaN, or an int8 or bool
tensor where a weight goes, is one line naming the file and tensor, not a run that trains on it. For forensics
(loading a diverged run to look at it) set `EDIT_TRAIN_CHECKPOINT_UNCHECKED=1`: the checks then only warn.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from edit_train import safejson
from edit_train.fsutil import fsync_dir, fsync_file

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20  # read no more of a manifest than this (a real one is ~150 bytes per file)
MAX_STATE_BYTES = 64 << 20  # nor of a rank's state JSON (a real one is a few KiB)
MAX_FILES = 100_000
_SHA256 = re.compile(r"[0-9a-f]{64}")
UNCHECKED_ENV = "EDIT_TRAIN_CHECKPOINT_UNCHECKED"  # =1: load non-finite values / unexpected dtypes (forensics)
_COUNTS = (torch.int64, torch.int32)
_PART_DTYPES: dict[str, tuple[torch.dtype, ...]] = {"rng": (torch.uint8,), "requeue": _COUNTS, "penalty": _COUNTS}
_FLOAT_PARTS = ("model", "optim", "outer", "residual", "penalty")  # penalty: floats or counts


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, corrupt, incompatible); the message names the file."""


def _why(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _inside(path: Path, root: Path) -> bool:
    """Does `path` (symlinks resolved) lie inside the directory `root` (resolved)?"""
    try:
        path.resolve().relative_to(root.resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop; outside
        return False
    return True


def read_json(path: Path, max_bytes: int, what: str) -> dict[str, Any]:
    """A JSON object from a regular file, read with a size cap before parsing and a bounded nesting depth
    (CheckpointError naming `path` otherwise). Never blocks on a FIFO or reads a device."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable {what} ({_why(exc)})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: unreadable {what} (not a regular file)")
        if st.st_size > max_bytes:
            raise CheckpointError(f"{path}: {what} of {st.st_size} bytes exceeds the {max_bytes}-byte cap")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable {what} ({_why(exc)})") from None
    finally:
        os.close(fd)
    try:
        doc = safejson.loads(data, max_bytes)
    except ValueError as exc:
        raise CheckpointError(f"{path}: unreadable {what} ({_why(exc)})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: {what} is a JSON {type(doc).__name__}, not an object")
    return doc


def _nat(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_name(name: Any) -> str | None:
    """Why `name` is not a plain file name of a checkpoint directory (None when it is one)."""
    if not isinstance(name, str):
        return "not a string"
    if not name or len(name.encode("utf-8", "surrogatepass")) > 255:
        return "empty or longer than 255 bytes"
    if name in (".", "..") or "/" in name or "\\" in name or not name.isprintable():
        return "not a plain file name (a path, '..', or unprintable characters)"
    if name == MANIFEST:
        return "the manifest cannot list itself"
    return None


def parse_manifest(doc: Any, where: str | Path) -> dict[str, Any]:
    """The manifest `doc` checked against the schema the writer uses: {"step": int >= 0, "world_size":
    int >= 1, "files": {plain name: {"bytes": int >= 0, "sha256": 64 hex}}} (keys a later writer may add
    are ignored); CheckpointError otherwise."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: malformed manifest ({why})")

    if not isinstance(doc, dict):
        raise bad(f"a JSON {type(doc).__name__}, not an object")
    if not _nat(doc.get("step")):
        raise bad("step is not an integer >= 0")
    if not (_nat(doc.get("world_size")) and doc["world_size"] >= 1):
        raise bad("world_size is not an integer >= 1")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise bad("files is not an object")
    if len(files) > MAX_FILES:
        raise bad(f"{len(files)} files, more than {MAX_FILES}")
    for name, info in files.items():
        why = check_name(name)
        if why is not None:
            raise bad(f"file name {name!r:.80}: {why}")
        if not isinstance(info, dict) or "bytes" not in info or "sha256" not in info:
            raise bad(f"{name}: entry is not an object with bytes and sha256")
        if not _nat(info["bytes"]):
            raise bad(f"{name}: bytes is not an integer >= 0")
        if not (isinstance(info["sha256"], str) and _SHA256.fullmatch(info["sha256"])):
            raise bad(f"{name}: sha256 is not 64 lowercase hex digits")
    return doc


def check_tensors(part: str, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Every value of a loaded part finite and of a dtype the part holds (CheckpointError, one line naming the
    file and the tensor; with EDIT_TRAIN_CHECKPOINT_UNCHECKED=1 a warning instead)."""
    for key, t in tensors.items():
        why = None  # a model's buffers may be counts (the routed-token tally: int64)
        allowed = _COUNTS if part == "model" and key.startswith("buffer/") else _PART_DTYPES.get(part, ())
        if part in _FLOAT_PARTS and not t.is_floating_point() and t.dtype not in allowed:
            why = f"is {t.dtype}, where this part holds floating-point values"
        elif part in _PART_DTYPES and part not in _FLOAT_PARTS and t.dtype not in allowed:
            why = f"is {t.dtype}, where this part holds {', '.join(str(d) for d in allowed)}"
        elif t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            why = f"holds {int((~torch.isfinite(t)).sum())} non-finite value(s)"
        if why is not None:
            msg = f"{where}: tensor {key!r} {why}"
            if os.environ.get(UNCHECKED_ENV) == "1":
                log.warning("%s (loaded anyway: %s=1)", msg, UNCHECKED_ENV)
                continue
            raise CheckpointError(f"{msg}: refused (resume from an older checkpoint, or set {UNCHECKED_ENV}=1 to "
                                  "load it for forensics)")


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
        self._writing: Path | None = None  # the file a save is writing (what a failed save names)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    # ------------------------------------------------------------------ save
    def save(self, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
             crash_after_files: int | None = None) -> Path:
        """Write this rank's parts; every rank must call it. Returns the final directory.

        `crash_after_files` (tests only) raises after writing that many files, simulating a crash.
        """
        self._writing = None
        try:
            return self._save(step, tensors, state, crash_after_files)
        except OSError as exc:  # disk full, a read-only or vanished checkpoints/: one line, what is intact
            failure: BaseException = exc
        except Exception as exc:  # safetensors reports its own write errors (os error N inside the text)
            if type(exc).__name__ != "SafetensorError":
                raise
            failure = exc
        # raised outside the handler: the line is the whole story (no chained context for a caller to append)
        raise CheckpointError(self.unwritable(step, failure))

    def unwritable(self, step: int, exc: BaseException) -> str:
        """What a failed save says: the path (the file being written when it failed), why, and what is intact
        (the last complete checkpoint) — also when checkpoints/ turned read-only mid-save and the partial
        temporary directory cannot be removed (no one loads it; the next save removes it)."""
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # a part written before the failure frees its space again
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else _why(exc)
        if "Read-only file system" in why or "os error 30" in why:
            why = "Read-only file system"
        elif "No space left on device" in why or "os error 28" in why:
            why = "No space left on device"
        where = getattr(exc, "filename", None) or self._writing or tmp
        try:
            last = self.latest_valid()
        except (CheckpointError, OSError):
            last = None
        intact = f"the last complete checkpoint {last} is intact" if last is not None else \
            "no checkpoint of this run was complete before it"
        left = f"; its partial {tmp.name} is never loaded" if tmp.exists() else ""
        return (f"cannot save checkpoint step {step}: {where}: {why}; {intact} (a save is written under a "
                f"temporary name and renamed into place{left}); free space or make {self.root} writable, then "
                "resume=auto")

    def _save(self, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
              crash_after_files: int | None = None) -> Path:
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.barrier()
        written = 0
        for part, tdict in tensors.items():
            path = self._writing = tmp / f"rank{self.rank}-{part}.safetensors"
            save_file(_contiguous_cpu(tdict), str(path), metadata={"step": str(step), "part": part})
            fsync_file(path)
            written += 1
            if crash_after_files is not None and written >= crash_after_files:
                raise RuntimeError(f"injected crash while saving checkpoint step {step}")
        state_path = self._writing = tmp / f"rank{self.rank}-state.json"
        state_path.write_text(json.dumps(state, indent=1, sort_keys=True))
        fsync_file(state_path)
        self.barrier()
        if self.rank == 0:
            files = sorted(p for p in tmp.iterdir() if p.is_file())
            manifest = {"step": step, "world_size": self.world_size,
                        "files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}}
            mpath = self._writing = tmp / MANIFEST
            mpath.write_text(json.dumps(manifest, indent=1, sort_keys=True))
            fsync_file(mpath)
            fsync_dir(tmp)
            self._writing = final
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

    def member(self, path: Path, name: str) -> Path:
        """`path / name` for a plain file name (or the manifest's), refused unless it, symlinks resolved,
        stays inside the checkpoint directory `path`, which itself stays inside this manager's root."""
        if not _inside(path, self.root):
            raise CheckpointError(f"{path}: resolves outside the checkpoint root {self.root} (a symlink?): refused")
        if name != MANIFEST and check_name(name) is not None:
            raise CheckpointError(f"{path}: {name!r:.80} is not a plain file name: refused")
        f = path / name
        if not _inside(f, path):
            raise CheckpointError(f"{f}: resolves outside the checkpoint directory (a symlink?): refused")
        return f

    def read_manifest(self, path: Path) -> dict[str, Any]:
        """The checked manifest of checkpoint directory `path` (CheckpointError naming the problem)."""
        mpath = self.member(path, MANIFEST)
        return parse_manifest(read_json(mpath, MAX_MANIFEST_BYTES, "manifest"), mpath)

    def verify(self, path: Path) -> None:
        """Raise CheckpointError naming the first missing / truncated / corrupt / out-of-place file."""
        manifest = self.read_manifest(path)
        for name, info in manifest["files"].items():
            f = self.member(path, name)
            try:
                st = f.stat()
                if not stat.S_ISREG(st.st_mode):
                    raise CheckpointError(f"{f}: listed in the manifest but not a regular file")
                if st.st_size != info["bytes"]:
                    raise CheckpointError(f"{f}: size {st.st_size} != {info['bytes']} in the manifest (truncated)")
                if sha256_file(f) != info["sha256"]:
                    raise CheckpointError(f"{f}: SHA-256 mismatch with the manifest (corrupt)")
            except FileNotFoundError:
                raise CheckpointError(f"{f}: listed in the manifest but missing") from None
            except OSError as exc:
                raise CheckpointError(f"{f}: unreadable ({_why(exc)})") from None

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
        manifest = self.read_manifest(path)
        if manifest.get("world_size") != self.world_size:
            raise CheckpointError(
                f"{path}: saved with {manifest.get('world_size')} processes, this run has {self.world_size}; "
                f"resume with the same cluster.count x cluster.ranks")
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        prefix = f"rank{self.rank}-"
        for name in manifest["files"]:
            if not name.startswith(prefix):
                continue
            if name.endswith(".safetensors"):
                f = self.member(path, name)
                part = name[len(prefix):-len(".safetensors")]
                try:
                    tensors[part] = load_file(str(f))
                except Exception as exc:  # noqa: BLE001 - safetensors refuses anything else (no unpickling)
                    raise CheckpointError(f"{f}: not a valid safetensors file ({_why(exc)}); delete this "
                                          f"checkpoint or resume from an older one") from None
                check_tensors(part, tensors[part], f)
            elif not name.endswith("-state.json"):
                raise CheckpointError(f"{path / name}: unexpected file type; only safetensors and JSON are loaded")
        state = read_json(self.member(path, f"{prefix}state.json"), MAX_STATE_BYTES, "state")
        return tensors, state
