"""A worker process dies with the process that started it (Linux: the parent-death signal).

The local launcher's cluster processes and every torchrun worker set it, so `kill -9` of a launcher or of a
cluster's torchrun leaves no worker training (and syncing, and holding its cluster's run lock) on its own:
the kernel SIGKILLs it, which also releases its lock (`train/runlock.py`: flock), and a relaunch of the
cluster finds it free. Checkpoints and progress records are written atomically, so a kill leaves nothing
half-written. Elsewhere (macOS) nothing is set.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; True when it is set. A parent that
    died before the call (this process was re-parented already) ends this one at once."""
    parent = os.getppid()
    try:
        if ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent != os.getppid() or os.getppid() == 1:  # the parent was already gone: nothing will signal us
        os.kill(os.getpid(), sig)
    return True
