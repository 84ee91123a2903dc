"""Convergence vs communication: ddp, post-local SGD, DiLoCo and EDiT on the tiny MoE at one token budget.

Every algorithm trains `model=tiny` on `cluster=local_2x1` (2 clusters of 1 rank, gloo on this host)
from the same seed, for the same number of steps and the same per-rank batch, so all see the same tokens.
Per algorithm it reports the final validation loss, its ratio to ddp's, the cross-cluster bytes (all groups,
from `summary.json`), bytes per training token and the bytes ratio to ddp. ddp all-reduces gradients every
step (~model size per step per group); local SGD moves ~model size every H steps, so the target for EDiT is
bytes <= 1/H of ddp's. EDiT's only extra traffic is the per-sync all-gather of per-module norms
(~72 bytes on the tiny model), so "<= 1/H" is checked with a 1e-3 relative tolerance and the exact
H x ratio is printed. Quality targets (reported, not asserted): EDiT loss <= 1.02 x ddp's and below both
DiLoCo's and post-local SGD's.

Hyper-parameters. ddp keeps every default. The local-SGD algorithms share `algo.interval=H` and
`algo.warmup_steps=0` (a synchronous warm-up all-reduces gradients every step and breaks the 1/H budget);
diloco and post_local_sgd keep their conf/algo defaults. EDiT gets (`ALGO_OVERRIDES`, saved in the JSON):
  * `algo.outer.lr=0.7 algo.outer.momentum=0 algo.outer.nesterov=false`: with the default inner lr (3e-3)
    and only tens of syncs, outer momentum only hurts (quick mode, val loss: 0.7/0.8 Nesterov 2.30,
    1.0/0.5 2.36, 0.7/0.5 2.16, 0.7/0.3 2.12, 1.0/0 2.13, 0.7/0 2.12, 0.5/0 2.15; inner lr 1e-3/2e-3
    with 0.7/0.8: 2.24/2.25; inner 4e-3/5e-3 with 0.7/0: 2.15/2.14); at the default preset (320 steps,
    seed 0): 0.7/0 1.939, 1.0/0 1.941, 1.3/0 2.003;
  * the anomaly detector keeps its defaults (alpha 0.02, 10 warm-up syncs, docs/sync_math.md); it flags
    nothing in these clean runs (the `flags` column).
Penalty weighting (softmax, T=1) and clipping (phi=10) stay on.
`--set KEY=VALUE` adds an override to every job (e.g. `--set train.lr=2e-3`), `--algo-set ALGO:KEY=VALUE`
to one algorithm's jobs.

Seeds. The default preset runs every algorithm with seeds 0, 1, 2 (model init, data order) and reports
mean, std and min..max per algorithm; the ranking targets must hold on every seed. On the 2 shared CPU
cores of the dev box the default preset (4 algorithms x 3 seeds x 320 steps) took 21 min (sum of the
job walls; ~25-35 min when the box is busier).

    python benchmarks/convergence.py --quick          # 4 x 200 steps, H=8, batch 8, seed 0: ~4-8 min
    python benchmarks/convergence.py                  # 4 x 3 seeds x 320 steps, H=8, batch 8 (~25-35 min)
    python benchmarks/convergence.py --steps 400 --interval 16 --seeds 0 1 --out r.json --plot r.png

Tuned mode (`--tune`, `--confirm`, or both): every algorithm gets the same tuning budget, then is confirmed
on 3 seeds at its best. Every run: `cluster=local cluster.count=G cluster.ranks=1`, model=tiny,
1000 steps, batch 8, seq_len 128, eval every 100 steps on 8 batches; the local-SGD algorithms share
`algo.interval=H` (8) and `algo.warmup_steps=0`. ALGO_OVERRIDES is not used here.
  1. --tune, seed 0, 2 clusters: ddp and post_local_sgd: inner lr (`train.lr`) in {2e-3, 3e-3, 5e-3}
     (post_local_sgd's outer step is plain averaging by definition, outer lr 1 / momentum 0: pinned, not
     tuned); diloco and edit: outer lr in {0.5, 0.7, 1.0} x outer momentum in {0, 0.5, 0.8} (Nesterov when
     momentum > 0) at inner lr 3e-3, then the inner lr grid at the best outer point, then the options
     stage (below). Best = lowest final val loss (summary.json) over all stages. 28 + 12 runs.
  2. --confirm: seeds 0 1 2 at each algorithm's best, at 2 and 4 clusters (the seed-0, 2-cluster runs are
     the tuning runs themselves); per algorithm and cluster count: val loss mean/min/max, ratio to ddp, the
     targets (edit <= every tuned baseline on every seed, edit <= 1.02 x ddp) and, when edit misses one,
     why: the modules the anomaly test flagged (sync events of metrics.jsonl), the sweep, the edit/ddp gap
     along training and across cluster counts. Without --tune it reads the tuning from --tuned (or --out).
Run directories: <workdir>/tuned/<model>_<steps>steps_H<H>/g<G>/seed<S>/<algo>/<setting>; with --reuse a
finished run with identical overrides is not run again (an interrupted grid resumes).

    python benchmarks/convergence.py --tune --confirm --quick   # 2x2 outer grid, 1 inner lr, 120 steps, seed 0
    python benchmarks/convergence.py --tune --confirm --reuse   # 28 tuning + 12 options + 20 confirm runs (hours)
    python benchmarks/convergence.py --smoke                    # the whole tuned machinery in miniature (minutes)

Options stage (issue 51; on by default in tuned mode, `--no-options` for the grid before it): at each
algorithm's best point after the inner stage, `_tuning.option_grid` — every algorithm Muon inner steps
(`train.optimizer=muon`) at each of `--muon-lrs` (Muon's own lr grid, 1e-2 2e-2 4e-2: its best lr is not
AdamW's), diloco and edit also Pier's outer-momentum warm-up and Pier's outer-lr schedule (warm-up over ~10 %
of the syncs, cosine to 0.1 x).
The best of all stages is what --confirm runs on 3 seeds; docs/algorithms.md says what it must show before a
default changes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import _tuning as T  # noqa: E402

ALGOS = ("ddp", "post_local_sgd", "diloco", "edit")
TUNE_SEED, TUNE_GROUPS = T.TUNE_SEED, T.TUNE_GROUPS  # tuned mode: the grid runs on seed 0 at 2 clusters

# Per-algorithm overrides on top of conf/algo/<algo>.yaml (ddp: none, by design).
ALGO_OVERRIDES: dict[str, list[str]] = {
    "ddp": [],
    "post_local_sgd": [],
    "diloco": [],
    "edit": ["algo.outer.lr=0.7", "algo.outer.momentum=0.0", "algo.outer.nesterov=false",
             ],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = C.parser(__doc__, out="convergence.json", workdir="convergence", reuse=True, timeout=3600.0)
    ap.add_argument("--quick", action="store_true", help="reduced run: 200 steps, H=8, batch 8, one seed "
                    "(tuned mode: 2x2 outer grid, inner lr 3e-3 only, 120 steps, 2 clusters, seed 0)")
    ap.add_argument("--tune", action="store_true",
                    help="tuned mode, phase 1: the grid per algorithm (seed 0, 2 clusters)")
    ap.add_argument("--confirm", action="store_true", help="tuned mode, phase 2: --seeds at each algorithm's best, "
                    "at --clusters cluster counts (after --tune, or from the tuning in --tuned)")
    ap.add_argument("--tuned", type=Path, default=None,
                    help="JSON with the tuning (for --confirm alone; default --out)")
    ap.add_argument("--clusters", type=int, nargs="+", default=None, help="tuned mode: cluster counts to confirm at "
                    "(default 2 4; --quick: 2)")
    ap.add_argument("--model", default="tiny", help="tuned mode: model preset (conf/model)")
    ap.add_argument("--inner-lrs", type=float, nargs="+", default=None, help="tuned mode: train.lr grid "
                    "(default 2e-3 3e-3 5e-3; --quick: 3e-3)")
    ap.add_argument("--muon-lrs", type=float, nargs="+", default=None, help="tuned mode: train.lr grid of the "
                    "options stage's Muon runs, the same for every algorithm (default 1e-2 2e-2 4e-2; --quick/--smoke "
                    "1e-2)")
    ap.add_argument("--base-lr", type=float, default=3e-3, help="tuned mode: train.lr of the outer grid")
    ap.add_argument("--outer-lrs", type=float, nargs="+", default=None, help="tuned mode: algo.outer.lr grid "
                    "(default 0.5 0.7 1.0; --quick: 0.5 1.0)")
    ap.add_argument("--outer-momenta", type=float, nargs="+", default=None, help="tuned mode: algo.outer.momentum "
                    "grid, Nesterov when > 0 (default 0 0.5 0.8; --quick: 0 0.8)")
    ap.add_argument("--steps", type=int, default=None, help="train.steps for every algorithm")
    ap.add_argument("--interval", type=int, default=None, help="H = algo.interval for the local-SGD algorithms")
    ap.add_argument("--batch-size", type=int, default=None, help="train.batch_size (per rank)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2; --quick: 0)")
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for every job (repeatable)")
    ap.add_argument("--algo-set", action="append", default=[], metavar="ALGO:KEY=VALUE",
                    help="extra override for one algorithm (repeatable)")
    ap.add_argument("--plot", type=Path, default=C.RECORDS_DIR / "convergence.png")
    ap.add_argument("--options", action=argparse.BooleanOptionalAction, default=True,
                    help="tuned mode: the options stage (issue 51: Muon inner steps, Pier's outer warm-up and "
                         "schedule) at each algorithm's best point; --no-options: the grid before issue 51")
    a = C.parse(ap, argv)
    if a.smoke:  # tuned mode in miniature: --tune --confirm, 12 steps, H=4, batch 2x32, one point per grid, seed 0
        a.algos = a.algos if a.algos != list(ALGOS) else ["edit"]
        a.tune = a.confirm = True
        a.steps, a.interval, a.batch_size, a.seq_len = a.steps or 12, a.interval or 4, a.batch_size or 2, 32
        a.eval_every, a.eval_batches, a.seeds, a.clusters = 6, 1, a.seeds or [0], a.clusters or [TUNE_GROUPS]
        a.inner_lrs, a.outer_lrs, a.outer_momenta = [a.base_lr], a.outer_lrs or [0.7], a.outer_momenta or [0.8]
        a.muon_lrs = a.muon_lrs or [1e-2]
        a.out, a.plot = a.workdir / "smoke.json", a.workdir / "smoke.png"
    a.tuned_mode = a.tune or a.confirm
    if a.tuned_mode:
        a.steps = a.steps or (120 if a.quick else 1000)
        a.eval_every = a.eval_every if a.eval_every is not None else (20 if a.quick else 100)
        a.clusters = a.clusters or ([TUNE_GROUPS] if a.quick else [TUNE_GROUPS, 4])
        a.inner_lrs = a.inner_lrs or ([a.base_lr] if a.quick else [2e-3, 3e-3, 5e-3])
        a.muon_lrs = a.muon_lrs or ([1e-2] if a.quick else list(T.MUON_LRS))
        a.outer_lrs = a.outer_lrs or ([0.5, 1.0] if a.quick else [0.5, 0.7, 1.0])
        a.outer_momenta = a.outer_momenta or ([0.0, 0.8] if a.quick else [0.0, 0.5, 0.8])
    a.steps = a.steps or (200 if a.quick else 320)
    a.interval = a.interval or 8
    a.batch_size = a.batch_size or 8
    a.eval_every = a.eval_every if a.eval_every is not None else (25 if a.quick else 40)
    a.seeds = a.seeds or ([0] if a.quick else [0, 1, 2])
    if "ddp" not in a.algos:
        a.algos = ["ddp", *a.algos]  # the reference every ratio is taken against
    return a


def overrides_for(algo: str, a: argparse.Namespace, seed: int) -> list[str]:
    common = ["cluster=local_2x1", f"algo={algo}", f"seed={seed}", f"train.steps={a.steps}",
              f"train.batch_size={a.batch_size}", f"train.seq_len={a.seq_len}",
              f"train.eval_every={a.eval_every}", f"train.eval_batches={a.eval_batches}"]
    if algo != "ddp":
        common += [f"algo.interval={a.interval}", "algo.warmup_steps=0"]
    mine = [s.split(":", 1)[1] for s in a.algo_set if s.split(":", 1)[0] == algo]
    return common + ALGO_OVERRIDES[algo] + list(a.extra) + mine


def row_for(job: C.Job, ddp: dict[str, Any], interval: int) -> dict[str, Any]:
    s = job.summary
    tokens = s["tokens"]
    ratio_b = s["cross_cluster_bytes"] / ddp["cross_cluster_bytes"] if ddp["cross_cluster_bytes"] else None
    return {
        "algo": job.name, "final_val_loss": s["final_val_loss"], "initial_val_loss": s.get("initial_val_loss"),
        "loss_ratio_vs_ddp": s["final_val_loss"] / ddp["final_val_loss"], "tokens": tokens,
        "cross_cluster_bytes": s["cross_cluster_bytes"], "bytes_per_token": s["cross_cluster_bytes"] / max(tokens, 1),
        "bytes_ratio_vs_ddp": ratio_b, "bytes_ratio_x_H": ratio_b * interval if ratio_b is not None else None,
        "syncs": s.get("syncs"), "anomalies": s.get("anomalies"), "train_wall_s": s.get("wall_s"),
        "job_wall_s": job.wall_s, "run_dir": job.run_dir,
    }


def targets(rows: dict[str, dict[str, Any]], interval: int) -> dict[str, Any]:
    if "edit" not in rows:
        return {}
    e = rows["edit"]
    out: dict[str, Any] = {
        "edit_loss_le_1.02x_ddp": e["loss_ratio_vs_ddp"] <= 1.02,
        "edit_loss_ratio_vs_ddp": e["loss_ratio_vs_ddp"],
        "edit_bytes_le_1/H_ddp": e["bytes_ratio_vs_ddp"] is not None
        and e["bytes_ratio_vs_ddp"] <= (1.0 / interval) * (1 + 1e-3),
        "edit_bytes_ratio_x_H": e["bytes_ratio_x_H"],
    }
    for other in ("diloco", "post_local_sgd"):
        if other in rows:
            out[f"edit_below_{other}"] = e["final_val_loss"] < rows[other]["final_val_loss"]
            out[f"edit_minus_{other}"] = e["final_val_loss"] - rows[other]["final_val_loss"]
    return out


def spread(values: list[float]) -> dict[str, float]:
    """mean, sample std (0 for one value), min and max."""
    n = len(values)
    mean = sum(values) / n
    std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}


def across_seeds(per_seed: dict[int, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(per-algorithm spread of loss and loss/ddp, targets that must hold on every seed)."""
    algos = list(next(iter(per_seed.values()))["results"])
    summary = {}
    for algo in algos:
        rows = [ps["results"][algo] for ps in per_seed.values()]
        summary[algo] = {"final_val_loss": spread([r["final_val_loss"] for r in rows]),
                         "loss_ratio_vs_ddp": spread([r["loss_ratio_vs_ddp"] for r in rows]),
                         "anomalies": [r["anomalies"] for r in rows],
                         "job_wall_s": spread([r["job_wall_s"] for r in rows])}
    tg: dict[str, Any] = {}
    if "edit" in algos:
        for key in ("edit_loss_le_1.02x_ddp", "edit_below_diloco", "edit_below_post_local_sgd",
                    "edit_bytes_le_1/H_ddp"):
            vals = [ps["targets"].get(key) for ps in per_seed.values()]
            if all(v is not None for v in vals):
                tg[f"{key}_every_seed"] = all(vals)
        for key in ("edit_loss_ratio_vs_ddp", "edit_minus_diloco", "edit_minus_post_local_sgd"):
            vals = [ps["targets"][key] for ps in per_seed.values() if key in ps["targets"]]
            if vals:
                tg[f"{key}_per_seed"] = vals
    return summary, tg


