"""Goodput under failures: 3 clusters, one of them SIGKILLed every `--every` seconds (found by
EDIT_TRAIN_CLUSTER, rotating c1 → c2 → c0) and restarted by the local launcher, against the same run with
no failure. Both runs train for the same wall-clock budget (A-EDiT: nobody waits for a straggler).

Prints and saves goodput (useful cluster-seconds ÷ cluster-seconds, `summary.json`) and the final val loss
of both runs. Targets (Decoupled DiLoCo's figure): goodput ≥ 0.88 under failures, val loss ≤ 1.02 × clean.

    python benchmarks/goodput.py --quick --out benchmarks/results/goodput.json
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def cluster_pids(name: str, run_dir: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f"EDIT_TRAIN_CLUSTER={name}".encode() in env and "edit_train.cli.worker" in cmd and str(run_dir) in cmd:
            pids.append(int(entry.name))
    return pids


def killer(run_dir: Path, every: float, stop: threading.Event, log: list[dict]) -> None:
    """Wait for training to start, then SIGKILL one cluster every `every` seconds."""
    order = ["c1", "c2", "c0"]
    while not stop.is_set() and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.5)
    t0 = time.time()
    k = 0
    while not stop.wait(max(t0 + every * (k + 1) - time.time(), 0.0)):
        name = order[k % len(order)]
        pids = cluster_pids(name, run_dir)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.append({"t": round(time.time() - t0, 1), "cluster": name, "pids": len(pids)})
        print(f"[{time.strftime('%H:%M:%S')}] killed cluster {name} ({len(pids)} process(es))", flush=True)
        k += 1


def main() -> None:
    ap = _common.parser(__doc__, out="goodput.json", workdir="goodput")
    ap.add_argument("--quick", action="store_true", help="150 s per run instead of 360 s")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between kills")
    args = _common.parse(ap)
    budget = 150 if args.quick else 360
    common = ["cluster=local", "model=tiny", "algo=a_edit", "algo.sync_time_s=5", "cluster.count=3",
              "cluster.ranks=1",
              "train.batch_size=4", "train.seq_len=64", f"train.time_budget_s={budget}", "train.steps=100000",
              "train.eval_every=0", "train.log_every=10", "federation.join_timeout_s=5",
              "federation.heartbeat_timeout_s=3", "run.max_restarts=20", "run.restart_delay_s=2"]
    runs = args.workdir
    clean = _common.run_job("clean", runs / "clean", common)
    stop, kills = threading.Event(), []
    if not args.smoke:  # a smoke's run trains in this process: nothing to kill
        threading.Thread(target=killer, args=(runs / "faulty", args.every, stop, kills), daemon=True).start()
    try:
        faulty = _common.run_job("faulty", runs / "faulty", common)
    finally:
        stop.set()
    rows = []
    for job in (clean, faulty):
        s = job.summary
        rows.append({"run": job.name, "goodput": s["goodput"], "val_loss": s["final_val_loss"],
                     "tokens": s["tokens"], "restarts": sum(c["restarts"] for c in s["per_cluster"].values()),
                     "missed": sum(c["syncs_missed"] for c in s["per_cluster"].values()),
                     "aborted": sum(c.get("syncs_aborted", 0) for c in s["per_cluster"].values()),
                     "downtime_s": sum(c["downtime_s"] for c in s["per_cluster"].values())})
    print(_common.table(rows, [("run", "run", ""), ("goodput", "goodput", ".3f"), ("val_loss", "val loss", ".4f"),
                               ("tokens", "tokens", ",d"), ("restarts", "restarts", "d"), ("missed", "missed", "d"),
                               ("aborted", "aborted", "d"), ("downtime_s", "downtime s", ".1f")]))
    targets = {"goodput (failures)": faulty.summary["goodput"],
               "goodput >= 0.88": faulty.summary["goodput"] >= 0.88,
               "val loss ratio (failures / clean)": faulty.summary["final_val_loss"] / clean.summary["final_val_loss"],
               "val loss <= 1.02 x clean": faulty.summary["final_val_loss"] <= 1.02 * clean.summary["final_val_loss"]}
    out = _common.write_json(args.out, {"rows": rows, "kills": kills, "targets": targets, "budget_s": budget,
                                        "every_s": args.every, "environment": _common.environment()})
    _common.print_targets(targets, out, out)


if __name__ == "__main__":
    main()
