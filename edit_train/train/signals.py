"""Ctrl-C / SIGTERM: the loop stops at the next step boundary, so a checkpoint being written is finished
(atomically renamed) and nothing is left half-written (under `checkpoint.at_end`, a checkpoint of that step is
written); a second signal gives up at once, unless it comes within `SAME_STOP_S` of the first (the same stop,
passed on by a launcher). Once the work is done (`StopSignal.finished`: trained, interrupted or failed, the
files written), a signal during the shutdown that follows (closing the federation's connections, the process
group, interpreter exit) ends the process with one line instead of raising KeyboardInterrupt into whatever is
shutting down (an atexit callback's traceback)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from edit_train.local_sgd.sync import waits


# a second signal this soon after the first is the same stop (a terminal's Ctrl-C reaches the local launcher and
# its workers both; the launcher, or torchrun, passes it on with a SIGTERM within a fraction of a second)
SAME_STOP_S = 2.0


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived: the run stopped at a step boundary (a checkpoint in progress completed)."""


class StopSignal:
    """The first SIGINT/SIGTERM only sets `signum` (and `waits.STOP`: a cluster waiting for the federation gives
    up its wait); the loop checks it at every step boundary."""

    def __init__(self, who: str = "") -> None:
        self.signum: int | None = None
        self.at = 0.0  # when the first signal came
        self.who = who  # `cluster a`, for the line a signal after the work says
        waits.STOP.clear()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handle)
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if self.signum is not None:
            if now - self.at < SAME_STOP_S:  # the same stop said twice: Ctrl-C reaches a launcher and its
                return                       # workers, and the launcher passes it on (SIGTERM) at once
            raise KeyboardInterrupt  # a second stop: give up at once
        self.signum, self.at = signum, now
        waits.STOP.set()  # a wait for the federation gives up within half a second (local_sgd/sync/waits.py)

    def finished(self) -> None:
        """The work is over and its files are written: from here a SIGINT/SIGTERM exits at once (128 + signal)
        with one line, whatever is shutting down."""
        # not waits.STOP: it is the process's, and a process that trains again (a test, a notebook) would find
        # every wait for the federation given up at once
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._after_the_work)
            signal.signal(signal.SIGTERM, self._after_the_work)

    def _after_the_work(self, signum: int, _frame: Any) -> None:
        who = f"{self.who}: " if self.who else ""
        os.write(2, f"edit-train: {who}{signal.Signals(signum).name} while shutting down after "
                                      "its work: exiting now (what it wrote is complete)\n".encode())
        os._exit(128 + signum)
