"""The handle of a cross-cluster collective in flight (the core's `Handle`). A failed collective (a cluster
died, the link dropped) surfaces as `FederationError` (`edit_train.local_sgd.errors`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from edit_train.federation.link import LinkClock
from edit_train.local_sgd.errors import FederationError

T = TypeVar("T")


class Pending(Generic[T]):
    """A cross-cluster collective in flight (the core's `Handle`). `wait()` returns its result and raises
    `FederationError` when it failed; the seconds it blocked are added to the clock and left in
    `blocked_s`. `settle(ok) -> ok` runs after the works on every rank of the cluster (it agrees inside the
    cluster and moves the result into place), so all ranks of a cluster fail or succeed together; it may
    return a string instead of False: the reason of the failure."""

    def __init__(self, clock: LinkClock, works: list[Any], ready_at: float,
                 settle: Callable[[bool], bool | str] | None = None, what: str = "collective",
                 result: Callable[[], T] | None = None, blame: Callable[[BaseException], str] | None = None) -> None:
        self._clock, self._works, self._ready_at, self._settle = clock, works, ready_at, settle
        self._result = result
        self._blame = blame  # a failed work's error -> who made it fail ("": nobody known), added to the reason
        self.what = what
        self.done = False
        self.blocked_s = 0.0

    def ready(self) -> bool:
        """Non-blocking: has the data landed (and would the simulated link have delivered it)?"""
        if self.done:
            return True
        try:
            finished = all(w.is_completed() for w in self._works)
        except Exception:  # noqa: BLE001 - a failed work is "ready": wait() raises its error
            return True
        return finished and time.perf_counter() >= self._ready_at

    def wait(self) -> T:
        if not self.done:
            self._finish()
        return self._result() if self._result is not None else None  # type: ignore[return-value]

    def _finish(self) -> None:
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            for w in self._works:
                w.wait()
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError subclasses
            error = exc
        if error is None:
            remaining = self._ready_at - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        ok: bool | str = error is None
        if self._settle is not None:
            ok = self._settle(bool(ok))  # a str: failed, for that reason
        self.done = True
        self.blocked_s = time.perf_counter() - t0
        self._clock.blocked_s += self.blocked_s
        if ok is not True:
            why = (str(error).strip().splitlines() or [repr(error)])[0] if error is not None else \
                (ok if isinstance(ok, str) and ok else "a peer rank failed")
            who = self._blame(error) if error is not None and self._blame is not None else ""
            raise FederationError(f"{self.what} failed: {why}" + (f"; {who}" if who else ""))
