"""When to sync: warm-up, fixed step interval (EDiT/DiLoCo) and A-EDiT's wall-clock planner.

Pure Python; the cross-cluster exchange of measured step times is done by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ScheduleConfig", "StepSchedule", "TimePlanner", "StepTimer", "lr_boundaries"]

_KINDS = ("step", "time")


@dataclass
class ScheduleConfig:
    """Sync schedule. ``kind="step"``: every ``interval`` local steps; ``"time"``: A-EDiT budget τ."""

    kind: str = "step"
    interval: int = 32
    warmup_steps: int = 0
    sync_time_s: float = 10.0
    min_steps: int = 1
    max_steps: int = 0
    # kind="step": the total steps after which each sync happens, when they are not every `interval` steps
    # (`lr_boundaries`: algo.interval_power); past the last one, every `interval` steps again
    boundaries: tuple[int, ...] = ()

    def steps_at(self, sync: int) -> int:
        """kind="step": the total steps a cluster holds once `sync` syncs of the local phase are done (0: the
        warm-up's end)."""
        if sync <= 0:
            return self.warmup_steps
        b = self.boundaries
        if sync <= len(b):
            return b[sync - 1]
        return (b[-1] if b else self.warmup_steps) + (sync - len(b)) * self.interval

    def interval_after(self, total_steps: int) -> int:
        """kind="step": local steps from `total_steps` to the next boundary (every `interval` steps when there
        are no boundaries, or past the last one)."""
        nxt = next((x for x in self.boundaries if x > total_steps), None)
        if nxt is not None:
            return nxt - total_steps
        if self.boundaries:
            return self.interval - (total_steps - self.boundaries[-1]) % self.interval
        return self.interval

    def saves_at(self, total_steps: int, every: int) -> bool:
        """kind="step": is `total_steps` where a checkpoint is taken every `every` steps? A multiple of `every`
        (a sync boundary: config.py checks) or, when the syncs follow the lr, the first boundary at or past each
        multiple — where every cluster holds the anchor."""
        if every <= 0:
            return False
        if not self.boundaries:
            return total_steps % every == 0
        b = (self.warmup_steps, *self.boundaries)
        if total_steps in b[1:]:
            prev = b[b.index(total_steps) - 1]
        elif total_steps > b[-1] and (total_steps - b[-1]) % self.interval == 0:
            prev = total_steps - self.interval
        else:
            return False
        return total_steps // every > prev // every

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field."""
        if self.kind not in _KINDS:
            raise ValueError(f"algo.schedule must be one of {_KINDS}, got {self.kind!r}")
        if self.interval < 1:
            raise ValueError(f"algo.interval must be >= 1 local step, got {self.interval}")
        if self.warmup_steps < 0:
            raise ValueError(f"algo.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not (self.sync_time_s > 0 and math.isfinite(self.sync_time_s)):
            raise ValueError(f"algo.sync_time_s must be finite seconds > 0, got {self.sync_time_s}")
        if self.min_steps < 1:
            raise ValueError(f"algo.min_steps must be >= 1, got {self.min_steps}")
        if self.max_steps < 0:
            raise ValueError(f"algo.max_steps must be >= 0 (0 = no cap), got {self.max_steps}")
        if self.max_steps and self.max_steps < self.min_steps:
            raise ValueError(
                f"algo.max_steps ({self.max_steps}) must be >= algo.min_steps ({self.min_steps}) or 0"
            )
        b = (self.warmup_steps, *self.boundaries)
        if any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"schedule boundaries must increase past warmup_steps ({self.warmup_steps}), got "
                             f"{list(self.boundaries)}")


def lr_boundaries(lrs: Sequence[float], start: int, interval: int, power: float) -> tuple[int, ...]:
    """Where the syncs of a step schedule go when they follow the learning rate (`algo.interval_power` p):
    the (len(lrs) − start) // interval syncs of the local phase (steps `start`..) at equal quantiles of the running
    sum of lr^p, so each interval holds the same Σ lr^p — an interval is ∝ 1/lr^p where the lr changes slowly.
    p = 0 gives start + k·interval (every `interval` steps). The last sync is where it is with p = 0, every
    interval is at least one step. `lrs[s]`: the lr of 0-based step s."""
    n = (len(lrs) - start) // interval
    end = start + n * interval
    weights = [max(float(x), 0.0) ** power for x in lrs[start:end]]
    total = sum(weights)
    if n <= 0 or total <= 0 or not math.isfinite(total):
        return tuple(start + k * interval for k in range(1, n + 1))
    out: list[int] = []
    acc, k = 0.0, 1
    for step, w in enumerate(weights, start=start + 1):
        acc += w
        while k <= n and acc >= total * k / n * (1 - 1e-12):
            prev = out[-1] if out else start
            out.append(min(max(step, prev + 1), end - (n - k)))
            k += 1
    out[-1] = end
    return tuple(out)


class StepSchedule:
    """Warm-up then a fixed number of local steps between syncs."""

    def __init__(self, cfg: ScheduleConfig) -> None:
        cfg.validate()
        self.cfg = cfg

    def is_warmup(self, step: int) -> bool:
        """True for the first ``warmup_steps`` (0-based global) steps, which are fully synchronous."""
        return step < self.cfg.warmup_steps


class TimePlanner:
    """A-EDiT: a cluster plans ``H = max(min_steps, ⌊τ / secs_per_step⌋)`` (capped by max_steps).

    A missing measurement (NaN, ≤ 0) falls back to ``interval``; an infinite one gives ``min_steps``.
    """

    def __init__(self, cfg: ScheduleConfig) -> None:
        cfg.validate()
        self.cfg = cfg

    def _clamp(self, h: int) -> int:
        h = max(self.cfg.min_steps, h)
        return min(h, self.cfg.max_steps) if self.cfg.max_steps > 0 else h

    def steps_for(self, secs_per_step: float) -> int:
        """Local steps that fit in τ at ``secs_per_step`` seconds per step."""
        s = float(secs_per_step)
        if math.isnan(s) or s <= 0:
            return self._clamp(self.cfg.interval)
        if math.isinf(s):
            return self._clamp(self.cfg.min_steps)
        # The epsilon keeps e.g. 0.7 / 0.1 = 6.9999… from flooring to 6.
        return self._clamp(int(math.floor(self.cfg.sync_time_s / s + 1e-9)))


class StepTimer:
    """Seconds per local step since the last sync: plain mean, or an EWMA when ``ewma`` is set."""

    def __init__(self, ewma: float | None = None) -> None:
        if ewma is not None and not 0.0 < ewma <= 1.0:
            raise ValueError(f"StepTimer ewma must be in (0, 1], got {ewma}")
        self.ewma = ewma
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.total = 0.0
        self._avg = math.nan

    def record(self, seconds: float) -> None:
        """Add one step's duration; non-finite values are ignored, negative ones rejected."""
        seconds = float(seconds)
        if not math.isfinite(seconds):
            return
        if seconds < 0:
            raise ValueError(f"StepTimer.record: negative duration {seconds}")
        self.count += 1
        self.total += seconds
        if self.ewma is None or self.count == 1:
            self._avg = self.total / self.count if self.ewma is None else seconds
        else:
            self._avg += self.ewma * (seconds - self._avg)

    def mean(self) -> float:
        """Mean seconds per step (NaN before any record, which :class:`TimePlanner` treats as unknown)."""
        return self._avg

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "total": self.total, "avg": None if math.isnan(self._avg) else self._avg}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.count = int(sd["count"])
        self.total = float(sd["total"])
        self._avg = math.nan if sd.get("avg") is None else float(sd["avg"])
