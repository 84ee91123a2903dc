"""Learning-rate schedule: linear warm-up then cosine decay to `min_lr_ratio * lr`.

A resume that changes the schedule (`train.steps`, `train.lr`, `train.lr_warmup_steps`, `train.min_lr_ratio`)
does not re-plan it from step 0, which would jump the learning rate (400 -> 800 steps: 3.0e-4 -> 1.3e-3 at
step 400). It continues from the learning rate the old schedule gave at the resume step: still warming up,
a straight line from there to `lr` at the end of the warm-up, then the planned cosine; past the warm-up, a
cosine from there to `min_lr_ratio * lr` at the new `train.steps`. `LrSchedule` holds that plan and goes into
the checkpoint, so a later resume continues the continued schedule.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any


def lr_at(step: int, base_lr: float, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR for 0-based `step` (the step about to be taken)."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


# the config keys of a schedule, by field
KEYS = {"lr": "train.lr", "steps": "train.steps", "warmup_steps": "train.lr_warmup_steps",
        "min_lr_ratio": "train.min_lr_ratio"}


@dataclass(frozen=True)
class LrSchedule:
    """`lr_at` with the config's values, or (after a resume that changed them) its continuation from
    `from_lr` at step `from_step`."""

    lr: float
    steps: int
    warmup_steps: int
    min_lr_ratio: float
    from_step: int | None = None
    from_lr: float | None = None

    @staticmethod
    def of(train: Any) -> LrSchedule:
        """The schedule `train` (TrainConfig, or its dict) plans from step 0."""
        get = train.get if isinstance(train, dict) else lambda k: getattr(train, k)
        return LrSchedule(float(get("lr")), int(get("steps")), int(get("lr_warmup_steps")),
                          float(get("min_lr_ratio")))

    @property
    def min_lr(self) -> float:
        return self.lr * self.min_lr_ratio

    def at(self, step: int) -> float:
        """LR for 0-based `step` (the step about to be taken)."""
        if self.from_step is None or self.from_lr is None:
            return lr_at(step, self.lr, self.steps, self.warmup_steps, self.min_lr_ratio)
        s0, lr0 = self.from_step, self.from_lr
        if step <= s0:
            return lr0
        if s0 < self.warmup_steps:  # resumed inside the warm-up: a line to `lr`, then the planned cosine
            if step < self.warmup_steps:
                return lr0 + (self.lr - lr0) * (step - s0) / (self.warmup_steps - s0)
            return lr_at(step, self.lr, self.steps, self.warmup_steps, self.min_lr_ratio)
        progress = min(1.0, (step - s0) / max(1, self.steps - s0))
        return self.min_lr + (lr0 - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def same_plan(self, other: LrSchedule) -> bool:
        """The same config values (whatever continuation either holds)."""
        return all(getattr(self, k) == getattr(other, k) for k in KEYS)

    def continued(self, new: LrSchedule, step: int) -> LrSchedule:
        """`new`'s config values, continuing this schedule's learning rate at `step` (the resume step). When
        `new` itself gives that learning rate there (e.g. only train.steps changed, still in the warm-up),
        `new` as planned from step 0."""
        lr0 = self.at(step)
        plain = replace(new, from_step=None, from_lr=None)
        if math.isclose(plain.at(step), lr0, rel_tol=1e-12, abs_tol=0.0):
            return plain
        return replace(plain, from_step=step, from_lr=lr0)

    def change_line(self, new: LrSchedule, step: int) -> str:
        """One line for the log: what changed and what the learning rate does from `step` on."""
        changed = ", ".join(f"{key} {getattr(self, k):g} -> {getattr(new, k):g}"
                            for k, key in KEYS.items() if getattr(self, k) != getattr(new, k))
        lr0 = new.at(step)
        if step >= new.steps:
            rest = f"step {step:,} is already at or past the new end"
        elif step < new.warmup_steps and new.warmup_steps >= new.steps:
            rest = (f"keeps warming up towards {new.lr:.2e} (reached at step {new.warmup_steps:,}, after the run "
                    f"ends at step {new.steps:,})")
        elif step < new.warmup_steps:
            rest = (f"warms up to {new.lr:.2e} by step {new.warmup_steps:,}, then decays to {new.min_lr:.2e} "
                    f"at step {new.steps:,}")
        elif math.isclose(lr0, new.min_lr, rel_tol=1e-9):
            rest = f"stays at the minimum (train.lr x train.min_lr_ratio) for the remaining {new.steps - step:,} steps"
        else:
            rest = (f"{'decays' if lr0 > new.min_lr else 'rises'} to {new.min_lr:.2e} (cosine) over the remaining "
                    f"{new.steps - step:,} steps")
        return (f"resume: {changed}: the learning rate continues from {lr0:.2e} at step {step:,} "
                f"(no jump) and {rest}")

    def json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: Any) -> LrSchedule | None:
        """The schedule a checkpoint holds, or None when it holds none (older checkpoints) or a malformed one."""
        if not isinstance(data, dict):
            return None
        try:
            out = LrSchedule(float(data["lr"]), int(data["steps"]), int(data["warmup_steps"]),
                             float(data["min_lr_ratio"]),
                             None if data.get("from_step") is None else int(data["from_step"]),
                             None if data.get("from_lr") is None else float(data["from_lr"]))
        except (KeyError, TypeError, ValueError):
            return None
        if (out.from_step is None) != (out.from_lr is None) or not all(
                math.isfinite(v) for v in (out.lr, out.min_lr_ratio, out.from_lr or 0.0)):
            return None
        return out
