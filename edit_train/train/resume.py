"""Checkpoint a trainer's state and resume from the newest verified checkpoint (`train.checkpoint` writes
and verifies the files; this module decides what goes in and how it comes back)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from edit_train.config import to_container
from edit_train.train.checkpoint import CheckpointError
from edit_train.train.state import (load_model_tensors, load_optimizer_tensors, model_tensors,
                                    optimizer_tensors, restore_rng, rng_json, rng_tensors)

if TYPE_CHECKING:
    from edit_train.train.trainer import Trainer

log = logging.getLogger(__name__)


def save_checkpoint(tr: Trainer) -> None:
    """Model, optimizer, algorithm, loader, RNG and time account of this rank (safetensors + JSON)."""
    p = tr.progress
    tensors = {"model": model_tensors(tr.model), "optim": optimizer_tensors(tr.optimizer, tr.model),
               "rng": rng_tensors(), "requeue": tr.spike.state_tensors()}
    tensors.update(tr.algo.state.tensors())
    state = {"step": p.step, "tokens": p.tokens, "skipped_steps": p.skipped_steps,
             "wall_s": p.wall_offset + (time.time() - tr.t0), "loader": tr.loader.state_dict(),
             "rng": rng_json(), "algo": tr.algo.state.json(), "config": to_container(tr.cfg),
             "wandb_run_id": tr.wandb.run_id if tr.wandb else None,
             "spike": tr.spike.state_json(), "time": tr.timing.snapshot()}
    # groups of a time-scheduled run have different step counts: name the checkpoint by the agreed one
    path = tr.ckpt.save(p.step if tr.algo.lockstep else tr.algo.global_step, tensors, state)
    if tr.is_main:
        log.info("checkpoint saved: %s", path)


def find_resume(tr: Trainer) -> tuple[Path, dict[str, dict[str, torch.Tensor]], dict[str, Any]] | None:
    """The newest verified checkpoint (loaded), or None; refuses one written for another model."""
    path = tr.ckpt.latest_valid()
    if path is None:
        if tr.is_main:
            log.info("resume: no complete checkpoint in %s, starting fresh", tr.ckpt.root)
        return None
    tensors, state = tr.ckpt.load(path)
    saved = state.get("config", {}).get("model", {})
    now = to_container(tr.cfg)["model"]
    changed = sorted(k for k in now if k not in ("init_from", "expert_impl") and k in saved and saved[k] != now[k])
    if changed:
        raise CheckpointError(f"{path}: written for a different model (model.{changed[0]}: {saved[changed[0]]!r} "
                              f"there, {now[changed[0]]!r} now); resume with the same model or use a new run.dir")
    return path, tensors, state


def resume(tr: Trainer, path: Path, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any]) -> None:
    """Put a loaded checkpoint back into every part of the trainer."""
    from edit_train.train.trainer import Progress

    load_model_tensors(tr.model, tensors["model"])
    load_optimizer_tensors(tr.optimizer, tr.model, tensors["optim"])
    tr.algo.state.load(tensors, state["algo"])
    tr.loader.load_state_dict(state["loader"])
    restore_rng(tensors["rng"], state["rng"])
    if "spike" in state:
        tr.spike.load(state["spike"], tensors.get("requeue", {}))
    tr.timing.carry(state.get("time", {}))  # the breakdown covers the incarnations before this one too
    tr.progress = Progress(step=state["step"], tokens=state["tokens"],
                           skipped_steps=state["skipped_steps"], wall_offset=state["wall_s"])
    if tr.is_main:
        log.info("resumed from %s (step %d)", path, state["step"])
