"""Reading and writing BailingMoe (Ling) directories: export, load into a model, gather a checkpoint.

The name mapping and config translation live in :mod:`edit_train.model.hf`. Nothing here unpickles.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from edit_train.fsutil import current_umask, fsync_file
from edit_train.model.config import ModelConfig
from edit_train.model.hf import (CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, check_same_architecture, from_hf_state_dict, param_shapes, parse_dtype, read_hf_config, to_hf_config, to_hf_state_dict)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ export
def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {}
    for n, p in model.named_parameters():
        if hasattr(p, "full_tensor") or hasattr(p, "to_local"):
            raise ValueError(f"parameter {n!r} is sharded (DTensor); export a plain model, or gather a checkpoint "
                             f"with gather_checkpoint()")
        state[n] = p.detach().cpu()
    return state


def export_hf(model_or_state: nn.Module | Mapping[str, torch.Tensor], cfg: ModelConfig | None,
              out_dir: str | os.PathLike[str], *, dtype: torch.dtype | str | None = torch.float32,
              eos_token_id: int | None = None, bos_token_id: int | None = None, overwrite: bool = False,
              extra_files: Mapping[str, str | os.PathLike[str]] | None = None,
              metadata: Mapping[str, str] | None = None) -> Path:
    """Write a BailingMoe directory: ``config.json``, ``model.safetensors`` and, when ``eos_token_id`` is
    known, ``generation_config.json`` (plus ``extra_files``: name -> source path, e.g. a ``tokenizer.json``).

    Atomic: everything is written into a temporary sibling directory which is then renamed into place, so
    ``out_dir`` is either absent/untouched or complete. An existing non-empty ``out_dir`` is refused unless
    ``overwrite``. ``cfg`` may be ``None`` when a ``CausalLM`` is passed (its ``config`` is used).
    """
    if isinstance(model_or_state, nn.Module):
        cfg = cfg if cfg is not None else getattr(model_or_state, "config", None)
        state = _full_state(model_or_state)
    else:
        state = dict(model_or_state)
    if cfg is None:
        raise ValueError("export_hf: a ModelConfig is needed with a plain state dict")
    dtype = parse_dtype(dtype) or torch.float32
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out}: directory exists and is not empty; choose a new output directory or pass "
                         f"overwrite=True")

    tensors = {k: v.cpu() for k, v in to_hf_state_dict(state, cfg, dtype).items()}
    hf_cfg = to_hf_config(cfg, dtype, eos_token_id=eos_token_id, bos_token_id=bos_token_id)
    if cfg.tie_word_embeddings and cfg.norm_head:
        log.warning("export: tie_word_embeddings with norm_head: BailingMoe's eval-mode head normalises "
                    "lm_head.weight in place, which also rewrites the tied embeddings")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", **dict(metadata or {})})
        (tmp / CONFIG_NAME).write_text(json.dumps(hf_cfg, indent=2) + "\n")
        if eos_token_id is not None:
            gen = {"_from_model_config": True, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
                   "pad_token_id": eos_token_id}
            (tmp / GENERATION_CONFIG_NAME).write_text(json.dumps(gen, indent=2) + "\n")
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
        umask = current_umask()  # mkdtemp / safetensors create 0700 / 0600: give the usual permissions
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
            fsync_file(f)
        os.chmod(tmp, 0o777 & ~umask)
        if out.is_dir():
            if any(out.iterdir()):  # overwrite: move the old one aside, swap, then delete it
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.replace(out, old / out.name)
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                out.rmdir()
                os.replace(tmp, out)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# -------------------------------------------------------------------------------------------- load
def _read_safetensors(path: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if names is None or k in names}
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types; nothing else is parsed
        raise ValueError(f"{path}: not a valid safetensors file ({str(exc).strip() or type(exc).__name__})") from None


def read_hf_weights(directory: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], Path]:
    """All tensors of ``model.safetensors`` (or of the shards named by ``model.safetensors.index.json``)."""
    d = Path(directory)
    single, index = d / WEIGHTS_NAME, d / WEIGHTS_INDEX_NAME
    if single.is_file():
        return _read_safetensors(single), single
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: unreadable index ({exc})") from None
        tensors: dict[str, torch.Tensor] = {}
        by_file: dict[str, set[str]] = {}
        for k, f in weight_map.items():
            by_file.setdefault(f, set()).add(k)
        for f, keys in by_file.items():
            if "/" in f or "\\" in f or f.startswith("."):
                raise ValueError(f"{index}: shard name {f!r} must be a file in {d}")
            if not (d / f).is_file():
                raise ValueError(f"{d / f}: listed in {index.name} but missing")
            tensors.update(_read_safetensors(d / f, keys))
        return tensors, index
    raise ValueError(f"{single}: not found (nor {index.name}); expected a Hugging Face BailingMoe directory")


@torch.no_grad()
def load_hf_into(model: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Copy the weights of a BailingMoe directory into a plain (not yet sharded) ``CausalLM``.

    ``config.json`` must agree with ``model.config`` on every architecture field (ValueError naming the field
    and the file otherwise); tensors are cast to each parameter's dtype and device.
    """
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory; model.init_from must name a Hugging Face BailingMoe directory")
    ours: ModelConfig = model.config  # type: ignore[assignment]
    theirs, _ = read_hf_config(d)
    check_same_architecture(ours, theirs, d / CONFIG_NAME)
    hf, src = read_hf_weights(d)
    state = from_hf_state_dict(hf, ours, src)
    params = dict(model.named_parameters())
    for name, value in state.items():
        p = params[name]
        if hasattr(p, "to_local"):
            raise ValueError(f"load_hf_into: parameter {name!r} is already sharded (DTensor); "
                             f"load the weights before parallelize()")
        p.copy_(value.to(device=p.device, dtype=p.dtype))
    log.info("loaded %d tensors from %s", len(hf), src)


