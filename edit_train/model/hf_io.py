"""Reading and writing BailingMoe (Ling) directories: export a model or a state, load one into a model.

The name mapping and config translation live in :mod:`edit_train.model.hf`, the sharded safetensors files in
:mod:`edit_train.model.shards`; gathering a training checkpoint is :mod:`edit_train.train.checkpoint_reader`.
Both directions go one tensor at a time: an export holds at most one shard beside the source, a load at most
one shard beside the model. Nothing here unpickles.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from edit_train.fsutil import current_umask, fsync_file
from edit_train.model.config import ModelConfig
from edit_train.model.hf import (CONFIG_NAME, GENERATION_CONFIG_NAME, REMOTE_CODE_FILES, check_same_architecture,
                                 file_layout, hf_param_shapes, hf_targets, iter_hf_tensors, parse_dtype, state_shapes,
                                 read_hf_config, serving_config, serving_state, to_hf_config)
from edit_train.offline import looks_like_hub_name, offline_hint
from edit_train.model.shards import DEFAULT_SHARD_BYTES, ShardWriter, header_shapes, iter_tensors, weight_files

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ export
def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {}
    for n, p in model.named_parameters():
        if hasattr(p, "full_tensor") or hasattr(p, "to_local"):
            raise ValueError(f"parameter {n!r} is sharded (DTensor); export a plain model, or export a checkpoint "
                             f"(edit_train.train.export)")
        state[n] = p.detach()
    persistent = state_shapes(model.config)  # type: ignore[arg-type]  # the expert-bias buffers (BailingMoeV2)
    for n, b in model.named_buffers():
        if n in persistent:
            state[n] = b.detach()
    return state


def _write_weights(state: Mapping[str, torch.Tensor], cfg: ModelConfig, tmp: Path, dtype: torch.dtype,
                   max_shard_bytes: int | str, metadata: Mapping[str, str] | None) -> list[str]:
    """Our parameters -> BailingMoe shards in ``tmp``, one parameter at a time (``state`` may be a lazy mapping
    that gathers each parameter when it is asked for it)."""
    want = state_shapes(cfg)
    missing = [k for k in want if k not in state]
    unexpected = [k for k in state.keys() if k not in want and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        parts = [f"{len(missing)} missing (e.g. {', '.join(missing[:4])})"] if missing else []
        parts += [f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:4])})"] if unexpected else []
        raise ValueError(f"model state: {'; '.join(parts)} — written for a different model config?")
    writer = ShardWriter(tmp, max_shard_bytes, metadata)
    for name, shape in want.items():
        t = state[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"model state: {name} has shape {tuple(t.shape)}, the model config needs {shape}")
        keep = torch.float32 if name.endswith(".expert_bias") else dtype  # the bias stays fp32 (it chooses experts)
        for hf_name, hf_t in iter_hf_tensors([(name, t.cpu())], keep):
            writer.add(hf_name, hf_t)
        del t
    return writer.close()


def export_hf(model_or_state: nn.Module | Mapping[str, torch.Tensor], cfg: ModelConfig | None,
              out_dir: str | os.PathLike[str], *, dtype: torch.dtype | str | None = torch.float32,
              eos_token_id: int | None = None, bos_token_id: int | None = None, overwrite: bool = False,
              extra_files: Mapping[str, str | os.PathLike[str]] | None = None,
              metadata: Mapping[str, str] | None = None, max_shard_size: int | str = DEFAULT_SHARD_BYTES) -> Path:
    """Write a BailingMoe directory that ``transformers`` loads with ``trust_remote_code=True``: ``config.json``
    (with its ``auto_map``), the weights (``model.safetensors``, or shards of at most ``max_shard_size`` with
    ``model.safetensors.index.json``), the modeling code (:data:`~edit_train.model.hf.REMOTE_CODE_FILES`) and,
    when ``eos_token_id`` is known, ``generation_config.json`` (plus ``extra_files``: name -> source path, e.g.
    a ``tokenizer.json``).

    Streams: one parameter is converted at a time and at most one shard is held before it is written, so the
    export needs about one shard of memory beside ``model_or_state`` (which may be a lazy mapping).
    Atomic: everything is written into a temporary sibling directory which is then renamed into place, so
    ``out_dir`` is either absent/untouched or complete. An existing non-empty ``out_dir`` is refused unless
    ``overwrite``. ``cfg`` may be ``None`` when a ``CausalLM`` is passed (its ``config`` is used).
    """
    if isinstance(model_or_state, nn.Module):
        cfg = cfg if cfg is not None else getattr(model_or_state, "config", None)
        state: Mapping[str, torch.Tensor] = _full_state(model_or_state)
    else:
        state = model_or_state
    if cfg is None:
        raise ValueError("export_hf: a ModelConfig is needed with a plain state dict")
    dtype = parse_dtype(dtype) or torch.float32
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out}: directory exists and is not empty; choose a new output directory or pass "
                         f"overwrite=True")
    hf_cfg = to_hf_config(cfg, dtype, eos_token_id=eos_token_id, bos_token_id=bos_token_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_weights(serving_state(state, cfg), serving_config(cfg), tmp, dtype, max_shard_size, metadata)
        (tmp / CONFIG_NAME).write_text(json.dumps(hf_cfg, indent=2) + "\n")
        for name in REMOTE_CODE_FILES:
            (tmp / name).write_bytes(resources.files("edit_train.model").joinpath(name).read_bytes())
        if eos_token_id is not None:
            gen = {"_from_model_config": True, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
                   "pad_token_id": eos_token_id}
            (tmp / GENERATION_CONFIG_NAME).write_text(json.dumps(gen, indent=2) + "\n")
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Give ``tmp``'s files the usual permissions, fsync them and rename ``tmp`` to ``out`` (replacing it)."""
    umask = current_umask()  # mkdtemp / safetensors create 0700 / 0600
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


