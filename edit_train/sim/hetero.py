"""Heterogeneous clusters on one host: a per-group slowdown factor.

A group with slowdown s takes s times as long per step: after each step it sleeps (s − 1) × the
measured compute time, which costs no CPU (so the other groups' speed is unaffected). A
`slowdown_schedule` changes a cluster's factor mid-run: `[{cluster: 1, step: 200, factor: 5.0}, …]`
(the factor applies from that local step of that cluster on). The sleep is the loop's `after_step` hook
(sim/hooks.py), which the trainer charges to the `slowdown` time bucket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from edit_train.retired import entry_field
from edit_train.sim.hooks import StepHooks


class HeteroError(ValueError):
    pass


@dataclass(frozen=True)
class SlowdownChange:
    group: int
    step: int
    factor: float


def parse_schedule(specs: list[dict[str, Any]] | None, groups: int) -> list[SlowdownChange]:
    out = []
    for i, spec in enumerate(specs or []):
        spec = entry_field(dict(spec), "cluster.slowdown_schedule")
        unknown = set(spec) - {"cluster", "step", "factor"}
        if unknown or not {"cluster", "step", "factor"} <= set(spec):
            raise HeteroError(f"cluster.slowdown_schedule[{i}]: needs exactly cluster, step, factor; got {sorted(spec)}")
        change = SlowdownChange(int(spec["cluster"]), int(spec["step"]), float(spec["factor"]))
        if not 0 <= change.group < groups:
            raise HeteroError(f"cluster.slowdown_schedule[{i}].cluster: {change.group} is not in [0, {groups})")
        if change.factor < 1.0:
            raise HeteroError(f"cluster.slowdown_schedule[{i}].factor: must be >= 1.0, got {change.factor}")
        out.append(change)
    return sorted(out, key=lambda c: c.step)


class Slowdown(StepHooks):
    """Sleeps to make this group `factor` times slower than the hardware it runs on (the loop's `after_step`)."""

    def __init__(self, group: int, factors: list[float] | None, schedule: list[dict[str, Any]] | None = None,
                 groups: int = 1) -> None:
        self.group = group
        # a cluster added mid-run (its index after the configured clusters') has no simulated slowdown
        self.base = float(factors[group]) if factors and 0 <= group < len(factors) else 1.0
        self.changes = [c for c in parse_schedule(schedule, groups) if c.group == group]
        self.slept_s = 0.0

    @property
    def active(self) -> bool:
        """Whether this group is ever slowed down (else `after_step` never sleeps)."""
        return self.base != 1.0 or any(c.factor != 1.0 for c in self.changes)

    def factor(self, step: int) -> float:
        f = self.base
        for c in self.changes:
            if step >= c.step:
                f = c.factor
        return f

    def after_step(self, step: int, compute_s: float) -> float:
        """Sleep the extra fraction for `step`; returns the seconds slept."""
        extra = (self.factor(step) - 1.0) * compute_s
        if extra > 0:
            time.sleep(extra)
            self.slept_s += extra
        return max(extra, 0.0)
