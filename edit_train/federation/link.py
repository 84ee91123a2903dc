"""The simulated cross-cluster link and the handle of a collective in flight.

The WAN model (`latency + bytes / bandwidth`, transfers queue for bandwidth) is applied where a real link
would be: an asynchronous reduction only costs wall time if somebody waits for it before the link would
have delivered it. A failed collective (a peer died, the link dropped) surfaces as `FederationError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


class FederationError(RuntimeError):
    """Cross-cluster communication failed (peer lost, timeout, unreachable Lighthouse)."""


class FederationRefused(FederationError):
    """The federation refuses this cluster for good (another configuration, a name already taken): trying
    again cannot help, so the run stops with this message instead of skipping the sync."""


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
        self.collectives = 0
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
        self.collectives += 1
        now = time.perf_counter()
        if not self.link.enabled:
            return now
        start = max(now, self._free_at)
        transfer = self.link.seconds(nbytes) - self.link.latency_ms / 1000.0
        self._free_at = start + transfer
        return start + transfer + self.link.latency_ms / 1000.0


class Pending:
    """A cross-cluster collective in flight. `wait()` returns the seconds this rank was blocked and
    raises `FederationError` when the collective failed. `settle(ok) -> ok` runs after the works on every
    rank of the cluster (it agrees inside the cluster and moves the result into place), so all ranks of a
    cluster fail or succeed together."""

    def __init__(self, clock: LinkClock, works: list[Any], ready_at: float,
                 settle: Callable[[bool], bool] | None = None, what: str = "collective") -> None:
        self._clock, self._works, self._ready_at, self._settle = clock, works, ready_at, settle
        self.what = what
        self.done = False

    def ready(self) -> bool:
        """Non-blocking: has the data landed (and would the simulated link have delivered it)?"""
        if self.done:
            return True
        try:
            finished = all(w.is_completed() for w in self._works)
        except Exception:  # noqa: BLE001 - a failed work is "ready": wait() raises its error
            return True
        return finished and time.perf_counter() >= self._ready_at

    def wait(self) -> float:
        if self.done:
            return 0.0
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
        ok = error is None
        if self._settle is not None:
            ok = self._settle(ok)
        self.done = True
        blocked = time.perf_counter() - t0
        self._clock.blocked_s += blocked
        if not ok:
            why = (str(error).strip().splitlines() or [repr(error)])[0] if error is not None else "a peer rank failed"
            raise FederationError(f"{self.what} failed: {why}")
        return blocked
