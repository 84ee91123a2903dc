"""EDiT's anomaly-aware penalty under an injected fault: clean vs faulty vs faulty with the penalty off.

Three `algo=edit` runs of the tiny MoE on `cluster=local_2x1` (2 groups x 1 shard), same seed and data:
  * clean       — no fault;
  * faulty      — group 1 misbehaves for steps [start, end) (`garbage_data`: it trains on uniform random
                  tokens; `--fault lr_spike`: its inner LR is multiplied by `--factor`), full penalty;
  * penalty_off — the same fault with `algo.penalty.anomaly=false algo.penalty.weighting=uniform
                  algo.penalty.clip=false` (plain DiLoCo-style averaging of the pseudo-gradients).
The window starts after the EWMA warm-up: anomaly detection is live from sync W+1 on (W =
`algo.penalty.warmup_syncs`; the benchmark sets W = 5 for all three runs to fit a short run, the conf default
is 10), i.e. from step (W+1)*H, so the default start is (W+1)*H.

Reported: the syncs whose pseudo-gradient window [step - local_steps, step) overlaps the fault window; the
syncs at which group 1 was flagged anomalous (`sync` events, with the modules) in the faulty run; false
flags (outside the window, or on group 0); the final validation loss of each run, faulty/clean (target <= 1.01)
and penalty_off/clean (expected measurably worse). JSON + plot (val loss vs step, fault window shaded,
anomaly markers; group 1's pseudo-gradient norm per sync) + a printed table.

Seeds: the default preset repeats the three runs for seeds 0, 1, 2 and reports mean and min..max of each
run's loss and of the ratios; the targets must hold on every seed. The plot shows the first seed.

    python benchmarks/penalty_faults.py --quick                    # 3 x 240 steps, H=8, W=5, seed 0
    python benchmarks/penalty_faults.py --quick --fault lr_spike --factor 20
    python benchmarks/penalty_faults.py                            # 3 seeds x 3 x 240 steps, H=8, W=5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from convergence import spread  # noqa: E402

PENALTY_OFF = ["algo.penalty.anomaly=false", "algo.penalty.weighting=uniform", "algo.penalty.clip=false"]
FAULT_GROUP = 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="reduced run: 240 steps, H=8, W=5, batch 8, one seed")
    ap.add_argument("--fault", choices=("garbage_data", "lr_spike", "nan_grad"), default="garbage_data")
    ap.add_argument("--factor", type=float, default=20.0, help="LR multiplier for --fault lr_spike")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--interval", type=int, default=None, help="H = algo.interval")
    ap.add_argument("--warmup-syncs", type=int, default=None, help="algo.penalty.warmup_syncs (W)")
    ap.add_argument("--start", type=int, default=None, help="first faulty step (0-based); default (W+1)*H")
    ap.add_argument("--end", type=int, default=None, help="end of the window (exclusive); default start + 8*H")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2; --quick: 0)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for all three runs (repeatable)")
    ap.add_argument("--workdir", type=Path, default=C.RUNS_DIR / "penalty_faults")
    ap.add_argument("--out", type=Path, default=C.RESULTS_DIR / "penalty_faults.json")
    ap.add_argument("--plot", type=Path, default=C.RESULTS_DIR / "penalty_faults.png")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per job")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse finished runs in --workdir that had exactly the same overrides")
    a = ap.parse_args(argv)
    a.steps = a.steps or 240
    a.interval = a.interval or 8
    a.warmup_syncs = a.warmup_syncs if a.warmup_syncs is not None else 5
    a.batch_size = a.batch_size or 8
    a.seeds = a.seeds or ([0] if a.quick else [0, 1, 2])
    a.eval_every = a.eval_every or (2 * a.interval)
    a.start = a.start if a.start is not None else (a.warmup_syncs + 1) * a.interval
    a.end = a.end if a.end is not None else a.start + 8 * a.interval
    if a.start < (a.warmup_syncs + 1) * a.interval:
        print(f"warning: the window starts at step {a.start}, before anomaly detection is live "
              f"(step {(a.warmup_syncs + 1) * a.interval} = (W+1)*H)", flush=True)
    if not 0 <= a.start < a.end <= a.steps:
        ap.error(f"fault window [{a.start}, {a.end}) must lie inside [0, {a.steps})")
    return a


def fault_spec(a: argparse.Namespace) -> str:
    fields = f"kind:{a.fault},group:{FAULT_GROUP},start:{a.start},end:{a.end}"
    if a.fault == "lr_spike":
        fields += f",factor:{a.factor}"
    return f"faults=[{{{fields}}}]"


def common_overrides(a: argparse.Namespace, seed: int) -> list[str]:
    return ["cluster=local_2x1", "algo=edit", "train.spike_factor=0", f"seed={seed}", f"train.steps={a.steps}",
            f"train.batch_size={a.batch_size}", f"train.seq_len={a.seq_len}", f"train.eval_every={a.eval_every}",
            f"train.eval_batches={a.eval_batches}", f"algo.interval={a.interval}", "algo.warmup_steps=0",
            f"algo.penalty.warmup_syncs={a.warmup_syncs}", *a.extra]


def sync_table(job: C.Job, start: int, end: int) -> dict[str, Any]:
    """Anomaly flags per group vs the syncs whose local steps overlap [start, end).

    `flagged_*` = group 1 had any module flagged; `specific_*` = group 1 had a module flagged that group 0
    did not (flags shared by both groups come from the EWMA statistics, not from the fault)."""
    by_sync: dict[int, dict[int, dict[str, Any]]] = {}
    for e in job.events("sync"):
        by_sync.setdefault(int(e["sync"]), {})[int(e["group"])] = e
    g1 = [by_sync[k][FAULT_GROUP] for k in sorted(by_sync) if FAULT_GROUP in by_sync[k]]
    overlap = [e["sync"] for e in g1 if e["step"] - e["local_steps"] < end and e["step"] > start]

    def mods(e: dict[str, Any] | None) -> set[str]:
        return set(e.get("anomalous_modules", [])) if e and e.get("anomalous") else set()

    flagged = [e["sync"] for e in g1 if e["anomalous"]]
    specific = [e["sync"] for e in g1 if mods(e) - mods(by_sync[e["sync"]].get(1 - FAULT_GROUP))]
    flagged_g0 = [k for k in sorted(by_sync) if mods(by_sync[k].get(1 - FAULT_GROUP))]
    return {
        "overlapping_syncs": overlap,
        "overlapping_steps": [e["step"] for e in g1 if e["sync"] in overlap],
        "flagged_syncs_group1": flagged,
        "flagged_steps_group1": [e["step"] for e in g1 if e["anomalous"]],
        "specific_syncs_group1": specific,
        "flagged_modules_group1": {str(e["sync"]): e.get("anomalous_modules", []) for e in g1 if e["anomalous"]},
        "flagged_modules_group0": {str(k): sorted(mods(by_sync[k].get(1 - FAULT_GROUP))) for k in flagged_g0},
        "detected": sorted(set(flagged) & set(overlap)),
        "missed": sorted(set(overlap) - set(flagged)),
        "false_flags_group1": sorted(set(flagged) - set(overlap)),
        "specific_outside_window": sorted(set(specific) - set(overlap)),
        "flagged_syncs_group0": flagged_g0,
        "recall": len(set(flagged) & set(overlap)) / max(len(overlap), 1),
        "group1_weight_in_window": [round(e["weight"], 4) for e in g1 if e["sync"] in overlap],
    }


def plot(jobs: dict[str, C.Job], a: argparse.Namespace, path: Path) -> Path:
    plt = C.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {"clean": "tab:green", "faulty": "tab:blue", "penalty_off": "tab:red"}
    for name, job in jobs.items():
        steps, losses = job.eval_curve()
        ax.plot(steps[1:], losses[1:], marker="o", ms=3, color=colors[name], label=name)
    ax.axvspan(a.start, a.end, color="orange", alpha=0.2, label=f"{a.fault} on group {FAULT_GROUP}")
    det = sync_table(jobs["faulty"], a.start, a.end)
    specific = set(det["specific_syncs_group1"])
    labelled: set[bool] = set()
    for k, st in zip(det["flagged_syncs_group1"], det["flagged_steps_group1"]):
        own = k in specific
        kind = "group 1 only" if own else "group 0 too"
        ax.axvline(st, color="black" if own else "grey", ls=":" if own else "--", lw=1,
                   label=None if own in labelled else f"faulty: group 1 flagged ({kind})")
        labelled.add(own)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"EDiT, 2 groups, H={a.interval}: {a.fault} on group {FAULT_GROUP}")
    ax.legend(fontsize=8)
    for name, job in jobs.items():
        ev = [e for e in job.events("sync") if e["group"] == FAULT_GROUP and e.get("pseudo_grad_norm") is not None]
        ax2.plot([e["step"] for e in ev], [e["pseudo_grad_norm"] for e in ev], marker=".", color=colors[name],
                 label=f"{name}: group 1 ||Δ||")
        bad = [e for e in ev if e["anomalous"]]
        if bad:
            ax2.scatter([e["step"] for e in bad], [e["pseudo_grad_norm"] for e in bad], marker="x", s=60,
                        color=colors[name], zorder=5, label=f"{name}: group 1 flagged (any module)")
    ax2.axvspan(a.start, a.end, color="orange", alpha=0.2)
    ax2.set_yscale("log")
    ax2.set_xlabel("step (sync)")
    ax2.set_ylabel("group 1 pseudo-gradient norm (whole model)")
    ax2.legend(fontsize=8)
    for x in (ax, ax2):
        x.grid(alpha=0.3)
    return C.save_fig(fig, path)


def run_seed(a: argparse.Namespace, seed: int) -> tuple[dict[str, Any], dict[str, C.Job]]:
    base, fault = common_overrides(a, seed), fault_spec(a)
    plan = {"clean": base, "faulty": [*base, fault], "penalty_off": [*base, fault, *PENALTY_OFF]}
    jobs = {n: C.run_job(f"{n} seed {seed}", a.workdir / f"seed{seed}" / n, ov, timeout=a.timeout,
                         reuse=a.reuse) for n, ov in plan.items()}
    for n, j in jobs.items():
        j.name = n
    clean = jobs["clean"].summary["final_val_loss"]
    rows = {}
    for name, job in jobs.items():
        s = job.summary
        rows[name] = {"run": name, "final_val_loss": s["final_val_loss"],
                      "ratio_vs_clean": s["final_val_loss"] / clean, "anomalies": s.get("anomalies"),
                      "anomalies_group1": s["per_cluster"][f"c{FAULT_GROUP}"].get("anomalies"),
                      "syncs": s.get("syncs"), "cross_group_bytes": s.get("cross_group_bytes"),
                      "job_wall_s": job.wall_s, "run_dir": job.run_dir}
    detection = {n: sync_table(j, a.start, a.end) for n, j in jobs.items()}
    r_f, r_off = rows["faulty"]["ratio_vs_clean"], rows["penalty_off"]["ratio_vs_clean"]
    tg = {"faulty_over_clean": r_f, "faulty_le_1.01x_clean": r_f <= 1.01,
          "penalty_off_over_clean": r_off, "penalty_off_worse_than_faulty": r_off > r_f,
          "penalty_off_minus_faulty": rows["penalty_off"]["final_val_loss"] - rows["faulty"]["final_val_loss"]}
    curves = {n: dict(zip(("step", "val_loss"), j.eval_curve())) for n, j in jobs.items()}
    return {"results": rows, "detection": detection, "targets": tg, "curves": curves,
            "overrides": {n: j.overrides for n, j in jobs.items()}}, jobs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    t0 = time.perf_counter()
    per_seed: dict[int, dict[str, Any]] = {}
    first: dict[str, C.Job] = {}
    for seed in a.seeds:
        per_seed[seed], jobs = run_seed(a, seed)
        first = first or jobs
    summary = {n: {"final_val_loss": spread([ps["results"][n]["final_val_loss"] for ps in per_seed.values()]),
                   "ratio_vs_clean": spread([ps["results"][n]["ratio_vs_clean"] for ps in per_seed.values()])}
               for n in ("clean", "faulty", "penalty_off")}
    every = lambda key: all(ps["targets"][key] for ps in per_seed.values())  # noqa: E731
    targets = {"faulty_le_1.01x_clean_every_seed": every("faulty_le_1.01x_clean"),
               "penalty_off_worse_than_faulty_every_seed": every("penalty_off_worse_than_faulty"),
               "faulty_over_clean_per_seed": [ps["targets"]["faulty_over_clean"] for ps in per_seed.values()],
               "penalty_off_over_clean_per_seed": [ps["targets"]["penalty_off_over_clean"]
                                                   for ps in per_seed.values()],
               "group1_flagged_in_window_per_seed": [ps["detection"]["faulty"]["recall"] for ps in per_seed.values()],
               "false_flags_clean_run_per_seed": [len(ps["detection"]["clean"]["flagged_syncs_group1"])
                                                  + len(ps["detection"]["clean"]["flagged_syncs_group0"])
                                                  for ps in per_seed.values()]}
    wall = time.perf_counter() - t0
    result = {
        "benchmark": "penalty_faults", "quick": a.quick,
        "setup": {"fault": a.fault, "factor": a.factor if a.fault == "lr_spike" else None, "group": FAULT_GROUP,
                  "window": [a.start, a.end], "steps": a.steps, "interval": a.interval,
                  "warmup_syncs": a.warmup_syncs, "detection_live_from_step": (a.warmup_syncs + 1) * a.interval,
                  "batch_size": a.batch_size, "seq_len": a.seq_len, "seeds": a.seeds},
        "summary": summary, "targets": targets, "per_seed": per_seed, "wall_s": wall, "env": C.environment(),
    }
    C.write_json(a.out, result)
    plot(first, a, a.plot)
    cols = [("run", "run", ""), ("final_val_loss", "val loss", ".4f"), ("ratio_vs_clean", "/clean", ".4f"),
            ("anomalies_group1", "g1 flags", ""), ("anomalies", "all flags", ""), ("syncs", "syncs", ""),
            ("job_wall_s", "job s", ".0f")]
    print(f"fault {a.fault} on group {FAULT_GROUP}, steps [{a.start}, {a.end}); detection live from step "
          f"{(a.warmup_syncs + 1) * a.interval} (W={a.warmup_syncs}, H={a.interval})")
    for seed, ps in per_seed.items():
        d, dc = ps["detection"]["faulty"], ps["detection"]["clean"]
        print(f"seed {seed}:")
        print(C.table(ps["results"].values(), cols))
        print(f"  syncs overlapping the window: {d['overlapping_syncs']}; group 1 flagged at {d['flagged_syncs_group1']}"
              f" (group-1-only {d['specific_syncs_group1']}); missed {d['missed']}; "
              f"outside the window: g1 {d['false_flags_group1']}, g0 {d['flagged_syncs_group0']}")
        print(f"  clean run: g1 flagged {dc['flagged_syncs_group1']}, g0 flagged {dc['flagged_syncs_group0']}")
    srows = [{"run": n, **{k: v["final_val_loss"][k] for k in ("mean", "std", "min", "max")},
              "ratio": v["ratio_vs_clean"]["mean"], "ratio_max": v["ratio_vs_clean"]["max"]}
             for n, v in summary.items()]
    print(f"across seeds {a.seeds} (total wall {wall / 60:.1f} min):")
    print(C.table(srows, [("run", "run", ""), ("mean", "val loss mean", ".4f"), ("std", "std", ".4f"),
                          ("min", "min", ".4f"), ("max", "max", ".4f"), ("ratio", "/clean mean", ".4f"),
                          ("ratio_max", "/clean max", ".4f")]))
    C.print_targets(targets, a.out, a.plot)
    return result


if __name__ == "__main__":
    main()
