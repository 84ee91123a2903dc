"""How fast `edit-train plan` plans: the default candidate set (5 algorithms × 3 modes × 4 compressions × 3
intervals + ddp = 145 candidates) over 100 simulated hours, for federations of 8 to 8,192 accelerators in 2 to 64
clusters (mixed H100 / A100 sites, 1 Gbit/s – 10 Gbit/s links, MTBF 5,000 h per accelerator). Prints, per
size, the wall seconds on one core, simulator events and events/s.

    python benchmarks/plan_scale.py --out results/plan_scale.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from edit_train.plan.planner import make_plan
from edit_train.plan.spec import scenario_from_dict

SIZES = [(2, 4), (4, 16), (8, 64), (16, 128), (64, 128)]  # (clusters, ranks per cluster): 8 .. 8,192


def scenario(clusters: int, ranks: int) -> dict:
    cl = [{"name": f"s{i}", "ranks": ranks, "accelerator": "h100" if i % 3 else "a100", "step_cv": 0.05,
           "p_slow": 0.001, "slow_factor": 3.0} for i in range(clusters)]
    links = {f"s{i}": {"bandwidth_mbps": 10000 if i % 2 else 1000, "latency_ms": 20 + 5 * (i % 7)}
             for i in range(clusters)}
    return {"name": f"{clusters}x{ranks}", "clusters": cl, "links": links, "model": "ling_1b", "batch_size": 4,
            "seq_len": 4096, "hours": 100, "failures": {"mtbf_h_per_accelerator": 5000, "restart_s": 600}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("results/plan_scale.json"))
    ap.add_argument("--quick", action="store_true", help="the three smallest sizes only")
    a = ap.parse_args()
    rows = []
    for clusters, ranks in SIZES[:3] if a.quick else SIZES:
        scn = scenario_from_dict(scenario(clusters, ranks))
        t0 = time.process_time()
        plan = make_plan(scn)
        cpu = time.process_time() - t0
        rows.append({"clusters": clusters, "accelerators": clusters * ranks, "candidates": len(plan.rows),
                     "wall_s": plan.elapsed_s, "cpu_s": cpu, "events": plan.events,
                     "cluster_steps": plan.cluster_steps, "events_per_s": plan.events_per_s,
                     "best": plan.best.cand.label})
        r = rows[-1]
        print(f"{clusters:3d} clusters, {clusters * ranks:5d} accelerators: {r['candidates']} candidates in "
              f"{r['wall_s']:.1f} s wall ({cpu:.1f} s CPU), {r['events']:,} events ({r['events_per_s']:,.0f}/s); "
              f"best {r['best']}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"benchmark": "plan_scale", "horizon_h": 100, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
