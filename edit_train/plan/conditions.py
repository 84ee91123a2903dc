"""The host's conditions when a profile was calibrated, and whether a plan made now can still trust it.

A calibrated step time and sync cost hold for the load they were measured under: the same federation run
while other jobs share the cores is slower by however much of the CPU they take (on this 2-core host, the
validation gave a 97 % median error then). So a profile records, when it is taken,

* `load_1m` / `load_5m`: the host's load averages (`os.getloadavg`), `cpu_count` and `cores` (this
  process's CPU affinity);
* `speed`: a fixed micro-benchmark's rate — `PROBE_ROUNDS` single-threaded 64×64 float32 matrix products in
  numpy (below BLAS's threading threshold, so one core's speed, contention included), the median of
  `PROBE_REPS` timings, in products per second;

and `stale(then, now)` says in one line whether a plan made now may use it. The tolerances are not fitted
to anything: a speed within ±`SPEED_TOLERANCE` is the spread of the probe itself on an idle host, and a
load that moved by `LOAD_TOLERANCE` per core is half a core's worth of work per core — enough to stretch a
federation that used every core by that much.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

PROBE_ROUNDS = 400  # 64x64 products per timing (~10-20 ms on one core)
PROBE_REPS = 9
SPEED_TOLERANCE = 0.2  # relative change of the probe's speed that makes a calibration stale
LOAD_TOLERANCE = 0.5  # change of the 1-minute load average per core that makes it stale


@dataclass(frozen=True)
class Conditions:
    load_1m: float
    load_5m: float
    cpu_count: int
    cores: int
    speed: float  # probe products per second
    taken_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: Any) -> Conditions | None:
        if not isinstance(data, dict):
            return None
        try:
            return Conditions(float(data["load_1m"]), float(data["load_5m"]), int(data["cpu_count"]),
                              int(data["cores"]), float(data["speed"]), str(data.get("taken_at", "")))
        except (KeyError, TypeError, ValueError):
            return None

    def describe(self) -> str:
        return f"load {self.load_1m:.1f} on {self.cores} core{'s' if self.cores != 1 else ''}"


def probe_speed(rounds: int = PROBE_ROUNDS, reps: int = PROBE_REPS) -> float:
    """Products of two 64×64 float32 matrices per second on one core (the median of `reps` timings)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        c = a
        for _ in range(rounds):
            c = a @ b
        times.append(time.perf_counter() - t0)
        a = a + 0 * c[:1, :1]  # keep the products alive
    return rounds / float(np.median(times))


def measure() -> Conditions:
    """This host now: load averages, cores and the probe's speed (about 0.2 s)."""
    one, five, _ = os.getloadavg()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Conditions(float(one), float(five), os.cpu_count() or cores, cores, probe_speed(),
                      time.strftime("%Y-%m-%dT%H:%M:%S"))


def stale(then: Conditions | None, now: Conditions) -> str | None:
    """One line saying why predictions from a profile taken under `then` no longer apply now, or None."""
    if then is None:
        return None
    why = []
    if then.cores != now.cores:
        why.append(f"{now.cores} cores now, {then.cores} then")
    ratio = now.speed / then.speed if then.speed > 0 else math.nan
    if not math.isfinite(ratio) or abs(ratio - 1.0) > SPEED_TOLERANCE:
        why.append(f"the host computes at {ratio:.2f}x the calibration's speed")
    per_core = (now.load_1m / max(now.cores, 1)) - (then.load_1m / max(then.cores, 1))
    if abs(per_core) > LOAD_TOLERANCE:
        why.append(f"load {now.load_1m:.1f} now, {then.load_1m:.1f} then")
    if not why:
        return None
    return (f"calibration stale: taken at {then.describe()} ({then.taken_at or 'unknown time'}); "
            f"{', '.join(why)} — its predictions no longer apply; recalibrate under the load you will run at "
            "(`edit-train plan calibrate`)")


def holds(then: Conditions, now: Conditions) -> str:
    """The one line when they still apply."""
    return (f"calibration conditions hold: {now.describe()} now ({then.describe()} then), speed "
            f"{now.speed / then.speed:.2f}x the calibration's")
