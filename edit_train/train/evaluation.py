"""Validation loss of a cluster's model: the same windows whatever the cluster's size, so every cluster that
holds the same anchor reports the same loss."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from edit_train.cluster.mesh import Topology
from edit_train.config import TrainConfig
from edit_train.data.loader import TokenDataset, eval_batches


def reshard(model: nn.Module) -> None:
    """FSDP2 keeps the root unit gathered after a forward with no backward (eval): shard it again so
    parameters, optimizer state and the sync engine all see the sharded parameters."""
    for module in model.modules():
        if hasattr(module, "reshard"):
            module.reshard()


@torch.no_grad()
def evaluate(model: nn.Module, data_dir: str | Path | list[str | Path], t: TrainConfig, topo: Topology,
             autocast: Callable[[], contextlib.AbstractContextManager]) -> float:
    """Mean val loss over `t.eval_batches` batches. Every rank runs the same number of forwards (FSDP gathers
    inside them): the rows are split over the cluster's ranks and a rank short of rows runs a zero-weight
    filler."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    batches = eval_batches(data_dir, t.batch_size, t.seq_len, t.eval_batches)
    xs = torch.cat([x for x, _ in batches])[topo.rank::topo.ranks]
    ys = torch.cat([y for _, y in batches])[topo.rank::topo.ranks]
    rows = -(-sum(x.shape[0] for x, _ in batches) // topo.ranks)
    for i in range(-(-rows // t.batch_size)):
        x, y = xs[i * t.batch_size:(i + 1) * t.batch_size], ys[i * t.batch_size:(i + 1) * t.batch_size]
        weight = y.numel()
        if weight == 0:
            x, y = batches[0][0][:1], batches[0][1][:1]
        with autocast():
            out = model(x.to(topo.device), y.to(topo.device))
        total += torch.tensor([float(out.ce_loss) * weight, weight], dtype=torch.float64)
    return _finish(model, total, topo)


def _finish(model: nn.Module, total: torch.Tensor, topo: Topology) -> float:
    """[Σ loss·weight, Σ weight] summed over the cluster's ranks → the mean; the model back to training."""
    if topo.distributed:
        total = total.to(topo.device)
        dist.all_reduce(total, group=topo.shard_pg)
        total = total.cpu()
    reshard(model)
    model.train()
    return float(total[0] / total[1])


def probe_batch(data_dir: str | Path | list[str | Path], seq_len: int, tokens: int,
                part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe slice of cluster `part`: ⌈tokens / seq_len⌉ windows from the *end* of the val split (the val
    loss is measured on its first windows), a different stretch for every cluster. A list of datasets (the
    shared validation of per-site data): row i from dataset (part + i) mod D, at the same place in it."""
    sets = [TokenDataset(d, "val") for d in (data_dir if isinstance(data_dir, list) else [data_dir])]
    rows = max(1, -(-tokens // seq_len))
    picked = []
    for i in range(rows):
        ds = sets[(part + i) % len(sets)]
        windows = max((ds.tokens - 1) // seq_len, 1)
        w = (max(windows - rows * (part + 1), 0) + i) % windows
        picked.append(ds.get(w * seq_len, w * seq_len + seq_len + 1))
    data = torch.from_numpy(np.stack(picked).astype(np.int64))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


@torch.no_grad()
def batch_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], topo: Topology,
               autocast: Callable[[], contextlib.AbstractContextManager]) -> float:
    """Mean loss of one batch, its rows split over the cluster's ranks (every rank runs one forward)."""
    x, y = batch
    xs, ys = x[topo.rank::topo.ranks], y[topo.rank::topo.ranks]
    if xs.shape[0] == 0:
        xs, ys, weight = x[:1], y[:1], 0.0
    else:
        weight = float(ys.numel())
    model.eval()
    with autocast():
        out = model(xs.to(topo.device), ys.to(topo.device))
    return _finish(model, torch.tensor([float(out.ce_loss) * weight, weight], dtype=torch.float64), topo)
