"""The simulated cross-cluster link and the handle of a collective in flight.

The WAN model (`latency + bytes / bandwidth`, transfers queue for bandwidth) is applied where a real link
would be: an asynchronous reduction only costs wall time if somebody waits for it before the link would
have delivered it. A failed collective (a peer died, the link dropped) surfaces as `FederationError`
(`edit_train.local_sgd.errors`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from edit_train.local_sgd.errors import FederationError

T = TypeVar("T")


@dataclass
class LinkModel:
    """Simulated cross-cluster link: each transfer takes latency + bytes / bandwidth."""

    bandwidth_mbps: float = 0.0  # megabits per second; 0 = infinite
    latency_ms: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.bandwidth_mbps > 0 or self.latency_ms > 0

    def seconds(self, nbytes: int) -> float:
        secs = self.latency_ms / 1000.0
        if self.bandwidth_mbps > 0:
            secs += nbytes * 8 / (self.bandwidth_mbps * 1e6)
        return secs


class LinkClock:
    """Bytes, collectives and blocked seconds of one rank's cross-cluster traffic, and the link's queue."""

    def __init__(self, link: LinkModel | None = None) -> None:
        self.link = link or LinkModel()
        self.bytes_sent = 0
        self.blocked_s = 0.0
        self._free_at = 0.0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the time inside as blocked (waiting for other clusters)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_s += time.perf_counter() - t0

    def account(self, nbytes: int) -> float:
        """Count the bytes; return when the simulated link delivers them (transfers queue for bandwidth)."""
        self.bytes_sent += nbytes
        now = time.perf_counter()
        if not self.link.enabled:
            return now
        start = max(now, self._free_at)
        transfer = self.link.seconds(nbytes) - self.link.latency_ms / 1000.0
        self._free_at = start + transfer
        return start + transfer + self.link.latency_ms / 1000.0


class Pending(Generic[T]):
    """A cross-cluster collective in flight (the core's `Handle`). `wait()` returns its result and raises
    `FederationError` when it failed; the seconds it blocked are added to the clock and left in
    `blocked_s`. `settle(ok) -> ok` runs after the works on every rank of the cluster (it agrees inside the
    cluster and moves the result into place), so all ranks of a cluster fail or succeed together; it may
    return a string instead of False: the reason of the failure."""

    def __init__(self, clock: LinkClock, works: list[Any], ready_at: float,
                 settle: Callable[[bool], bool | str] | None = None, what: str = "collective",
                 result: Callable[[], T] | None = None) -> None:
        self._clock, self._works, self._ready_at, self._settle = clock, works, ready_at, settle
        self._result = result
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
            raise FederationError(f"{self.what} failed: {why}")
