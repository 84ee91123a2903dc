"""The inner optimizer: AdamW from ``train.*`` (``train.optimizer=muon``: Muon on the layers' matrices, train/muon.py), fused into one kernel per step on CUDA.

``fused=True`` (one multi-tensor CUDA kernel, no per-parameter temporaries) on CUDA only: on the CPU the
default (foreach) implementation keeps the CPU numerics every benchmark and test was pinned with. Its
``step`` counters live on the parameters' device, as torch itself places them when it loads a state dict
(``local_sgd.healing.step_device``: checkpoint resume and healing put them back there).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from edit_train.config import TrainConfig


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
                             fused=device.type == "cuda" or None)
