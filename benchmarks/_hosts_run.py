"""One `edit-train` federation across network-namespace hosts (`edit_train/sim/hosts.py`): a Lighthouse on host
`lh`, one cluster job per host over a real TCP link shaped to `rate_mbit` with `tc tbf` (no simulated link),
started as `benchmarks/link_hosts.py` starts them (`launchers/torchrun_multinode.sh`). For
`plan_validation.py`: a finished run is reused like `_common.run_job`'s (same arguments, same rate).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import _common as C
from link_hosts import REPO, run_clusters, start_lighthouse


def hosts_args(names: list[str], overrides: list[str]) -> list[str]:
    spec = ",".join(f"{{name:{n},ranks:1}}" for n in names)
    # cluster=local and no simulated link: the real, shaped link is the only one (the default cluster,
    # hetero_2x1, would add its simulated 100 Mbit/s, 50 ms link and 3x slowdown list on top)
    return ["cluster=local", "cluster.link.bandwidth_mbps=0", "cluster.link.latency_ms=0", *overrides,
            f"cluster.clusters=[{spec}]", f"federation.min_clusters={len(names)}",
            "federation.heartbeat_timeout_s=5", "federation.join_timeout_s=30", "federation.collective_timeout_s=300",
            "train.threads=1"]


def run_on_hosts(name: str, run_dir: Path, overrides: list[str], rate_mbit: float, *, clusters: int = 2,
                 timeout: float = 1800.0, reuse: bool = True) -> C.Job:
    """Run the federation (or reuse the finished one in `run_dir`); raises C.JobError naming what failed."""
    from edit_train.federation import auth
    from edit_train.sim import hosts as sim_hosts

    names = [f"c{i}" for i in range(clusters)]
    over = hosts_args(names, overrides)
    run_dir = Path(run_dir).resolve()
    rec = C.finished_run(run_dir, over) if reuse else None
    if rec is not None and rec.get("rate_mbit") == rate_mbit:
        print(f"{name}: reusing the finished run in {run_dir}", flush=True)
        return C.Job(name, run_dir, C.job_args(run_dir, over), float(rec["wall_s"]), C.read_summary(run_dir),
                     C.read_metrics(run_dir))
    why = sim_hosts.unavailable()
    if why is not None:
        raise C.JobError(f"{name}: namespace hosts unavailable ({why})")
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    args = C.job_args(run_dir, over)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {len(names)} namespace hosts at {rate_mbit:g} Mbit/s: "
          f"edit-train {' '.join(args)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="plan-hosts-") as tmp:
        work = Path(tmp)
        key = str(auth.new_key(work / "fed.key"))
        logs = run_dir / "hosts_logs"
        logs.mkdir()
        with sim_hosts.Hosts(["lh", *names], rate_mbit=rate_mbit) as net:
            start_lighthouse(net, logs, key, len(names))
            try:
                wall = run_clusters(net, names, args, key, logs, REPO, timeout)
            except RuntimeError as exc:
                raise C.JobError(f"{name}: {exc}") from None
            finally:
                net.kill("lh")
    if not (run_dir / "summary.json").exists():
        raise C.JobError(f"{name}: no summary.json in {run_dir} (logs in {logs})")
    (run_dir / "bench_job.json").write_text(json.dumps({"args": args, "wall_s": wall, "rate_mbit": rate_mbit}))
    print(f"[{time.strftime('%H:%M:%S')}] {name}: done in {wall:.0f}s", flush=True)
    return C.Job(name, run_dir, args, wall, C.read_summary(run_dir), C.read_metrics(run_dir))
