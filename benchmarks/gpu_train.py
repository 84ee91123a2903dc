"""The product's own training loop on one GPU, beside the harness: tokens/s, MFU, peak memory vs the memory plan.

Rows (appended to `<out-dir>/gpu_step_<device>.json`, the file `gpu_step.py` writes; a row's `what` says which):

* `trainer`: `edit_train.train.trainer.Trainer` itself (`edit-train experiment-less: algo=ddp cluster=local`) on
  `--model` (default the Ling-Lite slice, bf16, grouped experts, compiled) at `train.grad_accum` 1 and 4: the
  trainer's own `train` event of the second window (steps `iters+1 .. 2*iters`, the first absorbs compilation)
  gives tokens/s and MFU; `peak_gib` is `torch.cuda.max_memory_allocated` from the start of that window,
  `plan_gib` what `edit-train-info` plans for the same launch (`edit_train/memplan.py`).
* `harness`: `gpu_step.py`'s step at the same shape (the bare forward/backward/AdamW without the loop), so the
  loop's own cost is `trainer step_s / harness step_s - 1`.
* `federation`: two `ling_1b` clusters on the one GPU (`cluster=local_2x1 algo=edit`, bf16, 4 x 2048, three
  syncs), launched as `edit-train` launches them; each cluster's `peak_memory_gib` and `memory_plan_gib` from
  `summary.json`. `algo.outer.offload=true` when the plan (half the GPU each) says it is needed.

    python benchmarks/gpu_train.py                      # every row -> docs/gpu_step_<device>.json
    python benchmarks/gpu_train.py --rows trainer harness --iters 10
    python benchmarks/gpu_train.py --smoke              # without a GPU: the same rows at toy size on the CPU
    python benchmarks/gpu_train.py --model ling_mini_2_slice --rows trainer harness   # Ling 2.0's rows

A row that fails (out of memory, a crash, a timeout) is written with its `status` and the run goes on. Without a
CUDA device and without --smoke it refuses with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import gpu_step  # noqa: E402
from _gpu import Variant, default_shape, device_and_output, device_slug, smoke_model  # noqa: E402
from edit_train.memplan import GIB, plan_for_config  # noqa: E402
from edit_train.train.mfu import device_peak_flops  # noqa: E402

ROWS = ("trainer", "harness", "federation")


def _overrides(args: argparse.Namespace, device: torch.device, run_dir: Path, grad_accum: int) -> list[str]:
    out = [f"model={args.model}", "algo=ddp", "cluster=local", f"train.device={device.type}",
           "train.precision=bf16", f"train.batch_size={args.batch}", f"train.seq_len={args.seq}",
           f"train.grad_accum={grad_accum}", f"train.compile={str(args.compile).lower()}",
           f"model.expert_impl={args.experts}", f"train.steps={2 * args.iters}", f"train.log_every={args.iters}",
           "train.eval_every=0", "train.eval_batches=1", "logger=none", "train.progress=false",
           "checkpoint.at_end=false", f"run.dir={run_dir}", "train.threads=0" if device.type == "cuda" else
           "train.threads=1"]
    if args.layers is not None:
        out.append(f"model.num_hidden_layers={args.layers}")
    if args.data_source:
        out.append(f"data.source={args.data_source}")
    return out


def trainer_row(args: argparse.Namespace, device: torch.device, grad_accum: int) -> dict[str, Any]:
    """`Trainer.run()` for 2 x iters steps; the second window's `train` event is the row."""
    from edit_train.cli.common import compose
    from edit_train.train.trainer import Trainer

    row: dict[str, Any] = {"what": "trainer", "model": args.model, "compile": args.compile, "checkpointing": "none",
                           "experts": args.experts, "batch": args.batch, "seq": args.seq, "grad_accum": grad_accum,
                           "layers": args.layers, "loss_chunk": None}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(_overrides(args, device, Path(tmp), grad_accum))
        row["plan_gib"] = plan_for_config(cfg)["total_gib"]
        row["layers"] = cfg.model.num_hidden_layers
        try:
            trainer = Trainer(cfg)
            inner = trainer.train_step
            marks: dict[str, float] = {}

            def step(s: int) -> Any:
                if s == args.iters:  # the measured window begins
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                        torch.cuda.reset_peak_memory_stats(device)
                    marks["t0"] = time.perf_counter()
                return inner(s)

            trainer.train_step = step  # type: ignore[method-assign]
            trainer.run()
            events = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
            last = [e for e in events if e.get("event") == "train"][-1]
            tokens = args.batch * args.seq * grad_accum
            row.update(status="ok", tokens_per_s=last["tokens_per_s"], mfu=last.get("mfu"),
                       step_s=tokens / last["tokens_per_s"], time_s=last.get("time_s"),
                       peak_gib=torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None)
            if row["peak_gib"]:
                row["peak_over_plan"] = row["peak_gib"] / row["plan_gib"]
        except torch.OutOfMemoryError:
            row.update(status="oom", tokens_per_s=None, mfu=None, peak_gib=None)
        except Exception as exc:  # noqa: BLE001 - one failing row must not cost the others
            row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
                       tokens_per_s=None, mfu=None, peak_gib=None)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return row


