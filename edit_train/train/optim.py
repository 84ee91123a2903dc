"""The inner optimizer: AdamW from ``train.*``, fused into one multi-tensor kernel per step
(``train.optimizer=muon``: Muon on the layers' matrices, train/muon.py).

``fused=True`` on CUDA and on the CPU (torch >= 2.4 has both kernels): besides one kernel per step and no
per-parameter temporaries, the fused kernel takes ``found_inf``, so the trainer skips a step with non-finite
gradients (or a loss spike) on the device, without reading anything back (`step_unless`). On the CPU it
differs from the foreach implementation by one float rounding (~1e-7 relative). Its ``step`` counters live
on the parameters' device, as torch itself places them when it loads a state dict
(``local_sgd.healing.step_device``: checkpoint resume and healing put them back there).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from edit_train.config import TrainConfig

FUSED_DEVICES = ("cuda", "cpu")


def build_optimizer(params: Iterable[tuple[str, torch.nn.Parameter]] | Iterable[torch.nn.Parameter], t: TrainConfig,
                    device: torch.device) -> torch.optim.Optimizer:
    """The inner optimizer over a model's ``named_parameters()`` (Muon picks its matrices by name) or, for AdamW,
    its ``parameters()``."""
    named = [(item if isinstance(item, tuple) else ("", item)) for item in params]
    if t.optimizer == "muon":
        from edit_train.train.muon import MuonAdamW

        return MuonAdamW(named, lambda ps: _adamw(ps, t, device), t.lr, t.weight_decay, t.muon_momentum)
    return _adamw([p for _, p in named], t, device)


def _adamw(params: Iterable[torch.nn.Parameter], t: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay,
                             fused=device.type in FUSED_DEVICES or None)


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """``optimizer.step()`` unless the 0-d bool ``skip`` is true, decided on ``skip``'s device: a fused
    optimizer gets it as ``found_inf`` (its kernel leaves parameters, moments and step counters as they
    were); any other optimizer reads it on the host (one sync)."""
    if all(group.get("fused") for group in optimizer.param_groups):  # (a resumed state dict may say otherwise)
        optimizer.found_inf = skip.to(torch.float32).reshape(())  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            optimizer.found_inf = None  # type: ignore[attr-defined]
    elif not bool(skip):
        optimizer.step()
