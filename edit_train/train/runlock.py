"""One writer per cluster job and run directory: `run.dir/clusters/<name>.lock`.

Two launches on one `run.dir` must never both write a cluster's checkpoints, metrics and W&B runs. The rule,
the same for every launch path (the local launcher, torchrun_multinode.sh, Slurm, a lone run):

* **Rank 0 of each cluster job holds its cluster's lock** for as long as it trains (`job_lock`, taken by
  `edit-train` / the local launcher's worker before the trainer starts, so before anything is written).
  A second job for the same cluster and run.dir is refused in one line naming the holder's PID and host.
* **Before anything is written**, `edit-train` probes the locks of the clusters it is about to start
  (`check_free`: the local launcher checks every cluster it launches, a cluster job its own) and refuses in
  the same line, so a refused launch leaves run.dir as it was. The probe creates no file.

The lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on a descriptor kept open while the job trains. The kernel
releases it when the process ends, however it ends (SIGKILL, OOM killer): a lock nobody holds is free.
On NFS, Linux implements flock with the file server's byte-range locks, so it holds across hosts sharing
run.dir; Lustre needs the `flock` mount option, GPFS and local filesystems have it.

The file holds JSON {pid, host, started, cluster} for the refusal message only: it is metadata, never the
lock. Hence "stale" means:

* a holder that died (killed, crashed, its host rebooted) no longer holds the flock, so its lock is free
  whatever its file still says; the next job takes it and rewrites the file. Nothing to clean up.
* a holder whose *host* died without releasing (the file server has not noticed yet) still holds it until
  the server drops that client's locks (NFSv4: when its lease expires, about 90 s); the message says so.
  If the server never does (NFSv3 with a host that does not come back), deleting the lock file is the
  manual way out: a new job creates a new file and locks that. Delete it only when the holder is gone.
* a filesystem without locks (flock fails with ENOLCK / EOPNOTSUPP): the metadata is all there is; a job
  is refused when the file names a live process on this host, otherwise it goes on, with a warning.

A process that already holds a lock takes it again without blocking itself (sequential runs in one process).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

log = logging.getLogger(__name__)

_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_BUSY = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES}
RETRY_S = 0.5  # a probe holds a free lock for microseconds: a taker retries this long before refusing


class RunLocked(ValueError):
    """Another process writes this cluster's part of run.dir; the message names it (one line)."""


def lock_path(run_dir: str | os.PathLike[str], cluster: str) -> Path:
    return Path(run_dir).expanduser() / "clusters" / f"{cluster}.lock"


# lock files this process holds: realpath -> [fd, holds]
_HELD: dict[str, list[int]] = {}


def _key(path: Path) -> str:
    return os.path.realpath(path)


def _alive_here(info: dict[str, Any]) -> bool | None:
    """Whether the recorded holder is a live process on this host (None: another host, or no PID)."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return None
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _holder(fd: int) -> dict[str, Any]:
    """The holder's metadata. Read again briefly while it is missing or names a process gone from this host
    (a new holder writes its own right after it took the lock)."""
    info: dict[str, Any] = {}
    for _ in range(5):
        info = _read(fd)
        if info.get("pid") and _alive_here(info) is not False:
            return info
        time.sleep(0.05)
    return info


def _message(run_dir: str | os.PathLike[str], cluster: str, info: dict[str, Any]) -> str:
    if info.get("pid"):
        who = f"PID {info['pid']} on host {info.get('host', '?')}"
        if info.get("started"):
            who += f" (since {info['started']})"
    else:
        who = "another process (its PID and host are not recorded yet)"
    msg = f"run.dir {run_dir}: cluster {cluster} is being written by {who}; stop it first or pick another run.dir"
    host = info.get("host")
    if host and host != socket.gethostname():
        msg += (f" (if {host} is down, its lock lapses when the file server drops its locks, NFSv4: ~90 s; "
                f"only if it never does, delete {lock_path(run_dir, cluster)})")
    return msg


def _try_flock(fd: int) -> bool | None:
    """True: locked; False: someone holds it; None: this filesystem has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        if exc.errno in _NO_LOCKS:
            return None
        raise
    return True


def held_by(run_dir: str | os.PathLike[str], cluster: str) -> dict[str, Any] | None:
    """None when `cluster`'s lock in run_dir is free (or held by this process); else the holder's metadata
    ({} when not recorded). Creates and changes nothing."""
    path = lock_path(run_dir, cluster)
    if _key(path) in _HELD:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        got = _try_flock(fd)
        if got is False:
            return _holder(fd)
        if got is None:
            info = _read(fd)
            return info if _alive_here(info) else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_free(run_dir: str | os.PathLike[str], clusters: Iterable[str]) -> None:
    """Raise RunLocked (one line) when any of `clusters` is being written into run_dir by another process."""
    for name in clusters:
        info = held_by(run_dir, name)
        if info is not None:
            raise RunLocked(_message(run_dir, name, info))


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def acquire(run_dir: str | os.PathLike[str], cluster: str) -> str:
    """Take `cluster`'s lock in run_dir for this process (again, if it holds it already); returns its key
    for `release`. Raises RunLocked when another process holds it."""
    path = lock_path(run_dir, cluster)
    key = _key(path)
    if key in _HELD:
        _HELD[key][1] += 1
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + RETRY_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            got = _try_flock(fd)
            if got is None:  # no locks here: the metadata is all there is
                info = _read(fd)
                if _alive_here(info) and info.get("pid") != os.getpid():
                    raise RunLocked(_message(run_dir, cluster, info))
                log.warning("run.dir %s has no file locks (flock failed): a second launch on it is refused only "
                            "from this host", run_dir)
            elif got is False:
                if time.monotonic() < deadline:
                    os.close(fd)
                    fd = -1
                    time.sleep(0.05)
                    continue
                raise RunLocked(_message(run_dir, cluster, _holder(fd)))
            elif not _same_file(fd, path):  # the file was deleted or replaced while we opened it: lock the new one
                os.close(fd)
                fd = -1
                continue
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cluster": cluster}
            data = (json.dumps(info) + "\n").encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        _HELD[key] = [fd, 1]
        return key


def release(key: str) -> None:
    """Drop one hold; the last one empties the file (no stale metadata) and closes it, which frees the lock."""
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[key]
    with contextlib.suppress(OSError):
        os.ftruncate(held[0], 0)
    os.close(held[0])


@contextlib.contextmanager
def hold(run_dir: str | os.PathLike[str], cluster: str) -> Iterator[None]:
    key = acquire(run_dir, cluster)
    try:
        yield
    finally:
        release(key)


def job_rank() -> int:
    """This process's rank in its cluster job (torchrun / the local launcher set RANK and WORLD_SIZE)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"] or 0)
    return 0


def job_lock(cfg: Any, specs: list[Any] | None = None) -> contextlib.AbstractContextManager[None]:
    """The lock of this cluster job's cluster, held by its rank 0 (other ranks: nothing to hold)."""
    if job_rank() != 0:
        return contextlib.nullcontext()
    from edit_train.config import cluster_specs
    from edit_train.train.build import my_cluster

    spec = my_cluster(cfg, specs if specs is not None else cluster_specs(cfg))
    return hold(cfg.run.dir, spec.name)
