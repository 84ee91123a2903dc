"""Ling 2.0 on CPU: training tokens/s of `small_v2` (BailingMoeV2: 64 experts of width 128, top-8 of the 4 best of
8 groups, sigmoid + expert bias, QK-norm, half RoPE, one MTP layer) against `small` (Ling 1: 16 experts of width 256,
top-4, softmax) at about equal active parameters (the main models' within 6 %), and where the difference goes.

One training step = forward + backward + AdamW + the expert-bias update, the model's own code (sorted expert
dispatch on CPU), one torch thread, fixed random batches. Rows, interleaved (rotating order) so that all see the same
machine load; medians and minima of the step time:

* ``small``            — Ling 1 as trained today;
* ``small_v2``         — the full Ling 2.0 preset;
* ``small_v2/no_mtp``  — the same without the MTP layer (what the MTP layer costs: one more MoE layer and head pass);
* ``small_v2/plain``   — no MTP, softmax top-8 without groups, bias, QK-norm or half RoPE: 64 experts of width 128
  routed as Ling 1 routes (what finer experts cost by themselves);

The target: small_v2 / small tokens/s >= 0.7 (issue 67).

    python benchmarks/ling2_speed.py [--quick] [--batch 4 --seq 256] [--iters 6] [--out results/ling2_speed.json]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, load, parse, parser, print_targets, pyplot, save_fig, write_json  # noqa: E402
from edit_train.model import CausalLM, count_params, load_preset  # noqa: E402
from edit_train.model.config import ModelConfig  # noqa: E402



def configs(v1: str = "small", v2_preset: str = "small_v2") -> dict[str, ModelConfig]:
    """The rows (named for small / small_v2; --smoke builds them from tiny / tiny_v2)."""
    v2 = load_preset(v2_preset)
    no_mtp = dataclasses.replace(v2, num_nextn_predict_layers=0)
    plain = dataclasses.replace(no_mtp, score_function="softmax", moe_router_enable_expert_bias=False, n_group=0,
                                topk_group=0, routed_scaling_factor=1.0, use_qk_norm=False, partial_rotary_factor=1.0,
                                router_aux_loss_coef=0.01, norm_head=True)
    return {"small": load_preset(v1), "small_v2": v2, "small_v2/no_mtp": no_mtp, "small_v2/plain": plain}


class Row:
    def __init__(self, name: str, cfg: ModelConfig, batch: int, seq: int) -> None:
        torch.manual_seed(0)
        self.name, self.cfg = name, cfg
        self.model = CausalLM(cfg).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        self.y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        self.times: list[float] = []
        counts = count_params(cfg)
        self.main_active = counts["active_params"] - counts["mtp_active_params"]
        self.active = counts["active_params"]

    def step(self) -> float:
        t0 = time.perf_counter()
        out = self.model(self.x, self.y)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.update_expert_bias()
        return time.perf_counter() - t0


def main() -> None:
    ap = parser(__doc__, out="ling2_speed.json")
    ap.add_argument("--quick", action="store_true", help="2 timed steps per row, a short sequence")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args = parse(ap)
    if args.quick:
        args.iters, args.seq, args.warmup = 2, 64, 1
    if args.smoke:
        args.iters, args.batch, args.seq, args.warmup = 1, 1, 16, 0
    torch.set_num_threads(1)
    presets = ("tiny", "tiny_v2") if args.smoke else ("small", "small_v2")
    rows = [Row(name, cfg, args.batch, args.seq) for name, cfg in configs(*presets).items()]
    for row in rows:
        for _ in range(args.warmup):
            row.step()
    for i in range(args.iters):
        for row in rows[i % len(rows):] + rows[:i % len(rows)]:  # rotate the order: equal machine load
            row.times.append(row.step())
    tokens = args.batch * args.seq
    results = {}
    for row in rows:
        med = statistics.median(row.times)
        results[row.name] = {"median_step_s": med, "min_step_s": min(row.times), "tokens_per_s": tokens / med,
                             "active_params": row.active, "active_params_without_mtp": row.main_active,
                             "steps": row.times}
        print(f"{row.name:18s} {tokens / med:9.0f} tokens/s  median {med:.3f} s  min {min(row.times):.3f} s  "
              f"active {row.main_active / 1e6:.2f}M (+MTP {row.active / 1e6:.2f}M)")
    base = results["small"]["tokens_per_s"]
    ratio = results["small_v2"]["tokens_per_s"] / base
    step = {k: v["median_step_s"] for k, v in results.items()}
    where = {"mtp_layer_s": step["small_v2"] - step["small_v2/no_mtp"],
             "router_qk_norm_half_rope_s": step["small_v2/no_mtp"] - step["small_v2/plain"],
             "finer_experts_s": step["small_v2/plain"] - step["small"]}
    targets = {"small_v2_over_small_tokens_per_s": {"value": ratio, "bound": ">= 0.7", "pass": ratio >= 0.7}}
    doc = {"benchmark": "ling2_speed", "quick": args.quick,
           "command": "python benchmarks/ling2_speed.py" + (" --quick" if args.quick else ""),
           "setup": {"batch": args.batch, "seq": args.seq, "iters": args.iters, "warmup": args.warmup, "threads": 1,
                     "step": "forward + backward + AdamW + expert-bias update"},
           "small_tokens_per_s": base, "small_v2_tokens_per_s": results["small_v2"]["tokens_per_s"],
           "ratio_without_mtp": results["small_v2/no_mtp"]["tokens_per_s"] / base,
           "where_the_time_goes": where, "rows": results, "targets": targets, "load": load(), "env": environment()}
    out = write_json(args.out, doc)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    names = list(results)
    ax.barh(names, [results[n]["tokens_per_s"] for n in names], color=["#888", "#1f77b4", "#6baed6", "#c6dbef"])
    for i, n in enumerate(names):
        ax.text(results[n]["tokens_per_s"], i, f" {results[n]['tokens_per_s'] / base:.2f}x", va="center")
    ax.invert_yaxis()
    ax.set_xlabel(f"training tokens/s on CPU (1 thread, batch {args.batch} x {args.seq})")
    ax.set_title("small_v2 (Ling 2.0) vs small (Ling 1), about equal active parameters", fontsize=10)
    plot = save_fig(fig, out.with_suffix(".png"))
    print_targets({"small_v2_over_small": ratio, **where}, out, plot)


if __name__ == "__main__":
    main()
