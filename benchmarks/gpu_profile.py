"""Where a training step's time goes on one GPU: a torch.profiler table of the top ops by device (CUDA) time of
`model=ling_lite_slice` (compiled, grouped experts, bf16, no checkpointing — the MFU row of gpu_step.py), saved
to docs/gpu_profile_<device>.txt, headed by the time per category (dense GEMMs, grouped expert GEMMs, attention,
optimizer, compiled/elementwise kernels, data movement, other) and by the time inside the fused head loss (its
profiler range, forward with its gradients: edit_train/model/lm_loss.py).

The step is gpu_step.py's (benchmarks/_gpu.py). `--warmup` steps run first (they absorb compilation), then
`--steps` steps under the profiler.

    python benchmarks/gpu_profile.py [--model ling_lite_slice] [--eager] [--checkpointing none] [--steps 3]
                                     [--out-dir docs] [--out FILE] [--rows 40]
    python benchmarks/gpu_profile.py --quick    # without a GPU: a CPU smoke (tiny model, CPU time), not docs/

Without a CUDA device and without --quick it refuses with one line.
"""

from __future__ import annotations

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

import _common as C
from _gpu import (Variant, add_shape_args, build_step, default_shape, parse_and_pick,
                  sync)
from edit_train.model.lm_loss import PROFILE_RANGE

# (category, substrings of a kernel / op name, lower case), first match wins
CATEGORIES = [
    ("grouped expert GEMMs", ("grouped_mm", "grouped_gemm", "groupedgemm", "gemmgrouped", "ptrarray",
                              "groupproblem")),
    ("attention", ("flash", "attention", "fmha", "sdpa", "cudnn")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("dense GEMMs", ("gemm", "mm", "matmul", "cutlass", "sm90_xmma", "nvjet", "cublas", "linear")),
    ("data movement", ("copy", "index", "gather", "scatter", "cat", "sort", "memcpy", "memset", "fill")),
    ("compiled / elementwise", ("triton", "elementwise", "reduce", "vectorized", "softmax", "exp", "mul", "add")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def categorise(events, attr: str, kernels_only: bool) -> list[tuple[str, float]]:  # type: ignore[no-untyped-def]
    """Self time (us) per category, largest first. On a GPU only the kernels count (an aten op's self device time
    is its kernels' again)."""
    totals: dict[str, float] = {}
    for e in events:
        if kernels_only and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = float(getattr(e, attr, 0.0) or 0.0)
        if t > 0:
            c = category(e.key)
            totals[c] = totals.get(c, 0.0) + t
    return sorted(totals.items(), key=lambda kv: -kv[1])


def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__)
    ap.add_argument("--model", default="ling_lite_slice")
    ap.add_argument("--eager", action="store_true", help="profile the eager step (default: compiled)")
    ap.add_argument("--checkpointing", default="none", choices=["none", "full", "moe"])
    ap.add_argument("--experts", default="grouped", choices=["grouped", "sorted"])
    add_shape_args(ap)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=40)
    picked = parse_and_pick(ap, argv, "gpu_profile", ".txt")
    if picked is None:
        return 2
    args, device, name, out = picked
    on_gpu = device.type == "cuda"
    if not on_gpu:  # the CPU smoke: the tiny model, one eager step
        args.model, args.eager, args.batch, args.seq, args.warmup, args.steps = "tiny", True, 1, 32, 1, 1
    batch, seq = default_shape(args.model, args.batch, args.seq)
    v = Variant(args.model, not args.eager, args.checkpointing, args.experts, batch, seq, args.layers, args.loss_chunk)
    step = build_step(v, device)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step.run()
    sync(device)
    warmup_s = time.perf_counter() - t0
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step.run()
        sync(device)
    wall = (time.perf_counter() - t0) / args.steps
    attr = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = prof.key_averages()
    cats = categorise(events, attr, kernels_only=on_gpu)
    total = sum(t for _, t in cats) or 1.0
    lines = [f"# {args.model}: {v.batch} x {v.seq} tokens, {step.cfg.num_hidden_layers} layers, "
             f"{'compiled' if v.compile else 'eager'}, checkpointing {v.checkpointing}, {v.experts} experts, bf16, "
             f"loss_chunk {step.cfg.loss_chunk}",
             f"# device {name}, torch {torch.__version__}; {args.steps} profiled steps after {args.warmup} warm-up "
             f"({warmup_s:.1f} s); {wall * 1e3:.1f} ms per step under the profiler"
             + (f"; peak {torch.cuda.max_memory_allocated(device) / 2 ** 30:.2f} GiB" if on_gpu else "")
             + (f"; cpu_count {os.cpu_count()}, loadavg {os.getloadavg()}" if not on_gpu else ""),
             f"# self {'device' if on_gpu else 'CPU'} time per category (benchmarks/gpu_profile.py CATEGORIES):"]
    lines += [f"#   {c:<24} {t / 1e3 / args.steps:9.2f} ms/step {t / total:7.1%}" for c, t in cats]
    span = "device_time_total" if on_gpu else "cpu_time_total"
    inside = [float(getattr(e, span)) for e in events if e.key == PROFILE_RANGE]
    if inside:
        t = max(inside)
        lines.append(f"# inside the {PROFILE_RANGE} range (the fused head loss, forward + its gradients): "
                     f"{t / 1e3 / args.steps:.2f} ms/step, {t / total:.1%} of the total above")
    lines += ["", events.table(sort_by=attr, row_limit=args.rows, max_name_column_width=70)]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    print("\n".join(line for line in lines if line.startswith("#")))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
