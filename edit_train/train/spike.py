"""Loss-spike guard (the Ling report's remedy): skip the batch and re-queue its data later.

A step is *spiking* when its loss exceeds `factor` × the running mean of the accepted losses. A single
spiking step is tolerated; once `patience` consecutive steps spike, the guard skips that step's update
and re-queues its batch to be trained `requeue_after` steps later, until the loss comes back. If the loss
stays high for `2 × patience` more steps it is a new level, not a spike: the guard accepts it and resets
the running mean (so it can never stall training). The loss it sees must be agreed by every rank that
shares the update (the trainer passes the group / world mean), so every rank takes the same decision.

The decision is taken on the loss's device (`decide`: a few element-wise ops on a 6-number state tensor, no
host read), so a training step that does not log never waits for the GPU; the trainer reads the decisions
back at its next log step, checkpoint or the end (`requeue`) and re-queues the skipped steps' batches then.
`check` is the same decision on a host float (the state is one tensor either way).
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
    _state: torch.Tensor | None = None  # [mean, has_mean, seen, run, skipped_run, skipped] on the loss's device

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

    def decide(self, loss: torch.Tensor) -> torch.Tensor:
        """Whether this step's update must be skipped: a 0-d bool tensor on ``loss``'s device, computed there
        (no host read). The caller re-queues the step's batches once it has read it (`requeue`)."""
        if self._state is None or self._state.device != loss.device:
            host = torch.tensor([self.mean or 0.0, float(self.mean is not None), self.seen, self.run,
                                 self.skipped_run, self.skipped], dtype=torch.float64)
            self._state = host.to(loss.device, non_blocking=True)  # no wait for the device
        mean, has_mean, seen, run, skipped_run, skipped = self._state.unbind()
        loss = loss.detach().to(torch.float64).reshape(())
        spiking = (has_mean > 0) & (seen >= self.warmup) & (loss > self.factor * mean)
        run = torch.where(spiking, run + 1, 0.0)
        skip = spiking & (run >= self.patience) & (skipped_run < 2 * self.patience)
        new_level = spiking & ~skip & (skipped_run >= 2 * self.patience)  # a new level: accept it
        skipped_run = torch.where(skip, skipped_run + 1, torch.where(spiking & ~new_level, skipped_run, 0.0))
        run = torch.where(new_level, 0.0, run)
        ewma = torch.where(has_mean > 0, self.decay * mean + (1 - self.decay) * loss, loss)
        mean = torch.where(new_level, loss, torch.where(spiking, mean, ewma))
        has_mean = torch.where(spiking & ~new_level, has_mean, 1.0)
        self._state = torch.stack([mean, has_mean, seen + (~spiking).double(), run, skipped_run,
                                   skipped + skip.double()])
        return skip

    def requeue(self, step: int, batches: list[Batch]) -> None:
        """A skipped step's batches, trained again `requeue_after` steps after `step`."""
        self.queue.append((step + self.requeue_after, [(x.clone(), y.clone()) for x, y in batches]))

    def read(self) -> None:
        """The device state into the host fields (`mean`, `seen`, …): one host read, at a log step or save."""
        if self._state is None:
            return
        mean, has_mean, seen, run, skipped_run, skipped = self._state.tolist()
        self.mean = mean if has_mean else None
        self.seen, self.run, self.skipped_run, self.skipped = int(seen), int(run), int(skipped_run), int(skipped)

    def check(self, loss: float, step: int, batches: list[Batch]) -> bool:
        """True when this step's update must be skipped (its batches are then re-queued): `decide` on a host
        float, read at once."""
        if not self.enabled:
            return False
        skip = bool(self.decide(torch.tensor(loss, dtype=torch.float64)))
        self.read()
        if skip:
            self.requeue(step, batches)
        return skip

    # ---------------------------------------------------------------- checkpoint
    def state_json(self) -> dict[str, Any]:
        self.read()
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
        self._state = None  # rebuilt from the host fields by the next `decide`
        self.queue = [(due, [(tensors[f"{i}/{j}/x"], tensors[f"{i}/{j}/y"]) for j in range(n)])
                      for i, (due, n) in enumerate(state["due"])]
