"""The val loss of a finished run's end model on a larger val set than the trainer's own evaluation.

The trainer evaluates on `train.eval_batches` batches (8 × 8 × 128 = 8,192 tokens in penalty_faults), enough
to follow a run but not to rank two runs whose end models differ by under 1 %: measured on the 2-cluster
penalty_faults runs, the ratio of a faulty run to its oracle moved by up to 0.9 % between those 8 batches and
128 (1.0094 → 1.0004, random_direction seed 1), because two models that parted during training are better
and worse on different stretches of text. This module loads the end checkpoint (`checkpoint.at_end=true`;
every cluster holds the anchor there, so cluster 0's replica is the model) and evaluates it on the first
`batches` windows of the same val split with the trainer's own `evaluate`, the same windows for every run of a
comparison.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from edit_train.cluster.mesh import Topology
from edit_train.config import TrainConfig
from edit_train.data import ensure_dataset
from edit_train.data.loader import eval_batches
from edit_train.train.checkpoint_reader import gather_checkpoint
from edit_train.model.transformer import CausalLM
from edit_train.train.evaluation import evaluate


def end_val_loss(run_dir: Path, batches: int) -> tuple[float, int]:
    """(mean val loss, tokens) of the run's last checkpoint of cluster 0 on the first `batches` val batches
    (the run's own data, batch size and sequence length, read from its `config.json`), by the trainer's own
    `evaluate` in this one CPU process."""
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
    d, t = cfg["data"], cfg["train"]
    data_dir = ensure_dataset(d["source"], d["tokenizer"], d.get("cache_dir"), val_fraction=float(d["val_fraction"]),
                              seed=int(d["seed"]))
    train = TrainConfig(batch_size=int(t["batch_size"]), seq_len=int(t["seq_len"]), eval_batches=batches)
    lone = Topology(1, 0, "end-eval", 0, torch.device("cpu"), None)
    loss = evaluate(model, data_dir, train, lone, contextlib.nullcontext)
    return loss, sum(y.numel() for _, y in eval_batches(data_dir, train.batch_size, train.seq_len, batches))
