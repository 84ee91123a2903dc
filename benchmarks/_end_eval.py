"""The val loss of a finished run's end model on a larger val set than the trainer's own evaluation.

The trainer evaluates on `train.eval_batches` batches (8 × 8 × 128 = 8,192 tokens in penalty_faults), enough
to follow a run but not to rank two runs whose end models differ by under 1 %: measured on the 2-cluster
penalty_faults runs, the ratio of a faulty run to its oracle moved by up to 0.9 % between those 8 batches and
128 (1.0094 → 1.0004, random_direction seed 1), because two models that parted during training are better
and worse on different stretches of text. This module loads the end checkpoint (`checkpoint.at_end=true`;
every cluster holds the anchor there, so cluster 0's replica is the model) and evaluates it on the first
`batches` windows of the same val split, the same windows for every run of a comparison.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from edit_train.data import ensure_dataset
from edit_train.data.loader import eval_batches
from edit_train.model.hf_io import gather_checkpoint
from edit_train.model.transformer import CausalLM


@lru_cache(maxsize=4)
def _batches(source: str, tokenizer: str, cache_dir: str | None, val_fraction: float, seed: int,
             batch_size: int, seq_len: int, batches: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    data_dir = ensure_dataset(source, tokenizer, cache_dir, val_fraction=val_fraction, seed=seed)
    return tuple(eval_batches(data_dir, batch_size, seq_len, batches))


def end_val_loss(run_dir: Path, batches: int) -> tuple[float, int]:
    """(mean val loss, tokens) of the run's last checkpoint of cluster 0 on the first `batches` val batches
    (the run's own data, batch size and sequence length, read from its `config.json`)."""
    cfg = json.loads((Path(run_dir) / "config.json").read_text())
    root = Path(run_dir) / "checkpoints"
    # a lone cluster writes checkpoints/step_*, a federation checkpoints/<cluster>/step_*: the first cluster's
    steps = sorted(root.glob("step_*")) or sorted(root.glob("*/step_*"), key=lambda p: p.parent.name)
    if not steps:
        raise FileNotFoundError(f"{run_dir}: no checkpoints/[<cluster>/]step_*; run it with checkpoint.at_end=true")
    step_dir = max(steps, key=lambda p: (p.parent == steps[0].parent, int(p.name.split("_")[1])))
    state, model_cfg = gather_checkpoint(step_dir, group=0)
    model = CausalLM(model_cfg)
    model.load_state_dict(state, strict=True)
    model.eval()
    d, t = cfg["data"], cfg["train"]
    data = _batches(d["source"], d["tokenizer"], d.get("cache_dir"), float(d["val_fraction"]), int(d["seed"]),
                    int(t["batch_size"]), int(t["seq_len"]), batches)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for x, y in data:
            total += float(model(x, y).ce_loss) * y.numel()
            tokens += y.numel()
    return total / tokens, tokens
