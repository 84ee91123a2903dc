"""Every wait says what it waits for, and yields to Ctrl-C / SIGTERM.

A cluster waits for the federation at start-up (`Membership.meet`), for the Lighthouse's answer and for its
peers' lanes at every sync (`federation/forming.py`). Each such wait runs in slices of `SLICE_S`:

* every `every_s()` seconds (`EDIT_TRAIN_WAIT_EVERY_S`, default 10) it says what it waits for, how long of how
  long, and what the run directory tells of the peers (`NEWS`, set by the trainer: who last trained when, whose
  record says it finished);
* it ends in one plain sentence: what came after how long, or what never came (the caller's error);
* a stop asked by a signal (`STOP`, set by the trainer's SIGINT/SIGTERM handler, train/signals.py) ends it within
  a slice: `WaitInterrupted`, a `FederationError`, so the caller gives the sync up as it would a missed one and
  the loop stops at its next step boundary (a checkpoint in progress completes).

Torch-free on purpose: the core imports it, and so may anything that waits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from edit_train.local_sgd.errors import FederationError

log = logging.getLogger(__name__)

SLICE_S = 0.5  # a stop is noticed within this long
EVERY_S = 10.0
STOP = threading.Event()  # set by the trainer's SIGINT/SIGTERM handler: every wait gives up within a slice
NEWS: list[Callable[[], str]] = []  # what the run directory says of the peers (the trainer registers it)


class WaitInterrupted(FederationError):
    """A signal asked this process to stop while it waited for the federation (one line)."""


def every_s() -> float:
    """Seconds between a wait's progress lines (`EDIT_TRAIN_WAIT_EVERY_S`, default 10)."""
    try:
        return max(float(os.environ.get("EDIT_TRAIN_WAIT_EVERY_S", EVERY_S)), 0.1)
    except ValueError:
        return EVERY_S


def news() -> str:
    """The peers as the run directory shows them ("" when nothing is known)."""
    parts = []
    for fn in NEWS:
        try:
            text = fn()
        except Exception:  # noqa: BLE001 - news is a courtesy; a wait never fails for it
            text = ""
        if text:
            parts.append(text)
    return "; ".join(parts)


class Wait:
    """One wait: `what` it waits for, its limit (0: unbounded), progress lines every `every_s()` seconds."""

    def __init__(self, what: str, limit_s: float, detail: Callable[[], str] | None = None,
                 clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] | None = None,
                 started: float | None = None) -> None:
        self.what, self.limit_s, self.detail, self.clock = what, limit_s, detail, clock
        self.say = say or (lambda line: log.info("%s", line))
        self.started = clock() if started is None else started
        self.every = every_s()
        self._next = self.started + self.every
        self.reported = False  # a progress line was printed: the end gets its own sentence

    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        return self.limit_s - self.elapsed() if self.limit_s > 0 else SLICE_S

    def tick(self) -> None:
        """A progress line, when one is due."""
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.every
        of = f" of {self.limit_s:.0f} s" if self.limit_s > 0 else ""
        extra = [x for x in ((self.detail() if self.detail else ""), news()) if x]
        self.say(f"waiting for {self.what}: {self.elapsed():.0f} s{of}" + (f"; {'; '.join(extra)}" if extra else ""))
        self.reported = True

    def check_stop(self) -> None:
        if STOP.is_set():
            raise WaitInterrupted(f"stopped waiting for {self.what} after {self.elapsed():.0f} s: a signal asked "
                                  "this cluster to stop")

    def until(self, ready: Callable[[float], bool]) -> bool:
        """Call `ready(slice_s)` (it may block that long) until it says True (True), the limit passes (False) or
        a stop is asked (WaitInterrupted)."""
        while True:
            if ready(max(min(SLICE_S, self.left()), 0.0)):
                return True
            self.check_stop()
            if self.limit_s > 0 and self.left() <= 0:
                return False
            self.tick()

    def done(self, outcome: str) -> None:
        """The closing sentence, when a progress line was printed (a wait nobody noticed stays silent)."""
        if self.reported:
            self.say(f"{self.what}: {outcome} after {self.elapsed():.0f} s")
