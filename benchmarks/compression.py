"""Compressed pseudo-gradients over the slow link: fp32 vs bf16 vs int8 (with and without error feedback).

Every run: `algo=edit` on two one-rank clusters (`cluster=local_2x1`) over a simulated 100 Mbit/s, 50 ms link,
the same steps, seeds and data; plus one `algo=ddp` run for the bytes-per-token reference. Reported per
scheme (mean over seeds): final val loss and its ratio to the uncompressed run, cross-cluster bytes per
trained token, the ratio to ddp's bytes per token, and wall time (the link model charges what is sent).

Targets: int8 + error feedback sends ≤ 1/(4H) of ddp's bytes per token with val loss ≤ 1.005 × uncompressed;
without error feedback, how much worse it is.

    python benchmarks/compression.py --quick --out benchmarks/results/compression.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SCHEMES = {  # name -> overrides
    "none": ["sync.compression=none"],
    "bf16": ["sync.compression=bf16"],
    "int8": ["sync.compression=int8", "sync.error_feedback=true"],
    "int8_no_ef": ["sync.compression=int8", "sync.error_feedback=false"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="160 steps, H=8, 2 seeds")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", type=Path, default=C.RESULTS_DIR / "compression.json")
    ap.add_argument("--workdir", type=Path, default=C.RUNS_DIR / "compression")
    a = ap.parse_args()
    steps = a.steps or (160 if a.quick else 480)
    common = ["model=tiny", "cluster=local_2x1", "cluster.link.bandwidth_mbps=100", "cluster.link.latency_ms=50",
              f"train.steps={steps}", f"algo.interval={a.interval}", "train.batch_size=8", "train.seq_len=128",
              f"train.eval_every={steps}", "train.eval_batches=8", "train.log_every=20"]
    t0 = time.perf_counter()
    ddp = C.run_job("ddp", a.workdir / "ddp", [*common, "algo=ddp", "seed=0", f"train.steps={max(steps // 4, 8)}"],
                    reuse=True)
    ddp_bpt = ddp.summary["cross_group_bytes"] / ddp.summary["tokens"]
    rows, per = [], {}
    for name, extra in SCHEMES.items():
        runs = [C.run_job(f"{name}-s{seed}", a.workdir / f"{name}_s{seed}",
                          [*common, "algo=edit", f"seed={seed}", *extra], reuse=True) for seed in a.seeds]
        loss = [r.summary["final_val_loss"] for r in runs]
        bpt = [r.summary["cross_group_bytes"] / r.summary["tokens"] for r in runs]
        per[name] = {"val_loss": loss, "bytes_per_token": bpt, "wall_s": [r.summary["wall_s"] for r in runs]}
    base = per["none"]
    for name, p in per.items():
        ratio = [lv / b for lv, b in zip(p["val_loss"], base["val_loss"])]
        p["loss_ratio"] = ratio
        rows.append({"scheme": name, "val_loss": sum(p["val_loss"]) / len(p["val_loss"]),
                     "loss_ratio": sum(ratio) / len(ratio), "worst_ratio": max(ratio),
                     "bytes_per_token": sum(p["bytes_per_token"]) / len(p["bytes_per_token"]),
                     "vs_ddp": sum(p["bytes_per_token"]) / len(p["bytes_per_token"]) / ddp_bpt,
                     "wall_s": sum(p["wall_s"]) / len(p["wall_s"])})
    print(C.table(rows, [("scheme", "scheme", ""), ("val_loss", "val loss", ".4f"), ("loss_ratio", "÷ none", ".4f"),
                         ("worst_ratio", "worst seed", ".4f"), ("bytes_per_token", "bytes/token", ".1f"),
                         ("vs_ddp", "÷ ddp bytes/token", ".4f"), ("wall_s", "wall s", ".1f")]))
    by = {r["scheme"]: r for r in rows}
    targets = {"ddp_bytes_per_token": ddp_bpt, "1/(4H)": 1 / (4 * a.interval),
               "int8+ef bytes/token ÷ ddp": by["int8"]["vs_ddp"],
               "int8+ef <= 1/(4H) of ddp": by["int8"]["vs_ddp"] <= 1 / (4 * a.interval),
               "int8+ef val loss ÷ none (worst seed)": by["int8"]["worst_ratio"],
               "int8+ef val loss <= 1.005 x none (every seed)": by["int8"]["worst_ratio"] <= 1.005,
               "int8 without ef val loss ÷ none (mean)": by["int8_no_ef"]["loss_ratio"]}
    out = C.write_json(a.out, {"benchmark": "compression", "quick": a.quick, "steps": steps, "interval": a.interval,
                               "seeds": a.seeds, "rows": rows, "per_seed": per, "targets": targets,
                               "wall_s": time.perf_counter() - t0, "env": C.environment()})
    C.print_targets(targets, out, out)


if __name__ == "__main__":
    main()
