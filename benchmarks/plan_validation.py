"""Validate `edit-train plan` against real runs it was never fitted to: calibrate on the fitting set's calibration
runs, predict every configuration of the fitting and the held-out set (`_plan_sets.py`; the split and the rule
that keeps them apart: docs/planner.md), run them, and report predicted vs measured tokens/s, worst-cluster
blocked fraction and goodput — and the pairs of configurations ranked right by tokens/s — for each set apart.

    python benchmarks/plan_validation.py --out results/plan_validation.json     # 30 runs, ~45-50 min on a quiet 2-core box
    python benchmarks/plan_validation.py --quick --out /tmp/pv.json           # 48-step runs of 12 + 3, ~10 min
    python benchmarks/plan_validation.py --sets held_out --only h_ddp_3 ...   # some of them (cached runs reused)

Every run directory is kept under `--workdir` and reused when it finished with the same arguments, so a rerun is
partial: delete a run's directory (or pass `--fresh NAME...`) to measure it again. Each run records the host's
load average and a micro-benchmark's speed before and after it (`bench_load.json`), and the JSON carries them:
timings from a loaded box are not the planner's error. The profile is calibrated from the CALIBRATION runs with
the codec timed on this host (`edit_train/cli/codec_cost.py`) and the host's conditions recorded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common as C
import _plan_sets as S
from _hosts_run import run_on_hosts

from edit_train.cli.codec_cost import compile_seconds, time_codec, time_codecs
from edit_train.codec import compiled
from edit_train.plan import conditions
from edit_train.plan.calibrate import calibrate, candidate_of_run, codec_of_run, read_run, scenario_of_run
from edit_train.plan.costs import resolve
from edit_train.plan.loss import default_model
from edit_train.plan.planner import evaluate
from edit_train.plan.spec import CandidateSet, Scenario, TopK, scenario_from_dict, topk_codec

SEEDS = 3  # simulator seeds per prediction (their mean)


def common(a: argparse.Namespace) -> list[str]:
    return S.workload(a.quick, a.seed)


def run(name: str, overrides: list[str], a: argparse.Namespace) -> C.Job:
    """The run of configuration `name` (reused when finished with the same arguments), its load recorded."""
    run_dir = a.workdir / name
    if name in a.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    before = conditions.measure()
    compiled_before = sorted(compiled.compiled())  # top-k formats whose kernels this run need not compile
    t0 = time.time()
    if name in S.HOSTS:
        job = run_on_hosts(name, run_dir, [*overrides, *common(a)], S.HOSTS[name], timeout=a.timeout)
    else:
        job = C.run_job(name, run_dir, [*overrides, *common(a)], timeout=a.timeout, reuse=True)
    if (run_dir / "bench_job.json").stat().st_mtime >= t0:  # it ran now (a reused run keeps its own record)
        (run_dir / "bench_load.json").write_text(json.dumps({"before": before.to_json(),
                                                             "after": conditions.measure().to_json(),
                                                             "compiled_before": compiled_before}))
    return job


def run_load(job: C.Job) -> dict[str, Any]:
    p = job.run_dir / "bench_load.json"
    return json.loads(p.read_text()) if p.exists() else {}


def measured(job: C.Job) -> dict:
    s = job.summary
    blocked = {n: float(pc["time"]["blocked"]) / max(float(pc["time"]["wall_s"]), 1e-9)
               for n, pc in s["per_cluster"].items()}
    return {"tokens_per_s": float(s["tokens_per_s"]), "blocked_frac": blocked, "goodput": float(s.get("goodput") or 0)}


def predict(job: C.Job, prof, name: str, own_steps: bool = False) -> dict:
    """The planner's prediction of run `job`. `own_steps` (a diagnostic, not the validation): every cluster's
    step time is the one it measured in this run (contention and the host's load included), so what remains
    is the sync, blocking and failure model alone."""
    rd = read_run(job.run_dir)
    real = {"bandwidth_mbps": S.HOSTS[name], "latency_ms": 0.0} if name in S.HOSTS else None
    cores = len(os.sched_getaffinity(0))
    if own_steps:
        own, cores = calibrate([job.run_dir], codec=prof.codec, conditions=prof.taken_under(),
                                compile_s=prof.codec_compile_s), 0
    raw = scenario_of_run(rd, prof, host_cores=cores, real_link=real)
    # the top-k formats this host had compiled when the run started (its start-up paid for any other)
    raw["compiled"] = run_load(job).get("compiled_before", sorted(compiled.compiled()))
    if own_steps:  # every cluster's own measured step (its slowdown is applied again by the scenario)
        for c in raw["clusters"]:
            d = own.clusters[c["name"]]
            c["step_s"], c["step_cv"] = d.dist.median_s / max(d.slowdown, 1e-9), d.dist.sigma
    cand = candidate_of_run(rd)
    scn = scenario_from_dict({**raw, "candidates": {"algos": [cand.algo]}})
    fed = resolve(scn, prof)
    rows = [evaluate(scn, fed, cand, default_model(fed.facts.total_params), seed=s) for s in range(SEEDS)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"candidate": cand.label, "tokens_per_s": mean([r.tokens_per_s for r in rows]),
            "blocked_frac": {n: mean([r.blocked[n] for r in rows]) for n in rows[0].blocked},
            "goodput": mean([r.goodput for r in rows]), "events": sum(r.sim.events for r in rows if r.sim)}


def compare(name: str, job: C.Job, prof, own_steps: bool = False) -> dict[str, Any]:
    m, p = measured(job), predict(job, prof, name, own_steps)
    bm, bp = max(m["blocked_frac"].values()), max(p["blocked_frac"].values())
    load = run_load(job)
    during = conditions.Conditions.from_json(load.get("before"))
    return {"name": name, "candidate": p["candidate"], "real_link": name in S.HOSTS, "predicted": p, "measured": m,
            "tokens_per_s_err": p["tokens_per_s"] / m["tokens_per_s"] - 1,
            "blocked_err_points": 100 * (bp - bm), "goodput_err_points": 100 * (p["goodput"] - m["goodput"]),
            "load": load, "run_wall_s": job.wall_s,
            # what `edit-train plan check` would have said when this run started
            "calibration_stale": conditions.stale(prof.taken_under(), during) if during else None}


def calibration_conditions(cal: list[C.Job]) -> conditions.Conditions:
    """The host while the calibration runs ran: the mean of their recorded loads and probe speeds (what a
    profile should carry), or the host now when they recorded none."""
    recs = [conditions.Conditions.from_json(r) for j in cal for r in (run_load(j).get("before"), run_load(j).get("after"))]
    recs = [r for r in recs if r is not None]
    if not recs:
        return conditions.measure()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return conditions.Conditions(mean([r.load_1m for r in recs]), mean([r.load_5m for r in recs]), recs[0].cpu_count,
                                 recs[0].cores, mean([r.speed for r in recs]), recs[0].taken_at)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    pairs = list(itertools.combinations(rows, 2))
    agree = sum((x["predicted"]["tokens_per_s"] > y["predicted"]["tokens_per_s"])
                == (x["measured"]["tokens_per_s"] > y["measured"]["tokens_per_s"]) for x, y in pairs)
    med = lambda k: statistics.median(abs(r[k]) for r in rows) if rows else None  # noqa: E731
    fresh = [r for r in rows if not r.get("calibration_stale")]
    return {"configurations": len(rows), "median_abs_tokens_per_s_err": med("tokens_per_s_err"),
            "stale_calibration": len(rows) - len(fresh),
            "median_abs_tokens_per_s_err_where_calibration_held": statistics.median(
                abs(r["tokens_per_s_err"]) for r in fresh) if fresh else None,
            "median_abs_blocked_err_points": med("blocked_err_points"),
            "median_abs_goodput_err_points": med("goodput_err_points"),
            "ranking_pairs_correct": agree, "ranking_pairs": len(pairs),
            "ranking_frac": agree / len(pairs) if pairs else None, "rows": rows}


def line(r: dict[str, Any]) -> str:
    p, m = r["predicted"], r["measured"]
    bm, bp = max(m["blocked_frac"].values()), max(p["blocked_frac"].values())
    return (f"{r['name']:48s} tok/s pred {p['tokens_per_s']:7.0f} meas {m['tokens_per_s']:7.0f} "
            f"({r['tokens_per_s_err']:+6.1%})  blocked {bp:5.1%} vs {bm:5.1%} ({r['blocked_err_points']:+5.1f} pt)  "
            f"goodput {p['goodput']:.3f} vs {m['goodput']:.3f} ({r['goodput_err_points']:+5.1f} pt)")


def codecs_to_time(cal_runs: list[C.Job]) -> list:
    """The codecs of the calibration runs and of the planner's default candidates (none of the held-out's)."""
    base = Scenario("codecs", [])
    out = [codec_of_run(read_run(j.run_dir).config) for j in cal_runs]
    out += [c for scheme in ("bf16", "int8", "fp8") for c in [codec_of_run({"sync": {"compression": scheme}})]]
    out += [topk_codec(base, TopK(**t)) for t in CandidateSet().topk]
    return out


def main() -> None:
    ap = C.parser(__doc__, out="plan_validation.json", timeout=1800.0)
    ap.add_argument("--quick", action="store_true", help="48 steps per run, batch 4 x 64, a subset (_plan_sets.QUICK)")
    ap.add_argument("--workdir", type=Path, default=None, help="run directories (default benchmarks/results/runs/"
                    "plan_validation, /quick for --quick)")
    ap.add_argument("--sets", default="fitting,held_out", help="which sets to run and predict (calibration always)")
    ap.add_argument("--only", nargs="*", default=None, help="configurations to do (default: every one of --sets)")
    ap.add_argument("--fresh", nargs="*", default=[], help="configurations to measure again (their run dirs deleted)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--own-steps", action="store_true", help="diagnostic: predict with each run's own measured "
                    "step times (separates the sync model from the host's load); not the validation")
    a = C.parse(ap)
    a.workdir = a.workdir or (C.smoke_dir("runs") if a.smoke else
                              C.RUNS_DIR / "plan_validation" / ("quick" if a.quick else ""))
    if a.smoke:  # the calibration, then one held-out configuration on this host
        a.quick, a.sets, a.only = True, "held_out", a.only or [n for n in S.HELD_OUT if n not in S.HOSTS][:1]
    a.fresh = set(a.fresh)
    t0 = time.perf_counter()
    start = conditions.measure()
    cal = [run(n, o, a) for n, o in S.CALIBRATION.items()]
    timed = codecs_to_time(cal)
    if a.smoke:  # the calibration runs' codecs at two small sizes; no top-k format compiled (tens of seconds)
        codec = {c.label: time_codec(c, sizes=(1024, 4096), reps=2) for c in timed[:len(cal)] if c.lossy}
        compile_s = 0.0
    else:
        codec = time_codecs(timed)
        compile_s = compile_seconds(next(c for c in timed if c.sparse))
    # the fitting set's calibration runs, nothing else; the host's conditions while they ran
    prof = calibrate([j.run_dir for j in cal], codec=codec, conditions=calibration_conditions(cal),
                     compile_s=compile_s)
    prof.save(a.workdir / "profile.json")
    print(f"calibrated: per_op {prof.per_op_s * 1e3:.1f} ms, sw {prof.sw_bytes_per_s / 1e6:.0f} MB/s, step "
          f"{prof.rank_step.median_s * 1e3:.0f} ms (log-σ {prof.rank_step.sigma:.2f}); codec timed for "
          f"{', '.join(codec)}; a new top-k format compiles in {compile_s:.1f} CPU-s", flush=True)
    sets = {"fitting": S.FITTING, "held_out": S.HELD_OUT}
    result: dict[str, Any] = {"benchmark": "plan_validation", "quick": a.quick, "own_steps": a.own_steps,
                              "command": " ".join(sys.argv),
                              "environment": C.environment(), "load_at_start": start.to_json(),
                              "calibration_runs": {n: {"overrides": o, "load": run_load(j)}
                                                   for (n, o), j in zip(S.CALIBRATION.items(), cal)},
                              "profile": {"conditions": prof.conditions, "fit": prof.fit, "codec": prof.codec},
                              "sets": {}}
    for set_name in [s for s in a.sets.split(",") if s]:
        names = [n for n in sets[set_name] if (n in a.only if a.only is not None else not a.quick or n in S.QUICK)]
        rows = []
        for name in names:
            try:
                job = run(name, sets[set_name][name], a)
            except C.JobError as exc:
                print(f"{name}: FAILED — {str(exc).splitlines()[0]}", flush=True)
                continue
            rows.append(compare(name, job, prof, a.own_steps))
            print(line(rows[-1]), flush=True)
            if rows[-1]["calibration_stale"]:
                print(f"    {rows[-1]['calibration_stale']}", flush=True)
        result["sets"][set_name] = summarize(rows)
    result["load_at_end"] = conditions.measure().to_json()
    result["wall_s"] = time.perf_counter() - t0
    for set_name, res in result["sets"].items():
        if res["rows"]:
            print(f"{set_name} ({res['configurations']} configurations): median |error| tokens/s "
                  f"{res['median_abs_tokens_per_s_err']:.1%}, blocked {res['median_abs_blocked_err_points']:.1f} pt, "
                  f"goodput {res['median_abs_goodput_err_points']:.1f} pt; ranking {res['ranking_pairs_correct']}/"
                  f"{res['ranking_pairs']} pairs")
    print(f"load average {start.load_1m:.1f} at the start, {result['load_at_end']['load_1m']:.1f} at the end "
          f"({start.cores} cores)")
    C.write_json(a.out, result)
    _plot(result["sets"], a.out.with_suffix(".png"))


def _plot(sets: dict[str, dict[str, Any]], path: Path) -> None:
    fig, (ax, bx) = C.pyplot().subplots(1, 2, figsize=(11, 4.8))
    style = {"fitting": ("o", "tab:gray"), "held_out": ("^", "tab:red")}
    for set_name, res in sets.items():
        marker, color = style.get(set_name, ("s", "tab:blue"))
        for i, r in enumerate(res["rows"]):
            label = set_name.replace("_", "-") if i == 0 else None
            ax.scatter(r["measured"]["tokens_per_s"], r["predicted"]["tokens_per_s"], marker=marker, c=color,
                       label=label)
            if set_name == "held_out":
                ax.annotate(r["name"].removeprefix("h_"), (r["measured"]["tokens_per_s"],
                                                           r["predicted"]["tokens_per_s"]), fontsize=6)
            bx.scatter(100 * max(r["measured"]["blocked_frac"].values()),
                       100 * max(r["predicted"]["blocked_frac"].values()), marker=marker, c=color)
    for x, label in ((ax, "tokens/s"), (bx, "worst cluster blocked %")):
        lo, hi = x.get_xlim()
        x.plot([0, hi], [0, hi], "k--", lw=0.8)
        x.set_xlabel(f"measured {label}")
        x.set_ylabel(f"predicted {label}")
    ax.legend(fontsize=8)
    C.save_fig(fig, path)


if __name__ == "__main__":
    sys.exit(main())
