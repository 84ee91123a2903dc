"""Heterogeneous clusters at a fixed wall-clock budget: ddp, EDiT, A-EDiT and A-EDiT + overlapped sync.

Two clusters of one rank (one thread) each; cluster 1 is 3x slower (`cluster.slowdown=[1.0,3.0]`) and
they are joined by a simulated WAN link of 100 Mbit/s + 50 ms (`cluster=hetero_2x1`). Every run stops at
an agreed point after `train.time_budget_s=T` (`train.steps` is set out of reach). First each group is
measured alone (`cluster=local cluster.slowdown=[s]`, same batch, sequence length and budget), then every
algorithm runs on `cluster=hetero_2x1`. Reported per algorithm (from `summary.json`):

  * throughput ratio = Σ over clusters of tokens / training time ÷ the same sum of the two standalone runs,
    where training time = wall − eval − start-up − checkpoint (`per_cluster.time`): the runs evaluate on
    different schedules (the standalone ones only at their start and end), so evals are excluded from
    both and reported apart, with start-up, in the breakdown table; `/sum e2e` is the end-to-end ratio;
    `same speed` is the ratio at equal hardware speed (each cluster's share of training time spent computing
    ÷ its standalone run's, weighted by standalone throughput): a shared box drifts in speed between the
    runs, which the `compute tok/s` column shows and this ratio cancels;
  * blocked fraction = max over clusters of time blocked on other clusters or the link ÷ wall, and the same
    without the final sync (the one blocking exchange that every run needs to end on one model);
  * a breakdown per run and cluster: every time bucket's share of the wall (compute, slowdown, eval, sync
    work, blocked, checkpoint, data, start-up, other);
  * final val loss of the global model after the last sync, at the (roughly) equal wall-clock budget;
  * for A-EDiT, the planned local steps per group H_i (median over the syncs between the first, which
    uses `algo.interval`, and the final one, which is cut short) and H_0/H_1 vs the measured speed ratio.

Targets (reported, not asserted): a_edit+overlap >= 0.95 of the standalone sum with <= 2% blocked;
a_edit's final val loss below ddp's and edit's.

A-EDiT's first interval is `algo.interval` local steps for every group (no step time is known yet), so the
fast group waits (s_1 - s_0) x interval at the first sync; `--first-interval` (default 4) keeps that short.
`--reuse` re-reads finished run directories instead of training again (to redo the table and plot).

    python benchmarks/heterogeneity.py --quick    # 6 runs x 45 s budget + start-up: ~6 min on 2 cores
    python benchmarks/heterogeneity.py            # 6 runs x 240 s, batch 16 x 128, tau 10 s, H 32
    python benchmarks/heterogeneity.py --budget 120 --sync-time 8 --out r.json --plot r.png
    python benchmarks/heterogeneity.py --runs a_edit+overlap a_edit+overlap+staleness   # issue 51's correction
    python benchmarks/heterogeneity.py --quick --runs ddp a_edit ddp+muon a_edit+muon     # issue 51's Muon
    python benchmarks/heterogeneity.py --quick --runs ddp a_edit a_edit+topk a_edit+topk_lr17   # top-k's defaults
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from edit_train.timing import BUCKETS  # noqa: E402

SLOWDOWN = (1.0, 3.0)
# name -> (algo, extra overrides); all on cluster=hetero_2x1
RUNS: dict[str, tuple[str, list[str]]] = {
    "ddp": ("ddp", []),
    "edit": ("edit", []),
    "a_edit": ("a_edit", []),
    "a_edit+overlap": ("a_edit", ["sync.mode=overlap"]),
    # issue 51: the staleness correction where the merged Δ is stale (overlap lands it one interval late)
    "a_edit+overlap+staleness": ("a_edit", ["sync.mode=overlap", "algo.outer.staleness_correction=true"]),
    # issue 51: Muon inner steps, each algorithm at its tuned Muon point of the muon_lr study (results/muon_lr.json:
    # DDP lr 3e-2 with momentum 0.8; edit lr 4e-2 with momentum 0.9 and plain averaging), tuned under a decaying lr;
    # `--muon-lr` sets another lr for both arms (this benchmark's lr does not decay: train.steps is out of reach)
    "ddp+muon": ("ddp", ["train.optimizer=muon", "train.lr=0.03", "train.muon_momentum=0.8"]),
    "a_edit+muon": ("a_edit", ["train.optimizer=muon", "train.lr=0.04", "train.muon_momentum=0.9",
                               "algo.outer.lr=1.0", "algo.outer.momentum=0.0", "algo.outer.nesterov=false"]),
    # issue 51: the top-k defaults (1/100 of the bytes, error feedback as momentum) on the slow link, at a_edit's own
    # outer step and at the outer lr the pair was found at
    "a_edit+topk": ("a_edit", ["sync.compression=topk", "sync.scale_dtype=bf16"]),
    "a_edit+topk_lr17": ("a_edit", ["sync.compression=topk", "sync.scale_dtype=bf16", "algo.outer.lr=1.7",
                                    "algo.outer.momentum=0.0", "algo.outer.nesterov=false"]),
    # the defaults they replaced (element-wise 1 %, plain error feedback) and the 1/57 keep pair
    "a_edit+topk_1pct": ("a_edit", ["sync.compression=topk", "sync.scale_dtype=bf16", "sync.topk_density=0.01",
                                    "sync.topk_group=1", "sync.error_feedback_decay=1.0"]),
    "a_edit+topk_keep": ("a_edit", ["sync.compression=topk", "sync.scale_dtype=bf16", "sync.topk_density=0.1875",
                                    "sync.unsent=keep", "algo.outer.lr=1.0"]),
}
DEFAULT_RUNS = ["ddp", "edit", "a_edit", "a_edit+overlap"]  # the table of results/heterogeneity.json
COLORS = {"ddp": "tab:blue", "edit": "tab:orange", "a_edit": "tab:green", "a_edit+overlap": "tab:red",
          "a_edit+overlap+staleness": "tab:purple", "ddp+muon": "tab:cyan", "a_edit+muon": "tab:olive",
          "a_edit+topk": "tab:brown", "a_edit+topk_lr17": "tab:pink", "a_edit+topk_1pct": "tab:gray",
          "a_edit+topk_keep": "gold"}  # every name its own colour


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = C.parser(__doc__, out="heterogeneity.json", plot="heterogeneity.png", workdir="heterogeneity", reuse=True)
    ap.add_argument("--quick", action="store_true", help="45 s per run, batch 4 x 64, tau 5 s, H 16")
    ap.add_argument("--budget", type=float, default=None, help="train.time_budget_s of every run (s)")
    ap.add_argument("--sync-time", type=float, default=None, help="algo.sync_time_s (A-EDiT tau)")
    ap.add_argument("--interval", type=int, default=None, help="algo.interval of edit (local steps per sync)")
    ap.add_argument("--first-interval", type=int, default=4,
                    help="algo.interval of a_edit: its first interval, taken by every group before any timing")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evals (per group for a_edit)")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--muon-lr", type=float, default=None,
                    help="train.lr of the +muon arms (default: each one's tuned point of the muon_lr study)")
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS),
                    help="runs to make (a_edit+overlap+staleness: issue 51's staleness correction, not by default)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for every job (repeatable)")
    a = C.parse(ap, argv)
    q = a.quick = a.quick or a.smoke
    a.runs = ["a_edit"] if a.smoke and a.runs == DEFAULT_RUNS else a.runs
    a.budget = a.budget or (45.0 if q else 240.0)
    a.sync_time = a.sync_time or (5.0 if q else 10.0)
    a.interval = a.interval or (16 if q else 32)
    a.batch_size = a.batch_size or (4 if q else 16)
    a.seq_len = a.seq_len or (64 if q else 128)
    a.eval_every = a.eval_every if a.eval_every is not None else (25 if q else 50)
    return a


def common_overrides(a: argparse.Namespace) -> list[str]:
    return ["model=tiny", f"seed={a.seed}", "train.steps=100000000", f"train.time_budget_s={a.budget:g}",
            f"train.batch_size={a.batch_size}", f"train.seq_len={a.seq_len}", f"train.eval_every={a.eval_every}",
            f"train.eval_batches={a.eval_batches}", *a.extra]


def run_overrides(name: str, a: argparse.Namespace) -> list[str]:
    algo, extra = RUNS[name]
    out = ["cluster=hetero_2x1", f"cluster.slowdown=[{SLOWDOWN[0]:g},{SLOWDOWN[1]:g}]",
           "cluster.link.bandwidth_mbps=100", "cluster.link.latency_ms=50", f"algo={algo}"]
    if algo == "edit":
        out += [f"algo.interval={a.interval}", "algo.warmup_steps=0"]
    if algo == "a_edit":
        out += [f"algo.interval={a.first_interval}", "algo.warmup_steps=0", f"algo.sync_time_s={a.sync_time:g}"]
    if a.muon_lr is not None and "train.optimizer=muon" in extra:
        extra = [x for x in extra if not x.startswith("train.lr=")] + [f"train.lr={a.muon_lr!r}"]
    return out + extra + common_overrides(a)


def plan_stats(summary: dict[str, Any]) -> dict[str, Any]:
    """Median planned local steps per cluster (c0, c1), skipping the first (fixed) and the last (cut-short) sync."""
    per = summary["per_cluster"]
    hist = {c: list(per[c].get("local_steps") or []) for c in sorted(per, key=lambda c: per[c]["index"])}
    med = {c: (statistics.median(h[1:-1]) if len(h) > 2 else None) for c, h in hist.items()}
    h0, h1 = med.get("c0"), med.get("c1")
    return {"local_steps": hist, "median_H": med, "H0_over_H1": h0 / h1 if h0 and h1 else None}


def blocked_fracs(job: C.Job) -> tuple[float, float]:
    """(blocked, blocked without the final sync) as a share of the wall, max over clusters, from the time
    account (`per_cluster.time`: waiting for the federation to form at start-up is start-up there). The
    final sync is the one blocking exchange every run needs to end on one model (the last `sync` event)."""
    total, steady = 0.0, 0.0
    syncs = job.events("sync")
    for name, c in job.summary["per_cluster"].items():
        t = c["time"]
        mine = [e for e in syncs if e.get("cluster") == name]
        final = max(mine, key=lambda e: e["sync"])["blocked_s"] if mine else 0.0
        total = max(total, t["blocked"] / t["wall_s"])
        steady = max(steady, max(t["blocked"] - final, 0.0) / t["wall_s"])
    return total, steady


# a run's training time: its wall time less what the runs being compared do not do alike (evals on different
# schedules, start-up before the first step, checkpoints); those are reported apart in the breakdown
NOT_TRAINING = ("eval", "startup", "checkpoint")


def breakdown(name: str, job: C.Job) -> list[dict[str, Any]]:
    """One row per cluster: wall seconds, tokens/s over the wall and over training time, and the share of
    the wall in every bucket (`summary.json` per_cluster.time)."""
    rows = []
    for cname, c in job.summary["per_cluster"].items():
        t = c["time"]
        train_s = t["wall_s"] - sum(t[b] for b in NOT_TRAINING)
        rows.append({"run": name, "cluster": cname, "wall_s": t["wall_s"], "tokens": c["tokens"],
                     "tokens_per_s": c["tokens"] / max(t["wall_s"], 1e-9), "train_s": train_s,
                     "train_tokens_per_s": c["tokens"] / max(train_s, 1e-9),
                     # tokens per second of compute alone: equal to the standalone run's when nothing competes
                     # with the cluster's compute for the cores
                     "compute_tokens_per_s": c["tokens"] / max(t["compute"], 1e-9), "time": t,
                     **{b: t[b] / max(t["wall_s"], 1e-9) for b in BUCKETS}})
    return rows


def print_breakdown(rows: list[dict[str, Any]]) -> None:
    print("where the time goes (share of each cluster's wall; training tok/s = tokens / (wall - "
          + " - ".join(NOT_TRAINING) + ")):")
    cols = [("run", "run", ""), ("cluster", "cluster", ""), ("wall_s", "wall s", ".1f"),
            ("tokens_per_s", "tok/s", ",.0f"), ("train_tokens_per_s", "train tok/s", ",.0f"),
            ("compute_tokens_per_s", "compute tok/s", ",.0f"), *[(b, b, ".3f") for b in BUCKETS]]
    print(C.table(rows, cols))


def train_tps(job: C.Job) -> float:
    """Tokens per second of training time, summed over clusters."""
    return sum(r["train_tokens_per_s"] for r in breakdown("", job))


def busy(r: dict[str, Any]) -> float:
    """Share of a cluster's training time spent computing (or in its simulated slowdown, the same compute on
    slower hardware): what is left is sync work, waiting, data and other overhead."""
    t = r["time"]
    return (t["compute"] + t["slowdown"]) / max(r["train_s"], 1e-9)


def same_speed_ratio(job: C.Job, alone: list[C.Job]) -> float:
    """The throughput ratio at equal hardware speed: each cluster's busy share relative to its standalone
    run's, weighted by the standalone throughput. A shared box drifts in speed between runs (see the compute
    tok/s column); this ratio compares shares of time within each run, so the drift cancels."""
    fed = breakdown("", job)
    base = [breakdown("", j)[0] for j in alone]
    num = sum(b["train_tokens_per_s"] * busy(f) / busy(b) for f, b in zip(fed, base))
    return num / sum(b["train_tokens_per_s"] for b in base)


def row_for(name: str, job: C.Job, sum_tps: float, speed_ratio: float, sum_train_tps: float,
            alone: list[C.Job]) -> dict[str, Any]:
    s, pc = job.summary, job.summary["per_cluster"]
    blocked, steady = blocked_fracs(job)
    tps = train_tps(job)
    row = {"run": name, "algo": s["algo"], "wall_s": s["wall_s"], "tokens": s["tokens"],
           "tokens_per_s": s["tokens_per_s"], "throughput_ratio_end_to_end": s["tokens_per_s"] / sum_tps,
           "train_tokens_per_s": tps, "throughput_ratio": tps / sum_train_tps,
           "throughput_ratio_same_speed": same_speed_ratio(job, alone),
           "breakdown": breakdown(name, job),
           "blocked_frac": blocked, "blocked_frac_steady": steady, "final_val_loss": s["final_val_loss"], "syncs": s.get("syncs"),
           "cross_cluster_bytes": s.get("cross_cluster_bytes"), "job_wall_s": job.wall_s, "run_dir": job.run_dir,
           "per_cluster": {c: {k: v[k] for k in ("tokens", "steps", "tokens_per_s", "blocked_s", "blocked_frac",
                                                 "slowdown_slept_s", "syncs") if k in v} for c, v in pc.items()},
           "tps_g0": pc["c0"]["tokens_per_s"], "tps_g1": pc.get("c1", {}).get("tokens_per_s")}
    if s["algo"] == "a_edit":
        row.update(plan_stats(s))
        row["speed_ratio_standalone"] = speed_ratio
    return row


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ov = rows.get("a_edit+overlap")
    if ov:
        out["a_edit+overlap_throughput_ge_0.95"] = ov["throughput_ratio"] >= 0.95
        out["a_edit+overlap_throughput_same_speed_ge_0.95"] = ov["throughput_ratio_same_speed"] >= 0.95
        out["a_edit+overlap_blocked_le_0.02"] = ov["blocked_frac"] <= 0.02
    for name in ("a_edit", "a_edit+overlap"):
        for other in ("ddp", "edit"):
            if name in rows and other in rows:
                out[f"{name}_loss_below_{other}"] = rows[name]["final_val_loss"] < rows[other]["final_val_loss"]
    return out


def eval_series(job: C.Job) -> tuple[list[tuple[float, float]], dict[int, list[tuple[float, float]]]]:
    """World evals [(wall, val_loss)] and per-cluster evals {cluster index: [(wall, val_loss)]} (A-EDiT)."""
    world, clusters = [], {}
    for e in job.events("eval"):
        point = (float(e["wall"]), float(e["val_loss"]))
        if e.get("scope") == "cluster":
            clusters.setdefault(int(e["cluster_index"]), []).append(point)
        else:
            world.append(point)
    return sorted(world), {g: sorted(v) for g, v in clusters.items()}


def plot(jobs: dict[str, C.Job], rows: dict[str, dict[str, Any]], a: argparse.Namespace,
         breakdown_rows: list[dict[str, Any]]) -> Path:
    from edit_train.report.time_split import draw_breakdown

    plt = C.pyplot()
    fig = plt.figure(figsize=(13, 5 + 0.32 * len(breakdown_rows)), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[5, 1.2 + 0.32 * len(breakdown_rows)])
    ax, ax2 = top.subplots(1, 2, width_ratios=[1.35, 1])
    draw_breakdown(bottom.subplots(), [(f"{r['run']} · {r['cluster']}", r["time"]) for r in breakdown_rows],
                   "where each cluster's wall time goes (share per bucket)")
    finals = []
    for name, job in jobs.items():
        color = COLORS.get(name)
        world, groups = eval_series(job)
        if groups.get(0):  # a_edit: group 0's replica between syncs, joined to the global model at the end
            g0 = [*world[:1], *groups[0], *world[-1:]]
            ax.plot(*zip(*g0), ls="--", lw=1.2, color=color, alpha=0.8, label=f"{name} (group-0 replica)")
            ax.plot(*zip(*world), ls="none", marker="s", ms=6, color=color, label=f"{name} (global model)")
        elif world:
            ax.plot(*zip(*world), marker="o", ms=4, color=color, label=f"{name} (global model)")
        if world:
            finals.append(world[-1][1])
    ax.axvline(a.budget, color="gray", ls=":", lw=1)
    ax.text(a.budget, 0.98, " budget T", color="gray", va="top", fontsize=8, transform=ax.get_xaxis_transform())
    if finals:  # zoom on the interesting part; the step-0 eval is far above
        ax.set_ylim(min(finals) - 0.15, max(finals) + 0.9)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"val loss vs wall time (slowdown 1:3, 100 Mbit/s + 50 ms, T={a.budget:g} s)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    names = list(rows)
    x = range(len(names))
    w = 0.27
    b1 = ax2.bar([i - w for i in x], [rows[n]["throughput_ratio"] for n in names], w,
                 label="training tokens/s ÷ sum of standalone", color="tab:green")
    b2 = ax2.bar(list(x), [rows[n]["blocked_frac"] for n in names], w,
                 label="blocked fraction (max over groups)", color="tab:gray")
    b3 = ax2.bar([i + w for i in x], [rows[n]["blocked_frac_steady"] for n in names], w, color="white",
                 edgecolor="tab:gray", hatch="//", label="blocked without the final sync")
    for bars in (b1, b2, b3):
        ax2.bar_label(bars, fmt="%.2f", fontsize=7)
    ax2.axhline(0.95, color="tab:green", ls="--", lw=1, label="target throughput 0.95")
    ax2.axhline(0.02, color="black", ls="--", lw=1, label="target blocked 0.02")
    ax2.set_xticks(list(x), names, rotation=20 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center",
                   fontsize=8 if len(names) > 4 else None)
    ax2.set_ylim(0, 1.4)
    ax2.set_title("throughput and time blocked on cross-cluster sync", fontsize=10)
    ax2.legend(fontsize=7, loc="upper left", ncol=2)
    ax2.grid(alpha=0.3, axis="y")
    return C.save_fig(fig, a.plot)


def job(name: str, run_dir: Path, overrides: list[str], a: argparse.Namespace) -> C.Job:
    if a.reuse and (run_dir / "summary.json").exists():
        s = C.read_summary(run_dir)
        return C.Job(name, run_dir, [*C.BASE_OVERRIDES, *overrides, f"run.dir={run_dir.resolve()}"], s["wall_s"], s,
                     C.read_metrics(run_dir))
    return C.run_job(name, run_dir, overrides, timeout=a.budget * 4 + 300)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank (inherited by the job and its workers)
    alone: dict[str, C.Job] = {}
    for s in SLOWDOWN:
        name = f"standalone_x{s:g}"
        # the denominator is pure training speed: evals only at the start and the end (conservative)
        base = [o for o in common_overrides(a) if not o.startswith("train.eval_every=")]
        alone[name] = job(name, a.workdir / name, ["cluster=local", f"cluster.slowdown=[{s:g}]", "algo=ddp",
                                                   *base, "train.eval_every=0"], a)
    tps = [j.summary["tokens_per_s"] for j in alone.values()]
    sum_tps, speed_ratio = sum(tps), tps[0] / tps[1]
    sum_train_tps = sum(train_tps(j) for j in alone.values())
    jobs = {n: job(n, a.workdir / n.replace("+", "_"), run_overrides(n, a), a) for n in a.runs}
    rows = {n: row_for(n, j, sum_tps, speed_ratio, sum_train_tps, list(alone.values())) for n, j in jobs.items()}
    result = {
        "benchmark": "heterogeneity", "quick": a.quick,
        "setup": {"cluster": "hetero_2x1", "slowdown": list(SLOWDOWN), "link": "100 Mbit/s + 50 ms",
                  "model": "tiny", "budget_s": a.budget, "sync_time_s": a.sync_time, "interval": a.interval,
                  "a_edit_first_interval": a.first_interval,
                  "batch_size": a.batch_size, "seq_len": a.seq_len, "eval_every": a.eval_every,
                  "eval_batches": a.eval_batches, "seed": a.seed, "OMP_NUM_THREADS": 1,
                  "commands": {n: " ".join(["edit-train", *j.overrides]) for n, j in {**alone, **jobs}.items()}},
        "standalone": {n: {"tokens_per_s": j.summary["tokens_per_s"], "wall_s": j.summary["wall_s"],
                           "tokens": j.summary["tokens"], "steps": j.summary["steps"],
                           "final_val_loss": j.summary["final_val_loss"], "train_tokens_per_s": train_tps(j),
                           "breakdown": breakdown(n, j)} for n, j in alone.items()},
        "standalone_sum_tokens_per_s": sum_tps, "standalone_sum_train_tokens_per_s": sum_train_tps,
        "standalone_speed_ratio": speed_ratio,
        "results": rows, "targets": targets(rows),
        "curves": {n: dict(zip(("world", "cluster"), eval_series(j))) for n, j in jobs.items()},
        "env": C.environment(),
    }
    C.write_json(a.out, result)
    every = [r for j in {**alone, **jobs}.items() for r in breakdown(*j)]
    plot(jobs, rows, a, every)
    print("standalone tokens/s: " + ", ".join(f"{n} {t:,.0f}" for n, t in zip(alone, tps))
          + f"; sum {sum_tps:,.0f}; speed ratio {speed_ratio:.2f}")
    print_breakdown(every)
    cols = [("run", "run", ""), ("tokens_per_s", "tok/s", ",.0f"), ("tps_g0", "g0 tok/s", ",.0f"),
            ("tps_g1", "g1 tok/s", ",.0f"), ("throughput_ratio_end_to_end", "/sum e2e", ".3f"),
            ("train_tokens_per_s", "train tok/s", ",.0f"), ("throughput_ratio", "/sum alone", ".3f"),
            ("throughput_ratio_same_speed", "same speed", ".3f"),
            ("blocked_frac", "blocked", ".3f"), ("blocked_frac_steady", "steady", ".3f"), ("final_val_loss", "val loss", ".4f"), ("wall_s", "wall s", ".1f"),
            ("syncs", "syncs", ""), ("H0_over_H1", "H0/H1", ".2f")]
    print(C.table(rows.values(), cols))
    for n, r in rows.items():
        if "median_H" in r:
            print(f"  {n}: median H per cluster {r['median_H']} (H0/H1 {C.fmt(r['H0_over_H1'], '.2f')}, standalone "
                  f"speed ratio {speed_ratio:.2f}); local steps per sync {r['local_steps']}")
    C.print_targets(result["targets"], a.out, a.plot)
    return result


if __name__ == "__main__":
    main()
