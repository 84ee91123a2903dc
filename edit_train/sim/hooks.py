"""The training loop's one seam for simulation: what an injected fault or simulated slower hardware may do to
a step. The loop (train/trainer.py) calls each point once where it belongs and knows no fault kind:

* `before_step(step, federation)` — before the step starts (`kill`, `kill_cluster`, `partition`);
* `lr(step, lr)`                  — the step's inner learning rate (`lr_spike`);
* `batch(step, x, y)`             — each micro-batch before its forward pass (`garbage_data`);
* `grads(step, model)`            — the gradients after backward, before clipping (`nan_grad`);
* `after_step(step, compute_s)`   — after the step's compute, charged to the `slowdown` time bucket (the sleep of a
                                    slower cluster; `slept_s` is the summary's `slowdown_slept_s`);
* `transport(t)`                  — once, the cross-cluster transport the algorithm gets (what a Byzantine cluster
                                    sends or claims: sim/byzantine.py wraps it).

`StepHooks` itself is the no-op, the hooks of a cluster with no fault and no slowdown: every point hands back
what it got and calls nothing that could change a number. sim/faults.py (`FaultInjector`), sim/byzantine.py
(`PayloadFaults`) and sim/hetero.py (`Slowdown`) override the points they need; `Chain` composes them and
sim/build.py (`step_hooks`) builds a cluster's from its config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn


class Federation(Protocol):
    """What `before_step` may do to the cluster's federation (the algorithm, `LocalSGD`)."""

    def partition(self, seconds: float) -> None: ...


class StepHooks:
    """The no-op: a step as the loop runs it."""

    slept_s: float = 0.0  # seconds `after_step` slept (simulated slower hardware)

    def before_step(self, step: int, federation: Federation) -> None:
        """Before step `step` begins (the process may die here, or the cluster be cut off)."""

    def lr(self, step: int, lr: float) -> float:
        return lr

    def batch(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, y

    def grads(self, step: int, model: nn.Module) -> None:
        """The gradients of step `step`, after backward and before clipping (changed in place)."""

    def after_step(self, step: int, compute_s: float) -> float:
        """After step `step`'s compute (`compute_s` seconds of it); returns the seconds slept."""
        return 0.0

    def transport(self, transport: Any) -> Any:
        return transport


class Chain(StepHooks):
    """Several hooks, each point called on every part in order (the filters feed each other)."""

    def __init__(self, parts: list[StepHooks]) -> None:
        self.parts = list(parts)

    @property  # type: ignore[override]
    def slept_s(self) -> float:
        return sum((h.slept_s for h in self.parts), 0.0)

    def before_step(self, step: int, federation: Federation) -> None:
        for h in self.parts:
            h.before_step(step, federation)

    def lr(self, step: int, lr: float) -> float:
        for h in self.parts:
            lr = h.lr(step, lr)
        return lr

    def batch(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for h in self.parts:
            x, y = h.batch(step, x, y)
        return x, y

    def grads(self, step: int, model: nn.Module) -> None:
        for h in self.parts:
            h.grads(step, model)

    def after_step(self, step: int, compute_s: float) -> float:
        return sum((h.after_step(step, compute_s) for h in self.parts), 0.0)

    def transport(self, transport: Any) -> Any:
        for h in self.parts:
            transport = h.transport(transport)
        return transport
