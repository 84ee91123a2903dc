"""Flatten training state (model shard, inner optimizer, RNG) to tensors for safetensors, and back."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from edit_train.cluster.group import local_tensor
from edit_train.local_sgd.sync.healing import step_device
from edit_train.train.checkpoint import UNCHECKED_ENV, CheckpointError


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's local shard of every parameter and persistent or not buffer."""
    out = {f"param/{n}": local_tensor(p.detach()) for n, p in model.named_parameters()}
    out.update({f"buffer/{n}": b.detach() for n, b in model.named_buffers()})
    return out


@torch.no_grad()
def load_model_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        key = f"param/{name}"
        if key not in tensors:
            raise CheckpointError(f"checkpoint has no tensor for parameter {name!r} (different model config?)")
        dst = local_tensor(p.data)
        if dst.shape != tensors[key].shape:
            raise CheckpointError(f"parameter {name!r}: checkpoint shape {tuple(tensors[key].shape)} "
                             f"!= model shard shape {tuple(dst.shape)} (different model or world layout?)")
        if dst.dtype != tensors[key].dtype and os.environ.get(UNCHECKED_ENV) != "1":
            raise CheckpointError(f"parameter {name!r}: checkpoint dtype {tensors[key].dtype} != the model's "
                                  f"{dst.dtype} (a different model.dtype? {UNCHECKED_ENV}=1 loads it anyway)")
        dst.copy_(tensors[key])
    for name, b in model.named_buffers():
        key = f"buffer/{name}"
        if key in tensors:
            b.copy_(tensors[key])


def optimizer_tensors(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """Inner optimizer state keyed by parameter name (local shards)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for p, st in optimizer.state.items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                out[f"{names[id(p)]}/{key}"] = local_tensor(value.detach())
            else:
                out[f"{names[id(p)]}/{key}"] = torch.tensor(float(value), dtype=torch.float64)
    return out


@torch.no_grad()
def load_optimizer_tensors(optimizer: torch.optim.Optimizer, model: nn.Module,
                           tensors: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        if name not in params:
            raise CheckpointError(f"optimizer state for unknown parameter {name!r} (different model config?)")
        per_param.setdefault(name, {})[field] = value
    for name, st in per_param.items():
        p = params[name]
        restored: dict[str, Any] = {}
        for field, value in st.items():
            if field == "step":
                restored[field] = value.to(device=step_device(optimizer, p), dtype=torch.float32)
            elif hasattr(p, "to_local") and value.shape == local_tensor(p).shape:
                from torch.distributed.tensor import DTensor

                restored[field] = DTensor.from_local(value.to(p.device), p.device_mesh, p.placements,
                                                     shape=p.shape, stride=p.stride(), run_check=False)
            else:
                restored[field] = value.to(p.device)
        optimizer.state[p] = restored


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    return out


def rng_json() -> dict[str, Any]:
    py = random.getstate()
    np_state = np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}


def restore_rng(tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    if "python" in state:
        v, internal, gauss = state["python"]
        random.setstate((v, tuple(internal), gauss))
    if "numpy" in state:
        a, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((a, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
