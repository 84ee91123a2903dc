"""Validate `edit-train plan` against real runs: calibrate on some local runs, predict *other* configurations
with the simulator, run them, and print predicted vs measured tokens/s, blocked fraction and goodput with the
errors (and the pairwise ranking of the configurations by tokens/s).

    python benchmarks/plan_validation.py --out docs/plan_validation.json   # 14 runs, ~15 min on 2 cores
    python benchmarks/plan_validation.py --quick --out /tmp/pv.json         # 48-step runs, ~6 min, noisier

Calibration runs: EDiT at_end on two 1-rank clusters over a simulated 100 Mbit/s, 50 ms link with
`sync.compression=none` and `int8` (two message sizes for the per-op / per-byte sync fit), and ddp over a
500 Mbit/s, 20 ms link (its per-step quorum round). Validation runs
differ in algorithm, sync mode, compression, cluster count, slowdowns, link and (one) a kill.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import _common as C

from edit_train.plan.calibrate import calibrate, read_run, scenario_of_run
from edit_train.plan.planner import evaluate
from edit_train.plan.costs import resolve
from edit_train.plan.loss import default_model
from edit_train.plan.spec import Candidate, scenario_from_dict

LINK = ["cluster.link.bandwidth_mbps=100", "cluster.link.latency_ms=50"]
CALIB = {
    "cal_edit_none": ["algo=edit", "cluster=local_2x1", "sync.mode=at_end", "sync.compression=none",
                      "algo.interval=8", *LINK],
    "cal_edit_int8": ["algo=edit", "cluster=local_2x1", "sync.mode=at_end", "sync.compression=int8",
                      "algo.interval=8", *LINK],
    # ddp's per-step quorum round (a link none of the validation runs uses)
    "cal_ddp": ["algo=ddp", "cluster=local_2x1", "cluster.link.bandwidth_mbps=500", "cluster.link.latency_ms=20"],
}
VALID = {  # name -> (overrides, candidate)
    "ddp_2": (["algo=ddp", "cluster=local_2x1", *LINK], Candidate("ddp", "layerwise")),
    "diloco_at_end_2_slow": (["algo=diloco", "cluster=hetero_2x1", "sync.mode=at_end", "algo.interval=8"],
                             Candidate("diloco", "at_end", "none", 8)),
    "edit_layerwise_2_bf16": (["algo=edit", "cluster=local_2x1", "sync.mode=layerwise", "sync.compression=bf16",
                               "algo.interval=16", "cluster.link.bandwidth_mbps=20", "cluster.link.latency_ms=100"],
                              Candidate("edit", "layerwise", "bf16", 16)),
    "a_edit_at_end_2_slow": (["algo=a_edit", "cluster=hetero_2x1", "sync.mode=at_end", "algo.sync_time_s=2"],
                             Candidate("a_edit", "at_end", "none", 8, 2.0)),
    "edit_at_end_3": (["algo=edit", "cluster=local", "cluster.groups=3", "cluster.shard_size=1", "sync.mode=at_end",
                       "algo.interval=8", *LINK], Candidate("edit", "at_end", "none", 8)),
    "post_local_sgd_overlap_2": (["algo=post_local_sgd", "cluster=local_2x1", "sync.mode=overlap",
                                  "algo.interval=8", *LINK], Candidate("post_local_sgd", "overlap", "none", 8)),
    "ddp_2_slow": (["algo=ddp", "cluster=hetero_2x1", "cluster.link.bandwidth_mbps=1000",
                    "cluster.link.latency_ms=5"], Candidate("ddp", "layerwise")),
    "edit_overlap_2": (["algo=edit", "cluster=local_2x1", "sync.mode=overlap", "algo.interval=8", *LINK],
                       Candidate("edit", "overlap", "none", 8)),
    "diloco_layerwise_3_int8": (["algo=diloco", "cluster=local", "cluster.groups=3", "cluster.shard_size=1",
                                 "sync.mode=layerwise", "sync.compression=int8", "algo.interval=8", *LINK],
                                Candidate("diloco", "layerwise", "int8", 8)),
    "a_edit_overlap_2_slow": (["algo=a_edit", "cluster=hetero_2x1", "sync.mode=overlap", "algo.sync_time_s=2"],
                              Candidate("a_edit", "overlap", "none", 8, 2.0)),
    "edit_at_end_4": (["algo=edit", "cluster=local", "cluster.groups=4", "cluster.shard_size=1", "sync.mode=at_end",
                       "algo.interval=16", "cluster.link.bandwidth_mbps=50", "cluster.link.latency_ms=20"],
                      Candidate("edit", "at_end", "none", 16)),
    "edit_at_end_2_kill": (["algo=edit", "cluster=local_2x1", "sync.mode=at_end", "algo.interval=8", *LINK,
                            "faults=[{kind:kill_cluster,cluster:c1,step:20}]", "run.max_restarts=1",
                            "run.restart_delay_s=2"], Candidate("edit", "at_end", "none", 8)),
}


def common(a: argparse.Namespace) -> list[str]:
    return ["model=tiny", f"train.steps={a.steps}", f"train.batch_size={a.batch}", f"train.seq_len={a.seq}",
            "train.eval_every=0", "train.eval_batches=2", f"train.log_every={a.log_every}", "algo.warmup_steps=0",
            f"seed={a.seed}"]


def measured(job: C.Job) -> dict:
    s = job.summary
    blocked = {n: float(pc["time"]["blocked"]) / max(float(pc["time"]["wall_s"]), 1e-9)
               for n, pc in s["per_cluster"].items()}
    return {"tokens_per_s": float(s["tokens_per_s"]), "blocked_frac": blocked, "goodput": float(s.get("goodput") or 0)}


def predict(job: C.Job, prof, cand: Candidate) -> dict:
    raw = scenario_of_run(read_run(job.run_dir), prof, host_cores=len(os.sched_getaffinity(0)))
    scn = scenario_from_dict({**raw, "candidates": {"algos": [cand.algo]}})
    fed = resolve(scn, prof)
    rows = [evaluate(scn, fed, cand, default_model(fed.facts.total_params), seed=s) for s in range(3)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"tokens_per_s": mean([r.tokens_per_s for r in rows]),
            "blocked_frac": {n: mean([r.blocked[n] for r in rows]) for n in rows[0].blocked},
            "goodput": mean([r.goodput for r in rows]), "events": sum(r.sim.events for r in rows if r.sim)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="48 steps per run, batch 4 x 64")
    ap.add_argument("--out", type=Path, default=Path("docs/plan_validation.json"))
    ap.add_argument("--workdir", type=Path, default=C.RUNS_DIR / "plan_validation")
    ap.add_argument("--only", nargs="*", default=None, help="validation runs to do (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.steps, a.batch, a.seq, a.log_every = (48, 4, 64, 8) if a.quick else (160, 8, 128, 10)
    t0 = time.perf_counter()
    cal = [C.run_job(n, a.workdir / n, [*o, *common(a)], timeout=900, reuse=True) for n, o in CALIB.items()]
    prof = calibrate([j.run_dir for j in cal])
    prof.save(a.workdir / "profile.json")
    print(f"calibrated: per_op {prof.per_op_s * 1e3:.1f} ms, sw {prof.sw_bytes_per_s / 1e6:.0f} MB/s, step "
          f"{prof.rank_step.median_s * 1e3:.0f} ms (log-σ {prof.rank_step.sigma:.2f}), eval {prof.eval_s:.2f} s",
          flush=True)
    rows = []
    for name in a.only or list(VALID):
        over, cand = VALID[name]
        job = C.run_job(name, a.workdir / name, [*over, *common(a)], timeout=900, reuse=True)
        m, p = measured(job), predict(job, prof, cand)
        bm, bp = max(m["blocked_frac"].values()), max(p["blocked_frac"].values())
        rows.append({"name": name, "candidate": cand.label, "predicted": p, "measured": m,
                     "tokens_per_s_err": p["tokens_per_s"] / m["tokens_per_s"] - 1,
                     "blocked_err_points": 100 * (bp - bm),
                     "goodput_err_points": 100 * (p["goodput"] - m["goodput"])})
        r = rows[-1]
        print(f"{name:26s} tok/s pred {p['tokens_per_s']:7.0f} meas {m['tokens_per_s']:7.0f} "
              f"({r['tokens_per_s_err']:+.1%})  blocked pred {bp:5.1%} meas {bm:5.1%} "
              f"({r['blocked_err_points']:+.1f} pt)  goodput pred {p['goodput']:.3f} meas {m['goodput']:.3f} "
              f"({r['goodput_err_points']:+.1f} pt)", flush=True)
    pairs = list(itertools.combinations(rows, 2))
    agree = sum((x["predicted"]["tokens_per_s"] > y["predicted"]["tokens_per_s"])
                == (x["measured"]["tokens_per_s"] > y["measured"]["tokens_per_s"]) for x, y in pairs)
    med = lambda k: statistics.median(abs(r[k]) for r in rows) if rows else None  # noqa: E731
    result = {"benchmark": "plan_validation", "quick": a.quick, "environment": C.environment(),
              "calibration_runs": list(CALIB), "profile_fit": prof.fit, "rows": rows,
              "median_abs_tokens_per_s_err": med("tokens_per_s_err"),
              "median_abs_blocked_err_points": med("blocked_err_points"),
              "median_abs_goodput_err_points": med("goodput_err_points"),
              "ranking_pairs_correct": f"{agree}/{len(pairs)}", "wall_s": time.perf_counter() - t0}
    print(f"median |error|: tokens/s {result['median_abs_tokens_per_s_err']:.1%}, blocked "
          f"{result['median_abs_blocked_err_points']:.1f} pt, goodput {result['median_abs_goodput_err_points']:.1f} pt; "
          f"ranking {agree}/{len(pairs)} pairs")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    _plot(rows, a.out.with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.5))
    for r in rows:
        ax.scatter(r["measured"]["tokens_per_s"], r["predicted"]["tokens_per_s"])
        ax.annotate(r["name"], (r["measured"]["tokens_per_s"], r["predicted"]["tokens_per_s"]), fontsize=7)
        bx.scatter(100 * max(r["measured"]["blocked_frac"].values()),
                   100 * max(r["predicted"]["blocked_frac"].values()))
    for x, label in ((ax, "tokens/s"), (bx, "worst cluster blocked %")):
        lo, hi = x.get_xlim()
        x.plot([0, hi], [0, hi], "k--", lw=0.8)
        x.set_xlabel(f"measured {label}")
        x.set_ylabel(f"predicted {label}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