# ------------------------------------------------------------------------------- checkpoint gathering
def _model_config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})


def gather_checkpoint(step_dir: str | os.PathLike[str], group: int = 0) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """The full parameters of worker group ``group`` from a checkpoint directory ``step_NNNNNNNN/``.

    Each rank's ``rank{r}-model.safetensors`` holds its FSDP2 shard of every parameter (``param/<name>``, split
    along dim 0 with ``torch.chunk`` semantics); group ``g``'s ranks are ``g*S .. g*S+S-1`` (``S`` =
    ``cluster.shard_size`` from ``rank{r}-state.json``'s config), so concatenating their shards in rank order
    rebuilds the group's replica. Checkpoints are taken at sync boundaries (the trainer flushes the algorithm
    first, and at the end after its final sync), where every group's parameters equal the anchor, i.e. the
    global model; the outer state (anchors, momentum) is therefore not needed. Does not verify checksums
    (``CheckpointManager.verify`` does).
    """
    d = Path(step_dir)
    if not d.is_dir():
        raise ValueError(f"{d}: not a checkpoint directory")
    state_files = sorted(d.glob("rank*-state.json"))
    if not state_files:
        raise ValueError(f"{d}: no rank*-state.json; not an edit-train checkpoint directory (step_NNNNNNNN)")
    state_path = d / "rank0-state.json" if (d / "rank0-state.json").is_file() else state_files[0]
    try:
        run_cfg = json.loads(state_path.read_text())["config"]
        model_cfg = _model_config_from_dict(run_cfg["model"])
        groups = int(run_cfg["cluster"]["groups"])
        shard = int(run_cfg["cluster"]["shard_size"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{state_path}: unreadable or without config.model / config.cluster ({exc!r})") from None
    if not 0 <= group < groups:
        raise ValueError(f"group {group} is out of range: {d} was written by {groups} group(s)")
    shapes = param_shapes(model_cfg)
    pieces: dict[str, list[torch.Tensor]] = {n: [] for n in shapes}
    for r in range(group * shard, (group + 1) * shard):
        path = d / f"rank{r}-model.safetensors"
        if not path.is_file():
            raise ValueError(f"{path}: missing (the checkpoint was written by {groups}x{shard} ranks)")
        tensors = _read_safetensors(path)
        for n in shapes:
            key = f"param/{n}"
            if key not in tensors:
                raise ValueError(f"{path}: no tensor {key!r} (written for a different model?)")
            pieces[n].append(tensors[key])
    full: dict[str, torch.Tensor] = {}
    for n, shape in shapes.items():
        t = pieces[n][0] if len(pieces[n]) == 1 else torch.cat(pieces[n], dim=0)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{d}: parameter {n!r} gathers to shape {tuple(t.shape)} over ranks "
                             f"{group * shard}..{(group + 1) * shard - 1}, the model config needs {tuple(shape)}")
        full[n] = t
    return full, model_cfg