def federation_row(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Two clusters on this one device through `edit-train`'s local launcher: three syncs, each cluster's peak."""
    from edit_train.cli.common import compose

    model, batch, seq, interval = (("tiny", 2, 32, 2) if args.smoke else ("ling_1b", 4, 2048, 4))
    base = [f"model={model}", "cluster=local_2x1", "algo=edit", f"train.device={device.type}",
            "train.precision=bf16", f"train.batch_size={batch}", f"train.seq_len={seq}", f"algo.interval={interval}",
            f"train.steps={3 * interval}", "train.eval_every=0", "train.eval_batches=1", "logger=none",
            "train.progress=false", "checkpoint.at_end=false", "model.expert_impl=grouped" if not args.smoke else
            "model.expert_impl=auto"]
    if args.data_source:
        base.append(f"data.source={args.data_source}")
    half = (torch.cuda.get_device_properties(device).total_memory / GIB / 2) if device.type == "cuda" else None
    offload = half is not None and not plan_for_config(compose(base + ["run.dir=/tmp/x"]), half)["fits"]
    row: dict[str, Any] = {"what": "federation", "model": model, "clusters": 2, "batch": batch, "seq": seq,
                           "compile": False, "checkpointing": "none", "experts": "grouped", "layers": None,
                           "loss_chunk": None, "grad_accum": 1, "offload": offload, "interval": interval}
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*base, f"algo.outer.offload={str(offload).lower()}", f"run.dir={tmp}"]
        row["command"] = "edit-train " + " ".join(o for o in overrides if not o.startswith("run.dir"))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
        try:
            proc = subprocess.run([sys.executable, "-m", "edit_train.cli.train", *overrides], capture_output=True,
                                  text=True, timeout=args.federation_timeout, env=env)
        except subprocess.TimeoutExpired:
            row.update(status="timeout")
            return row
        summary_path = Path(tmp) / "summary.json"
        if proc.returncode != 0 or not summary_path.exists():
            tail = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or ["(no output)"]
            row.update(status="error", error=tail[0][:300])
            return row
        summary = json.loads(summary_path.read_text())
        clusters = {name: {"syncs": r.get("syncs"), "peak_gib": r.get("peak_memory_gib"),
                           "plan_gib": r.get("memory_plan_gib"), "tokens_per_s": r.get("tokens_per_s")}
                    for name, r in summary["per_cluster"].items()}
        for c in clusters.values():
            c["peak_over_plan"] = c["peak_gib"] / c["plan_gib"] if c["peak_gib"] and c["plan_gib"] else None
        row.update(status="ok", completed=summary.get("completed"), clusters=clusters,
                   plan_gib=max(c["plan_gib"] or 0 for c in clusters.values()),
                   peak_gib=max((c["peak_gib"] or 0 for c in clusters.values()), default=None) or None)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__)
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--model", default="ling_lite_slice")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", choices=["grouped", "sorted", "auto"], default="grouped")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (default: compiled on a GPU)")
    ap.add_argument("--iters", type=int, default=8, help="measured steps (after as many warm-up steps)")
    ap.add_argument("--grad-accum", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--data-source", default=None, help="data.source (default: the config's: the stdlib)")
    ap.add_argument("--federation-timeout", type=float, default=150.0)
    ap.add_argument("--peak-flops", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = C.parse(ap, argv)  # --smoke: toy sizes (on a CPU box: no GPU figures), into the smoke's folder
    if args.smoke and args.rows == list(ROWS):
        args.rows = [r for r in ROWS if r != "federation"]
        print("gpu_train --smoke: the federation row (two edit-train processes) runs only when named: --rows federation")
    picked = device_and_output(args, "gpu_train", "gpu_step", ".json")
    if picked is None:
        return 2
    device, name, out = picked
    if args.smoke:
        # tiny, or tiny_v2 for a Ling 2.0 model (the same rows through the same code at toy size)
        args.model, args.batch, args.seq, args.iters, args.experts = smoke_model(args.model), 2, 32, 2, "auto"
    args.batch, args.seq = default_shape(args.model, args.batch, args.seq) if args.batch is None or \
        args.seq is None else (args.batch, args.seq)
    args.compile = device.type == "cuda" and not args.eager
    peak = device_peak_flops(device, args.peak_flops)
    result: dict[str, Any] = {"device": name, "device_slug": device_slug(name), "torch": torch.__version__,
                              "peak_flops": peak, "iters": args.iters, "smoke": args.smoke,
                              "note": None if device.type == "cuda" else "CPU smoke: no GPU figures", "rows": []}
    for what in args.rows:
        rows: list[dict[str, Any]] = []
        if what == "trainer":
            rows = [trainer_row(args, device, ga) for ga in args.grad_accum]
        elif what == "harness":
            v = Variant(args.model, args.compile, "none", args.experts, args.batch, args.seq, args.layers)
            rows = [{"what": "harness", "grad_accum": 1, **gpu_step.run_variant(v, device, args.iters, 3, peak)}]
        else:
            rows = [federation_row(args, device)]
        for row in rows:
            row["device"] = name
            result["rows"].append(row)
            gpu_step._write(out, result, append=True)
            print(json.dumps({k: row.get(k) for k in ("what", "model", "grad_accum", "status", "tokens_per_s", "mfu",
                                                        "step_s", "peak_gib", "plan_gib", "error")}), flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