# -------------------------------------------------------------------------------------------- load
def read_hf_weights(directory: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], Path]:
    """All tensors of ``model.safetensors`` (or of the shards named by ``model.safetensors.index.json``), in
    memory at once: for small models and tests; :func:`load_hf_into` streams."""
    files, src = weight_files(directory)
    return dict(iter_tensors(files)), src


#: What an MTP layer of a public checkpoint may carry besides its own weights: copies of the shared embeddings / head
#: (SGLang's nextn loader skips them too); ignored, the model's own are used.
_MTP_SHARED = re.compile(r"^model\.layers\.\d+\.(shared_head\.(head|norm)\.weight|embed_tokens\.weight)$")


def _check_names(files: Mapping[Path, list[str]], src: Path, cfg: ModelConfig) -> None:
    want = hf_param_shapes(cfg)
    got = header_shapes(files)
    extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want and k not in extra and not _MTP_SHARED.match(k)]
    if missing or unexpected:
        parts = [f"{len(missing)} missing (e.g. {', '.join(missing[:4])})"] if missing else []
        parts += [f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:4])})"] if unexpected else []
        raise ValueError(f"{src}: {'; '.join(parts)} — written for a different model config?")
    for k, shape in want.items():
        if got[k] != shape:
            raise ValueError(f"{src}: {k} has shape {got[k]}, the model config needs {shape}")


@torch.no_grad()
def load_hf_into(model: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Copy the weights of a BailingMoe directory (one file or shards with an index) into a plain (not yet
    sharded) ``CausalLM``, one tensor at a time and one file open at a time: about one shard of memory
    beside the model.

    ``config.json`` must agree with ``model.config`` on every architecture field, and the files' headers must
    hold exactly the tensors and shapes the model needs (ValueError naming the field or file otherwise, before
    any weight is changed); tensors are cast to each parameter's dtype and device. Both encodings load: our
    served one (``edit_train.model.hf`` docstring: a normalised head, loaded into ``NormHead`` as it is — the
    same logits, since normalising it again changes it by about 1e-7) and the literal one of older exports and
    public Ling checkpoints.
    """
    d = Path(directory)
    if not d.is_dir():
        if looks_like_hub_name(str(directory)):
            raise ValueError(offline_hint(str(directory), "model.init_from"))
        raise ValueError(f"{d}: not a directory; model.init_from must name a Hugging Face BailingMoe directory")
    ours: ModelConfig = model.config  # type: ignore[assignment]
    theirs, raw = read_hf_config(d)
    check_same_architecture(ours, theirs, d / CONFIG_NAME)
    # the files' own layout: the served encoding (our exports: head already normalised, a tied norm_head stored
    # untied) or, without the trained-head key (older exports, public checkpoints), the architecture as it reads
    layout = file_layout(ours, raw)
    files, src = weight_files(d)
    _check_names(files, src, layout)
    params = dict(model.named_parameters())
    for name, _ in params.items():
        if hasattr(params[name], "to_local"):
            raise ValueError(f"load_hf_into: parameter {name!r} is already sharded (DTensor); "
                             f"load the weights before parallelize()")
    persistent = state_shapes(ours)
    params.update({n: b for n, b in model.named_buffers() if n in persistent})  # the expert biases
    targets = hf_targets(layout)
    n = 0
    for hf_name, value in iter_tensors(files):
        if hf_name not in targets or targets[hf_name][0] not in params:
            continue  # a stray lm_head.weight beside tied embeddings, or the served copy of a tied normalised head
        name, expert = targets[hf_name]
        p = params[name]
        (p if expert is None else p[expert]).copy_(value)
        n += 1
    log.info("loaded %d tensors from %s", n, src)
