"""Learning-rate schedule: linear warm-up then cosine decay to `min_lr_ratio * lr`."""

from __future__ import annotations

import math


def lr_at(step: int, base_lr: float, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR for 0-based `step` (the step about to be taken)."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
