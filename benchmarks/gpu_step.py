"""One GPU, one training step: tokens/s, MFU and peak memory of `model=small` and `model=ling_1b` for
eager vs `torch.compile` (per decoder layer), activation checkpointing none vs full, and grouped vs sorted
experts — the options `train.compile`, `train.activation_checkpointing` and `model.expert_impl` set.

Each variant builds the model on the device, applies the options exactly as the trainer does
(`edit_train.train.parallel.apply_layer_options`), and times forward + backward + AdamW step under bf16
autocast (the unsharded `train.precision=bf16` path) on random tokens, after warm-up steps (which also absorb
compilation). Peak memory is `torch.cuda.max_memory_allocated` over the timed steps; `plan_gib` is what
`edit-train-info` plans for the same launch (edit_train/memplan.py), to check the plan against the device.
MFU = tokens/s x FLOPs/token (edit_train/train/mfu.py) / the device's peak bf16 FLOP/s (table or --peak-flops).

    python benchmarks/gpu_step.py [--models small ling_1b] [--batch 4] [--seq 2048] [--iters 10] [--out FILE]
    python benchmarks/gpu_step.py --quick     # on a machine without a GPU: a CPU smoke run, CPU-only figures

Without a CUDA device and without --quick it refuses with one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from edit_train.memplan import GIB, memory_plan
from edit_train.model import CausalLM, count_params
from edit_train.model.presets import load_preset
from edit_train.train.mfu import device_peak_flops, flops_per_token, mfu
from edit_train.train.parallel import apply_layer_options

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_step.json"
HEADER = "| model | device | compile | checkpointing | experts | tokens/s | MFU | peak GiB | plan GiB |"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(model_name: str, device: torch.device, batch: int, seq: int, iters: int, warmup: int,
                compile: bool, checkpointing: str, experts: str, peak: float | None) -> dict[str, Any]:
    cfg = dataclasses.replace(load_preset(model_name), expert_impl=experts)
    row: dict[str, Any] = {"model": model_name, "compile": compile, "checkpointing": checkpointing,
                           "experts": experts, "batch": batch, "seq": seq}
    plan = memory_plan(cfg, shard_size=1, batch_size=batch, seq_len=seq, precision="bf16",
                       checkpointing=checkpointing)
    row["plan_gib"] = plan["total_gib"]
    torch._dynamo.reset()
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        model = CausalLM(cfg).to(device)
        apply_layer_options(model, checkpointing, compile)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)
        x, y = ids[:, :-1], ids[:, 1:]

        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(x, y)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(device)
        seconds = (time.perf_counter() - t0) / iters
    except torch.cuda.OutOfMemoryError:
        row.update(status="oom", tokens_per_s=None, mfu=None, peak_gib=None)
        return row
    tps = batch * seq / seconds
    fpt = flops_per_token(cfg, seq, count_params(cfg)["active_params"])
    impls = {b.experts.last_impl for b in model.moe_blocks()}
    row.update(status="ok", step_s=seconds, tokens_per_s=tps, flops_per_token=fpt, mfu=mfu(tps, fpt, peak, 1),
               peak_gib=(torch.cuda.max_memory_allocated(device) / GIB) if device.type == "cuda" else None,
               experts_ran=sorted(i for i in impls if i))
    del model, opt
    return row


def _fmt(v: Any, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["small", "ling_1b"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-flops", type=float, default=0.0, help="per-device peak FLOP/s (default: table)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    ap.add_argument("--quick", action="store_true", help="small shapes; on a machine without a GPU, a CPU smoke")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.quick:
        print("gpu_step: no CUDA device here; run it on a GPU machine (or --quick for a CPU-only smoke run)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    compiles = [False] if args.no_compile else [False, True]
    models = args.models
    if args.quick:
        args.batch, args.seq, args.iters, args.warmup = 1, 64, 2, 1
        if not on_gpu:
            torch.set_num_threads(1)
            models, compiles = ["small"], [False]  # compiling on 2 CPU cores takes minutes and measures nothing
    peak = device_peak_flops(device, args.peak_flops)
    name = torch.cuda.get_device_name(device) if on_gpu else f"CPU ({platform.processor() or platform.machine()})"
    rows = []
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|---|")
    for model_name, comp, ckpt, experts in itertools.product(models, compiles, ("none", "full"),
                                                             ("grouped", "sorted")):
        row = run_variant(model_name, device, args.batch, args.seq, args.iters, args.warmup, comp, ckpt,
                          experts, peak)
        row["device"] = name
        rows.append(row)
        print(f"| {model_name} | {name} | {'compile' if comp else 'eager'} | {ckpt} | {experts} | "
              f"{_fmt(row['tokens_per_s'], ',.0f')} | {_fmt(row['mfu'], '.1%')} | {_fmt(row['peak_gib'], '.2f')} | "
              f"{row['plan_gib']:.2f} |", flush=True)
    note = None if on_gpu else "CPU-only figures (no GPU on this machine): not GPU throughput, no MFU, no peak memory"
    if note:
        print(note)
    result = {"device": name, "torch": torch.__version__, "peak_flops": peak, "batch": args.batch, "seq": args.seq,
              "iters": args.iters, "quick": args.quick, "note": note, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
