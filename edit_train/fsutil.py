"""Small durable-write helpers shared by checkpoints, exports and the data cache."""

from __future__ import annotations

import os


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


__all__ = ["current_umask", "fsync_dir", "fsync_file"]
