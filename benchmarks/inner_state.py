"""Is syncing the inner optimizer's state the missing piece? DDP vs local SGD in ONE process (issue 51).

A research harness, not the product path: G replicas of the `model=tiny` model on the clusters' own data parts,
the real optimizer (`train.optimizer`, Muon's momentum), lr schedule, gradient clip, evaluation and data as a
`cluster=local cluster.count=G` run, but none of the federation (no rule, no clip of the merged update, no
outer optimizer: plain averaging every H steps). Modes:

* `ddp` — one model, each step the mean gradient of the G clusters' batches (what `algo=ddp` computes);
* `local` — G replicas, parameters averaged every H steps;
* `local_mom` — and the Muon momentum buffers averaged at each sync;
* `local_state` — and every optimizer state tensor (Muon momentum, AdamW's two moments) averaged.

    python benchmarks/inner_state.py --mode local --lr 0.06 --momentum 0.9 --out r.json   # ~2 min on 2 cores

What it showed (docs/algorithms.md, "The rule's clip was taking a share of Muon's merges"): ddp 1.5307 (the
real run 1.5266), local 1.6407, local_mom 1.6429, local_state 1.6283 at lr 6e-2, momentum 0.9 (DDP: 3e-2, 0.8).
Where the 40 syncs go (`--ramp R`, `--lr-power p`; `local`, lr 3e-2, momentum 0.9): every 8 steps 1.6503,
intervals growing linearly (R = 0.75) 1.6211, shrinking (R = −0.75) 1.6947, at equal quantiles of Σ lr (p = 1)
1.6155, of Σ lr² (p = 2) 1.6557; AdamW (lr 3e-3): every 8 steps 1.9780, p = 1 1.9720, DDP 1.8454.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

STATE_KEYS = {"local": (), "local_mom": ("momentum_buffer",),
              "local_state": ("momentum_buffer", "exp_avg", "exp_avg_sq")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["ddp", *STATE_KEYS], required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--momentum", type=float, default=0.95, help="train.muon_momentum")
    ap.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    ap.add_argument("--clusters", type=int, default=2)
    ap.add_argument("--interval", type=int, default=8, help="H: local steps between averages")
    ap.add_argument("--ramp", type=float, default=0.0,
                    help="intervals grow linearly from H(1-R) to H(1+R) over the run, the same number of syncs "
                         "(R < 0: they shrink); 0: every H steps")
    ap.add_argument("--lr-power", type=float, default=0.0,
                    help="p > 0: the syncs at equal quantiles of the sum of lr^p (intervals ~ 1/lr^p, what "
                         "algo.interval_power does), the same number of syncs; overrides --ramp")
    ap.add_argument("--steps", type=int, default=320)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", type=Path, default=Path("runs/inner_state"), help="where the data cache goes")
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


@torch.no_grad()
def sync_steps(steps: int, interval: int, ramp: float) -> set[int]:
    """The steps after which the replicas are averaged: steps // interval syncs, the k-th after
    round(steps · C(k/n)) steps, C(x) = x + R(x² − x) the cumulative of a linearly growing interval (R = 0: every
    `interval` steps)."""
    n = steps // interval
    return {max(1, round(steps * (x + ramp * (x * x - x)))) for x in (k / n for k in range(1, n + 1))}


@torch.no_grad()
def average_params(models: list[nn.Module]) -> None:
    for ps in zip(*[m.parameters() for m in models]):
        mean = torch.stack(ps).mean(0)
        for p in ps:
            p.copy_(mean)


@torch.no_grad()
def average_state(models: list[nn.Module], opts: list[torch.optim.Optimizer], keys: tuple[str, ...]) -> None:
    """Average each named state tensor (not the step counters) of every parameter over the replicas."""
    for ps in zip(*[m.parameters() for m in models]):
        states = [o.state.get(p, {}) for o, p in zip(opts, ps)]
        for k in keys:
            if all(torch.is_tensor(st.get(k)) and st[k].ndim > 0 for st in states):
                mean = torch.stack([st[k] for st in states]).mean(0)
                for st in states:
                    st[k].copy_(mean)


def main(argv: list[str] | None = None) -> dict:
    from edit_train.cli.common import compose
    from edit_train.cluster.mesh import Topology
    from edit_train.config import cluster_specs, validate
    from edit_train.data.loader import TokenLoader
    from edit_train.local_sgd.schedule import lr_boundaries
    from edit_train.model.transformer import CausalLM
    from edit_train.train.evaluation import evaluate
    from edit_train.train.lr import LrSchedule
    from edit_train.train.optim import build_optimizer
    from edit_train.train.site_data import open_data, site_data

    a = parse_args(argv)
    torch.set_num_threads(2)
    cfg = compose(["cluster=local", f"cluster.count={a.clusters}", "cluster.ranks=1", "model=tiny",
                   f"train.steps={a.steps}", "train.batch_size=8", "train.seq_len=128", "train.eval_batches=8",
                   f"seed={a.seed}", f"train.lr={a.lr!r}", f"train.optimizer={a.optimizer}",
                   f"train.muon_momentum={a.momentum!r}", f"run.dir={a.run_dir}"])
    validate(cfg)
    t, specs, cpu = cfg.train, cluster_specs(cfg), torch.device("cpu")
    loaders, val_dirs = [], []
    for spec in specs:
        site = site_data(cfg, specs, spec)
        data_dir, val_dirs = open_data(cfg, site, t.batch_size, True, lambda: None)
        loaders.append(TokenLoader(data_dir, "train", t.batch_size, t.seq_len, part=site.part,
                                   num_parts=site.parts, seed=cfg.seed))
    torch.manual_seed(cfg.seed)
    base = CausalLM(cfg.model)
    models = [copy.deepcopy(base) for _ in range(1 if a.mode == "ddp" else a.clusters)]
    opts = [build_optimizer(m.named_parameters(), t, cpu) for m in models]
    schedule, clip = LrSchedule.of(t), (t.grad_clip if t.grad_clip > 0 else math.inf)
    topo = Topology(1, 0, "c0", 0, cpu, None)
    syncs = (set(lr_boundaries([schedule.at(i) for i in range(a.steps)], 0, a.interval, a.lr_power))
             if a.lr_power > 0 else sync_steps(a.steps, a.interval, a.ramp))
    print(f"{len(syncs)} syncs: {sorted(syncs)}", flush=True)
    curve, t0 = [], time.perf_counter()
    for step in range(a.steps):
        for o in opts:
            for g in o.param_groups:
                g["lr"] = schedule.at(step)
        if a.mode == "ddp":
            for loader in loaders:
                x, y = loader.next_batch()
                (models[0](x, y).loss / len(loaders)).backward()
            pairs = [(models[0], opts[0])]
        else:
            for m, loader in zip(models, loaders):
                x, y = loader.next_batch()
                m(x, y).loss.backward()
            pairs = list(zip(models, opts))
        for m, o in pairs:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            o.step()
            o.zero_grad(set_to_none=True)
        if a.mode != "ddp" and step + 1 in syncs:
            average_params(models)
            average_state(models, opts, STATE_KEYS[a.mode])
        if (step + 1) % 40 == 0 or step + 1 == a.steps:
            v = evaluate(models[0], val_dirs, t, topo, contextlib.nullcontext)
            curve.append((step + 1, v))
            print(f"step {step + 1}/{a.steps}: val loss {v:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = {"benchmark": "inner_state", "args": {k: str(v) for k, v in vars(a).items()}, "curve": curve,
           "final_val_loss": curve[-1][1]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
