"""The first held-out numbers: the planner *as it was when the split was committed* (6341d1b) predicting the runs
`plan_validation.py` made (run that first), calibrated as it was then (`_plan_sets.FIRST_CALIBRATION`: EDiT at
100 Mbit/s with none and int8, ddp at 500 Mbit/s; run here if missing). Run it with that commit's package first
on the path:

    git archive 6341d1b edit_train | tar -x -C /tmp/first
    PYTHONPATH=/tmp/first python benchmarks/_plan_first.py --out results/plan_validation_first.json

Only the old API is used (`Candidate(algo, mode, compression, interval, sync_time_s)`, `scenario_of_run`,
`calibrate`); a configuration it cannot predict (top-k) is recorded with its error.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import _common as C
import _plan_sets as S

from edit_train.plan.calibrate import calibrate, read_run, scenario_of_run
from edit_train.plan.costs import resolve
from edit_train.plan.loss import default_model
from edit_train.plan.planner import evaluate
from edit_train.plan.spec import Candidate, scenario_from_dict

def candidate(cfg: dict) -> Candidate:
    algo, sy = cfg["algo"], cfg["sync"]
    name = algo["name"]
    return Candidate(name, sy["mode"], sy["compression"], int(algo["interval"]),
                     float(algo["sync_time_s"]) if name == "a_edit" else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the runs of plan_validation.py --quick")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("results/plan_validation_first.json"))
    a = ap.parse_args()
    a.workdir = a.workdir or (C.RUNS_DIR / "plan_validation" / ("quick" if a.quick else ""))
    import edit_train

    cal = [C.run_job(n, a.workdir / n, [*o, *S.workload(a.quick)], timeout=1800, reuse=True)
           for n, o in S.FIRST_CALIBRATION.items()]
    prof = calibrate([j.run_dir for j in cal])
    out = {"planner": str(Path(edit_train.__file__).parent), "quick": a.quick, "environment": C.environment(),
           "sets": {}}
    for set_name, configs in (("fitting", S.FITTING), ("held_out", S.HELD_OUT)):
        rows = []
        for name in configs:
            rd = a.workdir / name
            if not (rd / "summary.json").exists():
                continue
            run = read_run(rd)
            s = run.summary
            meas_b = max(float(pc["time"]["blocked"]) / float(pc["time"]["wall_s"]) for pc in s["per_cluster"].values())
            row = {"name": name, "measured_tokens_per_s": s["tokens_per_s"], "measured_blocked": meas_b,
                   "measured_goodput": s.get("goodput")}
            try:
                raw = scenario_of_run(run, prof, host_cores=len(os.sched_getaffinity(0)))
                if name in S.HOSTS:
                    raw["link"], raw["simulated_link"] = {"bandwidth_mbps": S.HOSTS[name], "latency_ms": 0.0}, False
                cand = candidate(run.config)
                scn = scenario_from_dict({**raw, "candidates": {"algos": [cand.algo]}})
                fed = resolve(scn, prof)
                rs = [evaluate(scn, fed, cand, default_model(fed.facts.total_params), seed=k) for k in range(3)]
                tps = sum(r.tokens_per_s for r in rs) / 3
                blk = max(sum(r.blocked[n] for r in rs) / 3 for n in rs[0].blocked)
                gp = sum(r.goodput for r in rs) / 3
                row.update({"predicted_tokens_per_s": tps, "predicted_blocked": blk, "predicted_goodput": gp,
                            "tokens_per_s_err": tps / s["tokens_per_s"] - 1, "blocked_err_points": 100 * (blk - meas_b),
                            "goodput_err_points": 100 * (gp - float(s.get("goodput") or 0))})
            except Exception as exc:  # noqa: BLE001 - the old planner's failure is the finding
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "name"})
        ok = [r for r in rows if "error" not in r]
        med = lambda k: statistics.median(abs(r[k]) for r in ok) if ok else None  # noqa: E731
        out["sets"][set_name] = {"rows": rows, "failed": [r["name"] for r in rows if "error" in r],
                                 "median_abs_tokens_per_s_err": med("tokens_per_s_err"),
                                 "median_abs_blocked_err_points": med("blocked_err_points"),
                                 "median_abs_goodput_err_points": med("goodput_err_points")}
    C.write_json(a.out, out)


if __name__ == "__main__":
    sys.exit(main())
