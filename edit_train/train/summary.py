"""`summary.json` of a federated run: each cluster writes its own record and re-merges all of them.

Clusters are independent jobs that finish at different times, so no single process owns the summary:
every cluster leader writes `run.dir/clusters/<name>.json` when it finishes and then rewrites
`summary.json` from all records present (under a file lock), so the last one to finish leaves the
complete merge. `completed` is true once every configured cluster has finished.
"""

from __future__ import annotations

import fcntl
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from edit_train.train.trainer import Trainer


def _atomic_write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def useful_path(run_dir: Path, name: str) -> Path:
    return run_dir / "clusters" / f"{name}.useful.json"


def load_useful(run_dir: Path, name: str) -> dict[str, Any]:
    """What earlier incarnations of this cluster contributed (compute seconds committed in syncs)."""
    path = useful_path(run_dir, name)
    if path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            pass
    return {"useful_s": 0.0, "first_start": time.time(), "incarnations": 0, "downtime_s": 0.0, "died_at": None}


def save_useful(run_dir: Path, name: str, record: dict[str, Any]) -> None:
    path = useful_path(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, record)


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def merge(records: list[dict[str, Any]], configured: list[str]) -> dict[str, Any]:
    order = {n: i for i, n in enumerate(configured)}
    records = sorted(records, key=lambda r: (order.get(r["name"], len(order)), r["name"]))
    first = records[0]
    start = min(r.get("first_start", r.get("end", 0) - r["wall_s"]) for r in records)
    end = max(r.get("end", start) for r in records)
    wall = max(end - start, max(r["wall_s"] for r in records))
    tokens = sum(r["tokens"] for r in records)
    useful = sum(r.get("useful_s", 0.0) for r in records)
    reserved = sum(r.get("end", end) - r.get("first_start", start) for r in records)
    per_cluster = {r["name"]: r for r in records}
    return {
        "algo": first["algo"],
        "completed": all(n in per_cluster for n in configured),
        "steps": max(r["steps"] for r in records), "tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / max(wall, 1e-9),
        "final_val_loss": first["final_val_loss"], "initial_val_loss": first["initial_val_loss"],
        "cross_group_bytes": sum(r["cross_group_bytes"] for r in records),
        "syncs": max(r["syncs"] for r in records), "anomalies": sum(r["anomalies"] for r in records),
        "blocked_s": max(r["blocked_s"] for r in records),
        "total_params": first["total_params"], "active_params": first["active_params"],
        "goodput": useful / max(reserved, 1e-9),
        "mfu": _mean([r.get("mfu") for r in records]),
        "per_cluster": per_cluster,
        "per_group": {str(r["index"]): r for r in records},
    }


def write_cluster_summary(run_dir: Path, record: dict[str, Any], configured: list[str]) -> dict[str, Any]:
    folder = run_dir / "clusters"
    folder.mkdir(parents=True, exist_ok=True)
    record = {**record, "end": time.time()}
    _atomic_write(folder / f"{record['name']}.json", record)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = []
        for f in sorted(folder.glob("*.json")):
            if f.name.endswith(".useful.json"):
                continue
            try:
                records.append(json.loads(f.read_text()))
            except (OSError, json.JSONDecodeError):
                continue
        summary = merge(records, configured)
        _atomic_write(run_dir / "summary.json", summary)
    return summary


def finish_summary(tr: Trainer, val_loss: float, init_val: float | None) -> dict[str, Any]:
    """This cluster's record (`run.dir/clusters/<name>.json`, every rank takes part) merged by the leader
    with every other cluster's into `summary.json` (DESIGN.md §5); other ranks return {}."""
    topo, p = tr.topo, tr.progress
    wall = p.wall_offset + time.time() - tr.t0
    mine = {"mfu": sum(tr.mfu_values) / len(tr.mfu_values) if tr.mfu_values else None,
            "tokens": p.tokens, "steps": p.step, "skipped_steps": p.skipped_steps, **tr.algo.stats(),
            "slowdown_slept_s": tr.slowdown.slept_s}
    ranks = topo.group.all_gather_json(mine)
    lead = ranks[0]
    alive = time.time() - tr.t_start
    record = {
        "name": topo.name, "index": topo.group_index, "ranks": topo.world_size, "device": str(topo.device),
        "tokens": lead["tokens"], "steps": lead["steps"], "skipped_steps": lead["skipped_steps"],
        "tokens_per_s": lead["tokens"] / max(wall, 1e-9), "syncs": lead["syncs"], "syncs_joined": lead["syncs"],
        "syncs_missed": lead["syncs_missed"], "syncs_aborted": lead["syncs_aborted"],
        "anomalies": lead["anomalies"], "cross_group_bytes": sum(r["bytes_sent"] for r in ranks),
        "blocked_s": max(r["blocked_s"] for r in ranks),
        "blocked_frac": max(r["blocked_s"] for r in ranks) / max(wall, 1e-9),
        "slowdown_slept_s": lead["slowdown_slept_s"], "local_steps": lead.get("local_steps_per_sync", []),
        "restarts": max(tr.restarts, tr.useful["incarnations"] - 1), "healed_from": lead["healed_from"],
        "wall_s": wall, "useful_s": tr.useful["useful_s"], "first_start": tr.useful["first_start"],
        "downtime_s": tr.useful["downtime_s"],
        "alive_s": alive, "startup_s": getattr(tr, "startup_s", 0.0),
        "final_val_loss": val_loss, "initial_val_loss": init_val, "algo": tr.cfg.algo.name,
        "total_params": tr.param_counts["total_params"], "active_params": tr.param_counts["active_params"],
        "mfu": lead.get("mfu"), "time": tr.timing.snapshot(),
    }
    if tr.is_main:
        return write_cluster_summary(tr.run_dir, record, [s.name for s in tr.specs])
    return {}
