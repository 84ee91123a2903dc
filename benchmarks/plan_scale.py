"""How fast `edit-train plan` plans: the default candidate set (5 algorithms × 3 modes × 4 compressions × 3
intervals + ddp = 145 candidates) over 100 simulated hours, for federations of 8 to 8,192 accelerators in 2 to 64
clusters (mixed H100 / A100 sites, 1 Gbit/s – 10 Gbit/s links, MTBF 5,000 h per accelerator). Prints, per
size, the wall seconds on one core, simulator events and events/s.

    python benchmarks/plan_scale.py --out results/plan_scale.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from edit_train.plan.planner import make_plan  # noqa: E402
from edit_train.plan.spec import scenario_from_dict  # noqa: E402

SIZES = [(2, 4), (4, 16), (8, 64), (16, 128), (64, 128)]  # (clusters, ranks per cluster): 8 .. 8,192


def scenario(clusters: int, ranks: int, hours: float = 100) -> dict:
    cl = [{"name": f"s{i}", "ranks": ranks, "accelerator": "h100" if i % 3 else "a100", "step_cv": 0.05,
           "p_slow": 0.001, "slow_factor": 3.0} for i in range(clusters)]
    links = {f"s{i}": {"bandwidth_mbps": 10000 if i % 2 else 1000, "latency_ms": 20 + 5 * (i % 7)}
             for i in range(clusters)}
    return {"name": f"{clusters}x{ranks}", "clusters": cl, "links": links, "model": "ling_1b", "batch_size": 4,
            "seq_len": 4096, "hours": hours, "failures": {"mtbf_h_per_accelerator": 5000, "restart_s": 600}}


def main() -> None:
    ap = C.parser(__doc__, out="plan_scale.json")
    ap.add_argument("--quick", action="store_true", help="the three smallest sizes only")
    a = C.parse(ap)
    rows, hours = [], 0.02 if a.smoke else 100  # --smoke: the smallest size over 72 simulated seconds
    for clusters, ranks in SIZES[:1] if a.smoke else SIZES[:3] if a.quick else SIZES:
        scn = scenario_from_dict(scenario(clusters, ranks, hours))
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
    out = C.write_json(a.out, {"benchmark": "plan_scale", "horizon_h": hours, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
