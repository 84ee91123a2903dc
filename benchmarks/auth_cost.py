"""What authentication costs a sync: the seconds every cluster spent computing and checking HMAC-SHA256 tags
(`summary.json` per_cluster `auth_s`, measured inside the run by `federation.auth`) against the seconds its
syncs took (the `sync` + `blocked` time buckets, which contain them).

Runs (each with the run's own federation key, as every local run has):
  * demo      — plain `edit-train` (the default config: A-EDiT, two clusters of different speed over a
                simulated 100 Mbit/s, 50 ms link; the verified rule gathers both contributions);
  * gather3   — `algo=edit cluster.groups=3` on the raw loopback (no simulated link): every contribution of
                three clusters gathered and tagged, the worst case for the tags' share.

Target (issue 21): tags ≤ 1 % of a sync's time on the default demo.

    python benchmarks/auth_cost.py            # both runs, ~3 min on 2 cores
    python benchmarks/auth_cost.py --quick    # shorter runs
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _common as C

RUNS = {
    "demo": [],
    "gather3": ["algo=edit", "cluster=local", "cluster.groups=3", "cluster.shard_size=1", "algo.interval=8"],
}


def measure(summary: dict) -> dict:
    rows = {}
    for name, c in summary["per_cluster"].items():
        t = c.get("time", {})
        sync_s = float(t.get("sync", 0.0)) + float(t.get("blocked", 0.0))
        syncs = max(int(c["syncs"]), 1)
        rows[name] = {"auth_s": c["auth_s"], "sync_s": sync_s, "syncs": c["syncs"],
                      "auth_ms_per_sync": 1e3 * c["auth_s"] / syncs, "sync_ms_per_sync": 1e3 * sync_s / syncs,
                      "share": c["auth_s"] / sync_s if sync_s > 0 else None,
                      "bytes_per_sync": c["cross_group_bytes"] / syncs}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=C.RESULTS_DIR / "auth_cost.json")
    ap.add_argument("--workdir", type=Path, default=C.RUNS_DIR / "auth_cost")
    a = ap.parse_args()
    steps = ["train.steps=120"] if a.quick else []
    out: dict = {"setup": {"quick": a.quick, "env": C.environment()}, "runs": {}}
    for run, overrides in RUNS.items():
        run_dir = a.workdir / run
        C.run_job(run, run_dir, [*overrides, *steps, "train.eval_every=0"])
        rows = measure(C.read_summary(run_dir))
        out["runs"][run] = rows
        for name, r in rows.items():
            print(f"{run:8s} {name}: tags {r['auth_ms_per_sync']:.2f} ms/sync of {r['sync_ms_per_sync']:.1f} ms "
                  f"({100 * (r['share'] or 0):.3f} %), {r['bytes_per_sync'] / 1e6:.2f} MB/sync, {r['syncs']} syncs",
                  flush=True)
    worst = max(r["share"] or 0.0 for r in out["runs"]["demo"].values())
    out["targets"] = {"tags <= 1% of sync time (demo)": {"value": worst, "pass": worst <= 0.01}}
    C.write_json(a.out, out)
    print(f"target: tags ≤ 1 % of sync time on the demo: {100 * worst:.3f} % -> "
          f"{'pass' if worst <= 0.01 else 'FAIL'}; wrote {a.out}")


if __name__ == "__main__":
    main()
