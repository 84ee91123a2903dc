"""The simulated cross-cluster link: the WAN model (`latency + bytes / bandwidth`, transfers queue for
bandwidth) and the clock it runs on. It is applied where a real link would be: an asynchronous reduction only
costs wall time if somebody waits for it before the link would have delivered it (`pending.Pending`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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
