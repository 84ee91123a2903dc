"""Verified aggregation at 6 and 8 clusters, multi-process (issue 36): are Byzantine clusters left out, what
does a sync move, and does a rule that judges nothing move only a SUM?

For every cluster count N (`cluster=local cluster.count=N`, one rank each, `model=tiny`, `algo=edit`: the
`verified` rule, layer-wise, H = `--interval`), a clean run and, for every payload fault kind (`sign_flip`,
`random_direction`, `lie_norm`, `nan_payload`) and 1 and 2 faulty clusters (c1, c1+c2), a run with the fault on
for steps [start, end) (the norm and direction tests warm by then). Per run:

* the faulty clusters' share of window syncs in which they weigh 0 (target >= 90 %); the honest clusters'
  share of module decisions that left them out (target <= 1 %); every anchor finite at the end;
* how each sync moved the contributions (`aggregation`: sketched / gathered) and its bytes per cluster against
  a ring all-reduce of the same model, 2(N−1)/N · 4n (target <= 1.25 × in clean runs at 8 clusters);
* plus `algo=diloco` at 4 clusters (the `uniform` rule: a SUM), its bytes per sync against the ring's (target
  within 5 %).

    python benchmarks/aggregation_scale.py --quick    # N=6: clean, sign_flip and nan_payload with 1 faulty; diloco
    python benchmarks/aggregation_scale.py            # N=6,8 × (clean + 4 kinds × 1, 2 faulty) + diloco at 4

JSON to `--out` (results/aggregation_scale.json) and a printed table; runs are kept in --workdir (`--reuse`).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

KINDS = ("sign_flip", "random_direction", "lie_norm", "nan_payload")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = C.parser(__doc__, out="aggregation_scale.json", workdir="aggregation_scale", reuse=True, timeout=3600.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clusters", type=int, nargs="+", default=None)
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=None)
    ap.add_argument("--faulty", type=int, nargs="+", default=None, help="faulty cluster counts (default 1 2)")
    ap.add_argument("--steps", type=int, default=144)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--warmup-syncs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    a = C.parse(ap, argv)
    a.quick = a.quick or a.smoke
    a.clusters = a.clusters or ([6] if a.quick else [6, 8])
    a.kinds = a.kinds or (["sign_flip", "nan_payload"] if a.quick else list(KINDS))
    a.faulty = a.faulty or ([] if a.smoke else [1] if a.quick else [1, 2])  # a smoke has no faults: no faulty runs
    a.start = (a.warmup_syncs + 2) * a.interval
    a.end = a.start + 8 * a.interval
    return a


def overrides(a: argparse.Namespace, n: int, algo: str = "edit") -> list[str]:
    return ["model=tiny", f"algo={algo}", "cluster=local", f"cluster.count={n}", "cluster.ranks=1",
            "checkpoint.at_end=true", "train.spike_factor=0", f"train.steps={a.steps}",
            f"train.batch_size={a.batch_size}", f"train.seq_len={a.seq_len}", "train.eval_every=0",
            "train.eval_batches=2", f"algo.interval={a.interval}", "algo.warmup_steps=0",
            f"algo.rule.verified.warmup_syncs={a.warmup_syncs}", "federation.join_timeout_s=30"]


def fault(a: argparse.Namespace, kind: str, faulty: int) -> str:
    specs = ",".join(f"{{kind:{kind},cluster:{g},start:{a.start},end:{a.end}}}" for g in range(1, faulty + 1))
    return f"faults=[{specs}]"


def measure(job: C.Job, n: int, faulty: list[str], a: argparse.Namespace) -> dict[str, Any]:
    syncs = job.events("sync")
    window = [e for e in syncs if e["cluster"] in faulty and a.start <= e["step"] < a.end]
    honest = [e for e in syncs if e["cluster"] not in faulty]
    units = len(C.anchor_check(job.run_dir)[2])  # the sync units (modules), from the anchors' names
    per_cluster = [e["bytes"] for e in syncs if e["cluster"] == "c0"]
    return {
        "faulty_zero": sum(e["weight"] == 0.0 for e in window) / len(window) if window else None,
        "window_syncs": len(window),
        "honest_left_out": sum(len(e.get("anomalous_modules", [])) for e in honest),
        "honest_checks": len(honest) * units,
        "modes": sorted({e.get("aggregation", "?") for e in syncs}),
        "regathered": sum(e.get("aggregation") == "gathered" for e in syncs if e["cluster"] == "c0"),
        "bytes_per_sync": sum(per_cluster) / len(per_cluster) if per_cluster else 0.0,
        "anchors_finite": not C.anchor_check(job.run_dir)[1],
        "wall_s": job.wall_s,
    }


def summarize(rows: list[dict[str, Any]], a: argparse.Namespace, done: bool) -> dict[str, Any]:
    """The JSON of the rows so far (written after every run: a benchmark cut short leaves what it measured)."""
    for r in rows:
        r["bytes_vs_ring"] = r["bytes_per_sync"] / r["ring_bytes"] if r["ring_bytes"] else math.nan
        r["honest_share"] = r["honest_left_out"] / r["honest_checks"] if r["honest_checks"] else 0.0
    clean = [r for r in rows if r["run"] == "clean"]
    diloco = [r for r in rows if r["run"] == "diloco"]
    targets = {
        "faulty_zero_min": min((r["faulty_zero"] for r in rows if r["faulty"]), default=None),
        "honest_share_max": max((r["honest_share"] for r in rows), default=None),
        "clean_bytes_vs_ring": {r["clusters"]: r["bytes_vs_ring"] for r in clean},
        "diloco_bytes_vs_ring": diloco[0]["bytes_vs_ring"] if diloco else None,
        "anchors_finite": all(r["anchors_finite"] for r in rows),
    }
    return {"environment": C.environment(), "load": C.load(), "args": vars(a), "complete": done, "rows": rows,
            "targets": targets}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        C.write_json(a.out, summarize(rows, a, done=False))

    diloco = C.run_job("N4/diloco", a.workdir / "n4" / "diloco", overrides(a, 4, "diloco"), timeout=a.timeout,
                       reuse=a.reuse)  # first: a benchmark cut short still has its SUM row
    add({"clusters": 4, "run": "diloco", "faulty": 0, **measure(diloco, 4, [], a),
         "ring_bytes": C.ring_bytes(diloco.summary, 4)})
    for n in a.clusters:
        base = overrides(a, n)
        clean = C.run_job(f"N{n}/clean", a.workdir / f"n{n}" / "clean", base, timeout=a.timeout, reuse=a.reuse)
        ring = C.ring_bytes(clean.summary, n)
        add({"clusters": n, "run": "clean", "faulty": 0, **measure(clean, n, [], a), "ring_bytes": ring})
        for f in a.faulty:  # every kind with one faulty cluster before any with two
            for kind in a.kinds:
                job = C.run_job(f"N{n}/{kind}x{f}", a.workdir / f"n{n}" / f"{kind}-{f}", [*base, fault(a, kind, f)],
                                timeout=a.timeout, reuse=a.reuse)
                add({"clusters": n, "run": kind, "faulty": f,
                     **measure(job, n, [f"c{g}" for g in range(1, f + 1)], a), "ring_bytes": ring})
    out = summarize(rows, a, done=True)
    print(C.table(rows, [("clusters", "N", "d"), ("run", "run", "s"), ("faulty", "bad", "d"),
                         ("faulty_zero", "bad w=0", ".2f"), ("honest_share", "honest out", ".4f"),
                         ("bytes_vs_ring", "bytes/ring", ".3f"), ("regathered", "gathered", "d"),
                         ("anchors_finite", "finite", "s"), ("wall_s", "wall s", ".0f")]))
    C.write_json(a.out, out)
    print(out["targets"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
