"""Small durable-write helpers shared by checkpoints, exports and the data cache."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory entry (after a rename); silently skipped where directories cannot be fsynced."""
    try:
        fsync_file(path)
    except OSError:
        pass


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_json(path: Path, data: Any) -> None:
    """Write JSON to `path` through a temporary file renamed into place (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


__all__ = ["atomic_write_json", "current_umask", "fsync_dir", "fsync_file"]
