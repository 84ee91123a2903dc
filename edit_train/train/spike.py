"""Loss-spike guard (the Ling report's remedy): skip the batch and re-queue its data later.

A step is *spiking* when its loss exceeds `factor` × the running mean of the accepted losses. A single
spiking step is tolerated; once `patience` consecutive steps spike, the guard skips that step's update
and re-queues its batch to be trained `requeue_after` steps later, until the loss comes back. If the loss
stays high for `2 × patience` more steps it is a new level, not a spike: the guard accepts it and resets
the running mean (so it can never stall training). The loss it sees must be agreed by every rank that
shares the update (the trainer passes the group / world mean), so every rank takes the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class SpikeGuard:
    factor: float = 0.0  # 0 = off
    patience: int = 3
    requeue_after: int = 50
    warmup: int = 20  # steps before the running mean is trusted
    decay: float = 0.98
    mean: float | None = None
    seen: int = 0
    run: int = 0  # consecutive spiking steps
    skipped_run: int = 0
    skipped: int = 0
    queue: list[tuple[int, list[Batch]]] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def pop_due(self, step: int) -> list[Batch] | None:
        """Batches re-queued earlier that are due at `step` (replayed instead of fresh data)."""
        for i, (due, batches) in enumerate(self.queue):
            if due <= step:
                del self.queue[i]
                return batches
        return None

    def check(self, loss: float, step: int, batches: list[Batch]) -> bool:
        """True when this step's update must be skipped (its batches are then re-queued)."""
        if not self.enabled:
            return False
        spiking = (self.mean is not None and self.seen >= self.warmup and loss > self.factor * self.mean)
        if spiking:
            self.run += 1
            if self.run >= self.patience and self.skipped_run < 2 * self.patience:
                self.skipped_run += 1
                self.skipped += 1
                self.queue.append((step + self.requeue_after, [(x.clone(), y.clone()) for x, y in batches]))
                return True
            if self.skipped_run >= 2 * self.patience:  # a new level: accept it
                self.mean, self.run, self.skipped_run = loss, 0, 0
            return False
        self.run, self.skipped_run = 0, 0
        self.mean = loss if self.mean is None else self.decay * self.mean + (1 - self.decay) * loss
        self.seen += 1
        return False

    # ---------------------------------------------------------------- checkpoint
    def state_json(self) -> dict[str, Any]:
        return {"mean": self.mean, "seen": self.seen, "run": self.run, "skipped_run": self.skipped_run,
                "skipped": self.skipped, "due": [[due, len(b)] for due, b in self.queue]}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, (_, batches) in enumerate(self.queue):
            for j, (x, y) in enumerate(batches):
                out[f"{i}/{j}/x"], out[f"{i}/{j}/y"] = x.contiguous(), y.contiguous()
        return out

    def load(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.mean, self.seen, self.run = state["mean"], state["seen"], state["run"]
        self.skipped_run, self.skipped = state["skipped_run"], state["skipped"]
        self.queue = [(due, [(tensors[f"{i}/{j}/x"], tensors[f"{i}/{j}/y"]) for j in range(n)])
                      for i, (due, n) in enumerate(state["due"])]
