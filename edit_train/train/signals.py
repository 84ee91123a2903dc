"""Ctrl-C / SIGTERM: the loop stops at the next step boundary, so a checkpoint being written is finished
(atomically renamed) and nothing is left half-written; a second signal gives up at once."""

from __future__ import annotations

import signal
import threading
from typing import Any

from edit_train.local_sgd import waits


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived: the run stopped at a step boundary (a checkpoint in progress completed)."""


class StopSignal:
    """The first SIGINT/SIGTERM only sets `signum` (and `waits.STOP`: a cluster waiting for the federation gives
    up its wait); the loop checks it at every step boundary."""

    def __init__(self) -> None:
        self.signum: int | None = None
        waits.STOP.clear()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handle)
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:  # second signal: give up at once
            raise KeyboardInterrupt
        self.signum = signum
        waits.STOP.set()  # a wait for the federation gives up within half a second (local_sgd/waits.py)
