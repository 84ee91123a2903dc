"""One GPU, one training step: tokens/s, MFU and peak memory of `model=ling_lite_slice` (Ling-Lite's layer
widths — hidden 2048, 64 experts of 1408 top-6 + 2 shared, 126k vocabulary — with as many layers as one GPU holds),
`ling_1b` and `small` (and, asked by `--models`, `ling_mini_2_slice`: Ling-mini-2.0's layers, 256 experts of 512
top-8 in groups, sigmoid routing with an expert bias, QK-norm, half RoPE, an MTP layer), for eager vs
`torch.compile`, activation checkpointing none vs full, and grouped vs sorted experts — the options `train.compile`,
`train.activation_checkpointing` and `model.expert_impl` set.

Each variant builds the model on the device and runs the trainer's step (benchmarks/_gpu.py: its layer options,
its fused AdamW, bf16 autocast, the presets' fused head loss `model.loss_chunk`) on random tokens: warm-up steps
first (they absorb compilation: `warmup_s`), then `--iters` timed steps. Peak memory is
`torch.cuda.max_memory_allocated` over the timed steps; `plan_gib` is what `edit-train-info` plans for the same
launch (edit_train/memplan.py) and `peak_over_plan` their ratio; `graph_breaks` counts torch.compile's graph
breaks (a compiled row should have none) and `compiled_graphs` the graphs it built (the layers share one; the
head loss's kernel is another: more means recompiles). MFU = tokens/s x FLOPs/token
(edit_train/train/mfu.py) / the device's peak bf16 FLOP/s (table or --peak-flops). Rows are written to the JSON as
they finish (a run cut short keeps what it measured); an out-of-memory or failing variant is a row with its
`status` and the run goes on.

    python benchmarks/gpu_step.py                     # every row -> docs/gpu_step_<device>.json (e.g. _h100)
    python benchmarks/gpu_step.py --models ling_lite_slice --modes compiled --checkpointing none --experts grouped
    python benchmarks/gpu_step.py ... --out-dir DIR --append   # add rows to DIR/gpu_step_<device>.json
    python benchmarks/gpu_step.py --quick             # without a GPU: a CPU smoke run (tiny shapes, no MFU)

Without a CUDA device and without --quick it refuses with one line.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

import _common as C
from _gpu import (SLICES, Variant, add_shape_args, build_step, default_shape, parse_and_pick,
                  device_slug, smoke_model, sync)
from edit_train.memplan import GIB, memory_plan
from edit_train.model import count_params
from edit_train.train.mfu import device_peak_flops, flops_per_token, mfu

HEADER = ("| model | layers | batch x seq | compile | checkpointing | experts | tokens/s | MFU | peak GiB | plan GiB |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
KEY = ("model", "compile", "checkpointing", "experts", "batch", "seq", "layers", "loss_chunk", "what", "grad_accum")


def run_variant(v: Variant, device: torch.device, iters: int, warmup: int, peak: float | None) -> dict[str, Any]:
    cfg = v.config()
    counts = count_params(cfg)
    row: dict[str, Any] = {"model": v.model, "compile": v.compile, "checkpointing": v.checkpointing,
                           "experts": v.experts, "batch": v.batch, "seq": v.seq, "layers": cfg.num_hidden_layers,
                           "loss_chunk": cfg.loss_chunk, **counts}
    plan = memory_plan(cfg, shard_size=1, batch_size=v.batch, seq_len=v.seq, precision="bf16",
                       checkpointing=v.checkpointing)
    row["plan_gib"] = plan["total_gib"]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step = None
    try:
        step = build_step(v, device)
        t0 = time.perf_counter()
        for _ in range(warmup):
            step.run()
        sync(device)
        row["warmup_s"] = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            step.run()
        sync(device)
        seconds = (time.perf_counter() - t0) / iters
        tps = v.batch * v.seq / seconds
        fpt = flops_per_token(cfg, v.seq, counts["active_params"])
        peak_gib = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
        impls = {b.experts.last_impl for b in step.model.moe_blocks()}
        breaks = torch._dynamo.utils.counters["graph_break"]  # a compiled row that fell back to eager shows here
        row.update(status="ok", step_s=seconds, tokens_per_s=tps, flops_per_token=fpt, mfu=mfu(tps, fpt, peak, 1),
                   peak_gib=peak_gib, peak_over_plan=peak_gib / plan["total_gib"] if peak_gib else None,
                   experts_ran=sorted(i for i in impls if i), graph_breaks=sum(breaks.values()),
                   compiled_graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],  # > 2-3: recompiles
                   graph_break_reasons=[k.splitlines()[0][:200] for k in list(breaks)[:3]])
    except torch.cuda.OutOfMemoryError:
        row.update(status="oom", tokens_per_s=None, mfu=None, peak_gib=None)
    except Exception as exc:  # noqa: BLE001 - one failing variant must not cost the other rows
        row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
                   tokens_per_s=None, mfu=None, peak_gib=None)
    finally:
        del step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _fmt(v: Any, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table_line(r: dict[str, Any]) -> str:
    speed = _fmt(r.get("tokens_per_s"), ",.0f") if r["status"] == "ok" else r["status"]
    return (f"| {r['model']} | {r['layers']} | {r['batch']} x {r['seq']} | {'compile' if r['compile'] else 'eager'} | "
            f"{r['checkpointing']} | {r['experts']} | {speed} | {_fmt(r.get('mfu'), '.1%')} | "
            f"{_fmt(r.get('peak_gib'), '.2f')} | {r['plan_gib']:.2f} |")


def _variants(args: argparse.Namespace) -> list[Variant]:
    out = []
    modes = [m == "compiled" for m in args.modes]
    for model, comp, ckpt, experts in itertools.product(args.models, modes, args.checkpointing, args.experts):
        if model in SLICES and experts == "sorted" and not args.sorted_slice:
            continue  # a per-expert loop over 64 or 256 experts at these widths measures nothing worth its minutes
        batch, seq = default_shape(model, args.batch, args.seq)
        layers = args.layers if model in SLICES else None
        out.append(Variant(model, comp, ckpt, experts, batch, seq, layers, args.loss_chunk))
    return out


def _write(path: Path, result: dict[str, Any], append: bool) -> None:
    rows = result["rows"]
    if append and path.is_file():
        old = json.loads(path.read_text())
        keep = [r for r in old.get("rows", []) if tuple(r.get(k) for k in KEY) not in
                {tuple(n.get(k) for k in KEY) for n in rows}]
        result = {**result, "rows": keep + rows}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__)
    ap.add_argument("--models", nargs="+", default=["ling_lite_slice", "ling_1b", "small"])
    ap.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    ap.add_argument("--no-compile", action="store_true", help="eager only (same as --modes eager)")
    ap.add_argument("--checkpointing", nargs="+", choices=["none", "full", "moe"], default=["none", "full"])
    ap.add_argument("--experts", nargs="+", choices=["grouped", "sorted"], default=["grouped", "sorted"])
    ap.add_argument("--sorted-slice", action="store_true", help="also sorted experts for the slices")
    add_shape_args(ap)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--peak-flops", type=float, default=0.0, help="per-device peak FLOP/s (default: table)")
    ap.add_argument("--append", action="store_true", help="keep the file's other rows (same variant: replaced)")
    picked = parse_and_pick(ap, argv, "gpu_step", ".json")
    if picked is None:
        return 2
    args, device, name, out = picked
    on_gpu = device.type == "cuda"
    if args.no_compile:
        args.modes = ["eager"]
    if args.quick:
        args.batch, args.seq, args.iters, args.warmup = 1, 64, 2, 1
        if not on_gpu:
            # compiling on 2 CPU cores takes minutes and measures nothing; the 126k-vocabulary models do not fit:
            # tiny, or tiny_v2 for a Ling 2.0 model
            args.models, args.modes = list(dict.fromkeys(smoke_model(m) for m in args.models)), ["eager"]
    if args.smoke:  # one experts layout
        args.experts = args.experts[:1]
    peak = device_peak_flops(device, args.peak_flops)
    note = None if on_gpu else "CPU-only figures (no GPU on this machine): not GPU throughput, no MFU, no peak memory"
    result: dict[str, Any] = {"device": name, "device_slug": device_slug(name), "torch": torch.__version__,
                              "peak_flops": peak, "iters": args.iters, "warmup": args.warmup, "quick": args.quick,
                              "note": note, "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(), "rows": []}
    print(HEADER)
    for v in _variants(args):
        row = run_variant(v, device, args.iters, args.warmup, peak)
        row["device"] = name
        result["rows"].append(row)
        _write(out, result, args.append)
        print(table_line(row) + (f"  {row['error']}" if row.get("error") else ""), flush=True)
    if note:
        print(note)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
