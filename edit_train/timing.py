"""Where a cluster's wall time goes: named buckets that add up to the wall clock, always on.

`TimeAccount.span(name)` charges the time spent inside to `name`; spans nest *exclusively* (a sync hook
that runs inside the forward pass is charged to `sync`, not also to `compute`), and the seconds a span
spent blocked on other clusters (the federation clock's `blocked_s`, read before and after) go to
`blocked` instead. `other` is what no span covered, so the buckets always sum to the wall time since the
account started. A span costs two `perf_counter()` calls and a counter read: cheap enough to stay on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

BUCKETS: tuple[str, ...] = ("compute", "slowdown", "eval", "sync", "probe", "blocked", "checkpoint", "data",
                            "startup", "other")
_SPANNED = frozenset(BUCKETS) - {"blocked", "other"}


class TimeAccount:
    """Exclusive wall-time buckets of one process (one rank of one cluster)."""

    def __init__(self, blocked: Callable[[], float] | None = None, start: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._blocked = blocked or (lambda: 0.0)
        self._t0 = clock() if start is None else start
        self._blocked0 = self._blocked()
        self._absorbed = 0.0  # blocked seconds charged to a span that keeps them (start-up waits for peers)
        self.totals: dict[str, float] = dict.fromkeys(_SPANNED, 0.0)
        self.carried: dict[str, float] = dict.fromkeys(BUCKETS, 0.0)  # earlier incarnations (resume)
        self._stack: list[list] = []  # [name, resumed_at, blocked_at_resume, keeps_blocked]

    def attach_blocked(self, blocked: Callable[[], float]) -> None:
        """Read blocked seconds from `blocked` from now on (the federation comm exists after the account)."""
        before = self._blocked() - self._blocked0
        self._blocked = blocked
        self._blocked0 = blocked() - before

    @staticmethod
    def _running(frame: list, now: float, blocked_now: float) -> tuple[float, float]:
        """(seconds to charge to the frame's bucket, blocked seconds it absorbs) since it last resumed."""
        _, resumed, blocked_at, keeps = frame
        waited = blocked_now - blocked_at
        if keeps:
            return max(now - resumed, 0.0), waited
        return max(now - resumed - waited, 0.0), 0.0

    def _charge(self, frame: list, now: float, blocked_now: float) -> None:
        seconds, absorbed = self._running(frame, now, blocked_now)
        self.totals[frame[0]] += seconds
        self._absorbed += absorbed

    @contextmanager
    def span(self, name: str, keeps_blocked: bool = False) -> Iterator[None]:
        """Charge the time inside to `name` (exclusive of nested spans; blocked time goes to `blocked`
        unless `keeps_blocked`)."""
        if name not in _SPANNED:
            raise ValueError(f"unknown time bucket {name!r}; one of {sorted(_SPANNED)}")
        now, blocked = self._clock(), self._blocked()
        if self._stack:
            self._charge(self._stack[-1], now, blocked)
        self._stack.append([name, now, blocked, keeps_blocked])
        try:
            yield
        finally:
            now, blocked = self._clock(), self._blocked()
            self._charge(self._stack.pop(), now, blocked)
            if self._stack:
                self._stack[-1][1], self._stack[-1][2] = now, blocked

    def snapshot(self) -> dict[str, float]:
        """Seconds per bucket (open spans charged up to now), `other` = wall − the rest, and `wall_s`."""
        now, blocked = self._clock(), self._blocked()
        totals, absorbed = dict(self.totals), self._absorbed
        if self._stack:  # the innermost open span, charged up to now without disturbing it
            seconds, waited = self._running(self._stack[-1], now, blocked)
            totals[self._stack[-1][0]] += seconds
            absorbed += waited
        wall = now - self._t0
        out = {b: totals[b] for b in BUCKETS if b in totals}
        out["blocked"] = max(blocked - self._blocked0 - absorbed, 0.0)
        out["other"] = wall - sum(out.values())
        ordered = {b: out[b] + self.carried[b] for b in BUCKETS}
        ordered["wall_s"] = wall + sum(self.carried.values())
        return ordered

    def claim(self, name: str) -> None:
        """Charge everything no span has covered so far to `name` (start-up: the time before the loop)."""
        if name not in _SPANNED or self._stack:
            raise ValueError(f"claim({name!r}) needs a known bucket and no open span")
        self.totals[name] += max(self.snapshot()["other"] - self.carried["other"], 0.0)

    def carry(self, earlier: dict[str, float]) -> None:
        """Add an earlier incarnation's buckets (restored from a checkpoint) to every snapshot."""
        for b in BUCKETS:
            self.carried[b] = float(earlier.get(b, 0.0))


def window(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Per-bucket seconds between two snapshots (the `time_s` of a `train` event)."""
    return {k: round(now[k] - before.get(k, 0.0), 4) for k in now}
