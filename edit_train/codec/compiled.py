"""Which top-k formats this host has compiled (torch-free, numba-free: the planner reads it).

The fused top-k codec (`sparse_fused.py`, numba) compiles a kernel pair with each format's numbers as
constants the first time a process on a machine uses that format (`sparse.warm`, at start-up); numba keeps it
on disk, so later runs load it in well under a second. Compiling is ~20 CPU-seconds per process on the
development box — on a shared host whose ranks all compile at once, tens of seconds of start-up that the
planner has to count (docs/planner.md, "Start-up"). `sparse.warm` records each format it compiled here, in a
small JSON file beside numba's cache; a record written against other kernel sources or another numba is void.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

from edit_train.codec.sparse_format import SparseFormat

RECORD = "edit-train-compiled.json"
KERNELS = ("sparse_fused.py", "sparse_bits.py", "sparse_select.py", "sparse_elements.py")


def available() -> bool:
    """Whether the fused codec can run here at all (numba installed): without it nothing compiles."""
    return importlib.util.find_spec("numba") is not None


def cache_dir() -> Path:
    """Where numba keeps the kernels compiled here (`NUMBA_CACHE_DIR`, else `__pycache__` beside them)."""
    return Path(os.environ["NUMBA_CACHE_DIR"]) if os.environ.get("NUMBA_CACHE_DIR") else \
        Path(__file__).resolve().parent / "__pycache__"


def stamp() -> str:
    """The kernels' sources and numba's version: a compiled kernel is reused only while both are the same."""
    h = hashlib.sha256()
    for name in KERNELS:
        try:
            h.update((Path(__file__).resolve().parent / name).read_bytes())
        except OSError:
            pass
    try:
        h.update(importlib.metadata.version("numba").encode())
    except importlib.metadata.PackageNotFoundError:
        pass
    return h.hexdigest()[:16]


def key(f: SparseFormat) -> str:
    """A format's compiled constants (what `sparse_fused.specialized` compiles a kernel pair for)."""
    return f"chunk={f.chunk},group={f.group},k={f.k},bits={f.bits},scale={f.scale_dtype}"


def compiled() -> set[str]:
    """The formats this host has compiled for the current kernels (empty when unknown)."""
    try:
        data = json.loads((cache_dir() / RECORD).read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(data, dict) or data.get("stamp") != stamp() or not isinstance(data.get("formats"), list):
        return set()
    return {str(k) for k in data["formats"]}


def record(f: SparseFormat) -> None:
    """Note that format `f`'s kernels are compiled here (best effort: a read-only cache just goes unrecorded)."""
    have = compiled()
    if key(f) in have:
        return
    path = cache_dir() / RECORD
    tmp = path.with_name(f"{RECORD}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"stamp": stamp(), "formats": sorted(have | {key(f)})}) + "\n")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