def plot(curves: dict[str, dict[int, tuple[list[float], list[float]]]], path: Path, title: str) -> Path:
    """All algorithms on one figure: mean validation loss over seeds, min..max band."""
    plt = C.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    tail: list[float] = []
    for name, by_seed in curves.items():
        runs = list(by_seed.values())
        n = min(len(r[0]) for r in runs)
        toks = runs[0][0][:n]
        cols = [[r[1][i] for r in runs] for i in range(n)]
        mean = [sum(c) / len(c) for c in cols]
        lo, hi = [min(c) for c in cols], [max(c) for c in cols]
        label = f"{name} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
        for a_, sl in ((ax, slice(0, n)), (ax2, slice(1, n))):  # zoom: skip the init eval
            line, = a_.plot(toks[sl], mean[sl], marker="o", ms=3, label=label)
            if len(runs) > 1:
                a_.fill_between(toks[sl], lo[sl], hi[sl], color=line.get_color(), alpha=0.15)
        tail += mean[n // 2:]
    ax.set_xlabel("training tokens (M, all groups)")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax2.set_xlabel("training tokens (M, all groups)")
    ax2.set_title("zoom (after step 0); band = min..max over seeds")
    if tail:
        ax2.set_ylim(min(tail) - 0.05, max(tail) + 0.1)
    for a_ in (ax, ax2):
        a_.legend()
        a_.grid(alpha=0.3)
    return C.save_fig(fig, path)


def run_seed(a: argparse.Namespace, seed: int) -> tuple[dict[str, Any], dict[str, C.Job]]:
    jobs: dict[str, C.Job] = {}
    for algo in a.algos:
        jobs[algo] = C.run_job(f"{algo} seed {seed}", a.workdir / f"seed{seed}" / algo,
                               overrides_for(algo, a, seed), timeout=a.timeout, reuse=a.reuse)
        jobs[algo].name = algo
    ddp = jobs["ddp"].summary
    rows = {name: row_for(job, ddp, a.interval) for name, job in jobs.items()}
    return {"results": rows, "targets": targets(rows, a.interval),
            "overrides": {n: j.overrides for n, j in jobs.items()}}, jobs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.tuned_mode:
        return tuned_main(a)
    t0 = time.perf_counter()
    per_seed: dict[int, dict[str, Any]] = {}
    curves: dict[str, dict[int, tuple[list[float], list[float]]]] = {}
    for seed in a.seeds:
        per_seed[seed], jobs = run_seed(a, seed)
        for name, job in jobs.items():
            steps, losses = job.eval_curve()
            tps = C.tokens_per_step(job.summary)
            curves.setdefault(name, {})[seed] = ([st * tps / 1e6 for st in steps], losses)
    summary, tg = across_seeds(per_seed)
    wall = time.perf_counter() - t0
    result = {
        "benchmark": "convergence", "quick": a.quick,
        "setup": {"cluster": "local_2x1", "model": "tiny", "steps": a.steps, "interval": a.interval,
                  "batch_size": a.batch_size, "seq_len": a.seq_len, "seeds": a.seeds,
                  "eval_every": a.eval_every, "eval_batches": a.eval_batches, "algo_overrides": ALGO_OVERRIDES},
        "summary": summary, "targets": tg, "per_seed": per_seed, "wall_s": wall,
        "curves": {n: {str(s): dict(zip(("tokens_M", "val_loss"), c)) for s, c in by.items()}
                   for n, by in curves.items()},
        "env": C.environment(),
    }
    C.write_json(a.out, result)
    plot(curves, a.plot, f"tiny MoE, 2 groups, {a.steps} steps, H={a.interval}, seeds {a.seeds}")
    cols = [("algo", "algo", ""), ("final_val_loss", "val loss", ".4f"), ("loss_ratio_vs_ddp", "/ddp", ".4f"),
            ("cross_cluster_bytes", "bytes", ",d"), ("bytes_ratio_vs_ddp", "B/ddp", ".5f"),
            ("bytes_ratio_x_H", "x H", ".5f"), ("syncs", "syncs", ""), ("anomalies", "flags", ""),
            ("job_wall_s", "job s", ".0f")]
    for seed, ps in per_seed.items():
        print(f"seed {seed}:")
        print(C.table(ps["results"].values(), cols))
    srows = [{"algo": n, "mean": v["final_val_loss"]["mean"], "std": v["final_val_loss"]["std"],
              "min": v["final_val_loss"]["min"], "max": v["final_val_loss"]["max"],
              "ratio": v["loss_ratio_vs_ddp"]["mean"], "ratio_max": v["loss_ratio_vs_ddp"]["max"]}
             for n, v in summary.items()]
    print(f"across seeds {a.seeds} (total wall {wall / 60:.1f} min):")
    print(C.table(srows, [("algo", "algo", ""), ("mean", "val loss mean", ".4f"), ("std", "std", ".4f"),
                          ("min", "min", ".4f"), ("max", "max", ".4f"), ("ratio", "/ddp mean", ".4f"),
                          ("ratio_max", "/ddp max", ".4f")]))
    C.print_targets(tg, a.out, a.plot)
    return result


# --------------------------------------------------------------------------- tuned mode (--tune / --confirm)
def confirm(a: argparse.Namespace, best: dict[str, T.Setting], run: T.Runner) -> dict[str, Any]:
    """Phase 2: every seed at each algorithm's best, per cluster count (the tuning runs are reused)."""
    out: dict[str, Any] = {}
    for groups in a.clusters:
        t0 = time.perf_counter()
        per_seed: dict[int, dict[str, Any]] = {}
        curves: dict[str, dict[int, tuple[list[int], list[float]]]] = {}
        edit_jobs = []
        for seed in a.seeds:
            jobs = {algo: run(best[algo], seed, groups, reuse=(seed == TUNE_SEED and groups == TUNE_GROUPS))
                    for algo in a.algos}
            rows = {n: row_for(j, jobs["ddp"].summary, a.interval) for n, j in jobs.items()}
            per_seed[seed] = {"results": rows, "targets": targets(rows, a.interval),
                              "overrides": {n: j.overrides for n, j in jobs.items()}}
            for n, j in jobs.items():
                curves.setdefault(n, {})[seed] = T.mean_eval_curve(j)
            edit_jobs += [jobs["edit"]] if "edit" in jobs else []
        summary, _ = across_seeds(per_seed)
        out[str(groups)] = {
            "summary": summary, "targets": T.tuned_targets(per_seed), "per_seed": per_seed,
            "flagged_modules": T.flagged_modules(edit_jobs),
            "gap_vs_step": T.gap_vs_step([curves["edit"][s] for s in a.seeds], [curves["ddp"][s] for s in a.seeds])
            if "edit" in curves else [],
            "curves": {n: {str(s): {"steps": c[0], "val_loss": c[1]} for s, c in by.items()}
                       for n, by in curves.items()},
            "wall_s": time.perf_counter() - t0}
    return out


def tuned_main(a: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    tu: dict[str, Any] | None = None
    if not a.tune:
        src = a.tuned or a.out
        tu = json.loads(Path(src).read_text()).get("tune") if Path(src).exists() else None
        if not tu:
            raise SystemExit(f"--confirm without --tune needs the tuning in {src} (run --tune first)")
        missing = [x for x in a.algos if x not in tu["best"]]
        if missing:
            raise SystemExit(f"{src} has no tuning for {missing}")
        for k in ("model", "steps", "interval"):
            if tu.get(k) != getattr(a, k):
                print(f"warning: the tuning in {src} was at {k}={tu.get(k)}, this run uses {getattr(a, k)}")
    n_tune = T.planned_tune_runs(a.algos, a.inner_lrs, a.base_lr, a.outer_lrs, a.outer_momenta,
                                 a.options, a.muon_lrs) if a.tune else 0
    plan = [TUNE_GROUPS] * n_tune
    if a.confirm:
        plan += [G for G in a.clusters for s in a.seeds
                 if not (a.tune and G == TUNE_GROUPS and s == TUNE_SEED) for _ in a.algos]
    print(f"tuned mode: {len(plan)} runs ({n_tune} tuning at seed {TUNE_SEED} x {TUNE_GROUPS} clusters, "
          f"{len(plan) - n_tune} confirming at seeds {a.seeds} x clusters {a.clusters if a.confirm else []}); "
          f"{a.model}, {a.steps} steps, batch {a.batch_size}, seq {a.seq_len}, H={a.interval}; "
          "ETA after the first run", flush=True)
    run = T.Runner(a, T.Progress(plan))
    setup = {"cluster": "local (cluster.count=G cluster.ranks=1)", "model": a.model, "steps": a.steps,
             "interval": a.interval, "warmup_steps": 0, "batch_size": a.batch_size, "seq_len": a.seq_len,
             "eval_every": a.eval_every, "eval_batches": a.eval_batches, "tune_seed": TUNE_SEED,
             "tune_groups": TUNE_GROUPS, "seeds": a.seeds, "clusters": a.clusters, "inner_lrs": a.inner_lrs,
             "base_lr": a.base_lr, "outer_lrs": a.outer_lrs, "outer_momenta": a.outer_momenta,
             "post_local_sgd_outer": "averaging: outer SGD lr 1, momentum 0 (by definition, not tuned)",
             "options": ({x: {v: list(o) for v, o in T.option_variants(x, a.steps, a.interval).items()}
                          for x in a.algos} if a.options else "none"),
             "extra_overrides": a.extra, "algo_set": a.algo_set}
    result: dict[str, Any] = {"benchmark": "convergence", "mode": "tuned", "quick": a.quick, "setup": setup}
    if a.tune:
        tu = T.tune(a, run)
        T.print_tune(tu)
    assert tu is not None
    result["tune"] = tu
    C.write_json(a.out, {**result, "wall_s": time.perf_counter() - t0, "env": C.environment()})
    curves = {TUNE_GROUPS: {n: (b["curve"]["steps"], b["curve"]["val_loss"]) for n, b in tu["best"].items()
                            if n in a.algos}}
    if a.confirm:
        best = {algo: T.Setting.from_dict(tu["best"][algo]) for algo in a.algos}
        co = result["confirm"] = confirm(a, best, run)
        first = str(a.clusters[0])  # the old contract's summary/targets/per_seed: the first cluster count
        result.update({k: co[first][k] for k in ("summary", "targets", "per_seed")})
        s0 = str(a.seeds[0])
        curves = {int(G): {n: (c[s0]["steps"], c[s0]["val_loss"]) for n, c in g["curves"].items()}
                  for G, g in co.items()}
    wall = time.perf_counter() - t0
    result.update({"wall_s": wall, "env": C.environment()})
    C.write_json(a.out, result)
    labels = {n: b["label"] for n, b in tu["best"].items()}
    T.plot(curves, labels, tu["outer_grid"], a.plot,
           f"{a.model} MoE, {a.steps} steps, batch {a.batch_size}x{a.seq_len}, H={a.interval}, each algorithm "
           f"tuned on seed {TUNE_SEED} at {TUNE_GROUPS} clusters; curves: seed "
           f"{a.seeds[0] if a.confirm else TUNE_SEED}")
    if a.confirm:
        T.print_confirm(a, tu, result["confirm"])
    print(f"wrote {a.out} and {a.plot}")
    print(f"tuned mode wall {wall / 60:.1f} min ({run.progress.done_n} runs, {run.progress.reused} reused; "
          f"sum of the trained runs' walls {sum(w for _, w in run.progress.walls) / 60:.1f} min)")
    return result


if __name__ == "__main__":
    main()
