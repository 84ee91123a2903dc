"""Checkpoint what a cluster holds and resume from the newest verified checkpoint (`train.checkpoint` writes
and verifies the files; this module decides what goes in and how it comes back)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edit_train.config import Config, to_container
from edit_train.data.loader import TokenLoader
from edit_train.local_sgd.sync.state import SyncState
from edit_train.timing import TimeAccount
from edit_train.train.checkpoint import CheckpointError, CheckpointManager
from edit_train.train.progress import TrainingState
from edit_train.train.spike import SpikeGuard
from edit_train.train.state import (load_model_tensors, load_optimizer_tensors, model_tensors,
                                    optimizer_tensors, restore_rng, rng_json, rng_tensors)

log = logging.getLogger(__name__)

Loaded = tuple[Path, dict[str, dict[str, torch.Tensor]], dict[str, Any]]


@dataclass
class Resumable:
    """Everything a checkpoint holds besides the training state."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    sync: SyncState
    loader: TokenLoader
    spike: SpikeGuard
    timing: TimeAccount


def save_checkpoint(ckpt: CheckpointManager, step: int, state: TrainingState, parts: Resumable, cfg: Config,
                    wandb_run_id: str | None) -> Path:
    """Model, optimizer, sync state, loader, RNG and time account of this rank (safetensors + JSON), named by
    `step` (the agreed step: clusters of a time-scheduled run have different step counts)."""
    tensors = {"model": model_tensors(parts.model), "optim": optimizer_tensors(parts.optimizer, parts.model),
               "rng": rng_tensors(), "requeue": parts.spike.state_tensors(), **parts.sync.tensors()}
    saved = {**state.checkpoint_json(), "loader": parts.loader.state_dict(), "rng": rng_json(),
             "algo": parts.sync.json(), "config": to_container(cfg), "wandb_run_id": wandb_run_id,
             "spike": parts.spike.state_json(), "time": parts.timing.snapshot()}
    return ckpt.save(step, tensors, saved)


def find_resume(ckpt: CheckpointManager, cfg: Config, is_leader: bool) -> Loaded | None:
    """The newest verified checkpoint (loaded), or None; refuses one written for another model."""
    path = ckpt.latest_valid()
    if path is None:
        if is_leader:
            log.info("resume: no complete checkpoint in %s, starting fresh", ckpt.root)
        return None
    tensors, saved = ckpt.load(path)
    was = saved.get("config", {}).get("model", {})
    now = to_container(cfg)["model"]
    how = ("init_from", "expert_impl", "loss_chunk")  # how the model is loaded or computed, not which model
    changed = sorted(k for k in now if k not in how and k in was and was[k] != now[k])
    if changed:
        raise CheckpointError(f"{path}: written for a different model (model.{changed[0]}: {was[changed[0]]!r} "
                              f"there, {now[changed[0]]!r} now); resume with the same model or use a new run.dir")
    return path, tensors, saved


def resume(loaded: Loaded, state: TrainingState, parts: Resumable, record_found: bool, is_leader: bool) -> None:
    """Put a loaded checkpoint back into every part."""
    path, tensors, saved = loaded
    load_model_tensors(parts.model, tensors["model"])
    load_optimizer_tensors(parts.optimizer, parts.model, tensors["optim"])
    parts.sync.load(tensors, saved["algo"])
    parts.loader.load_state_dict(saved["loader"])
    restore_rng(tensors["rng"], saved["rng"])
    if "spike" in saved:
        parts.spike.load(saved["spike"], tensors.get("requeue", {}))
    parts.timing.carry(saved.get("time", {}))  # the breakdown covers the incarnations before this one too
    state.restore(saved, record_found)
    if is_leader:
        log.info("resumed from %s (step %d)", path, saved["step"])
    changed = state.continue_schedule(saved)  # train.steps etc. changed: continue the lr, no jump
    if changed and is_leader:
        log.warning("%s", changed)
