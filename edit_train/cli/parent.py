"""A worker process dies with the process that started it (Linux: the parent-death signal).

The local launcher's cluster processes and every torchrun worker set it, so `kill -9` of a launcher or of a
cluster's torchrun leaves no worker training (and syncing, and holding its cluster's run lock) on its own:
the kernel SIGKILLs it, which also releases its lock (`train/runlock.py`: flock), and a relaunch of the
cluster finds it free. Checkpoints and progress records are written atomically, so a kill leaves nothing
half-written. Elsewhere (macOS) nothing is set.

A parent that died before the signal was set (a torchrun SIGKILLed while its worker was still starting Python)
sends nothing: the worker was re-parented already. It is told by the parent's recorded pid — not by pid 1, which
is where orphans go only without a subreaper (a container's init, `systemd --user`, a test harness): the local
launcher sets the signal between fork and exec (`preexec_fn`), and launchers/torchrun_multinode.sh's wrapper puts
torchrun's own pid into its workers' environment (`PARENT_ENV`).
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PARENT_ENV = "EDIT_TRAIN_TORCHRUN_PID"  # torchrun's pid, for its workers (cli/torchrun_wrap.py)


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; True when it is set. `parent`: the pid
    this process's parent must have (default: whoever is its parent now). A parent already gone (this process was
    re-parented) ends this one at once."""
    parent = os.getppid() if parent is None else parent
    try:
        if ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent was already gone: nothing will signal us
        os.kill(os.getpid(), sig)
    return True


def die_with_torchrun(sig: int = signal.SIGKILL) -> bool:
    """For a torchrun worker: `die_with_parent`, checked against torchrun's recorded pid where its launcher gave it."""
    recorded = os.environ.get(PARENT_ENV, "")
    return die_with_parent(sig, int(recorded) if recorded.isdigit() else None)


def record_parent_and_die_with_it() -> None:
    """`preexec_fn` for the torchrun a wrapper starts: it dies with the wrapper, and its workers (which inherit
    this environment) learn its pid."""
    os.environ[PARENT_ENV] = str(os.getpid())
    die_with_parent()
