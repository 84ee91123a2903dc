"""`summary.json` of a federated run: each cluster writes its own record and re-merges all of them.

Clusters are independent jobs that finish at different times, so no single process owns the summary:
every cluster leader writes `run.dir/clusters/<name>.json` when it finishes and then rewrites
`summary.json` from all records present (under a file lock), so the last one to finish leaves the
complete merge. `completed` is true once every configured cluster has finished.

Clocks count live time only (train/progress.py): `wall_s` is the time some cluster of the federation was
alive (the union of the clusters' live spans), `downtime_s` the time between its first start and its end when
none was (a federation resumed 25 minutes after it stopped), and goodput divides the committed compute by the
clusters' live seconds, never by their downtime.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path
from typing import Any

from edit_train.fsutil import atomic_write_json
from edit_train.local_sgd.protocols import ClusterGroup
from edit_train.train.progress import TrainingState, now


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def live_spans(record: dict[str, Any]) -> list[tuple[float, float]]:
    """A cluster record's live spans ([start, end] of each incarnation); a record written before they were kept:
    its first start (after its downtime) to its end."""
    spans = record.get("live_spans")
    if isinstance(spans, list) and spans:
        return [(float(a), float(b)) for a, b in spans]
    end = float(record.get("end", 0.0))
    start = float(record.get("first_start", end - float(record["wall_s"])))
    return [(min(start + float(record.get("downtime_s", 0.0)), end), end)]


def union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one span."""
    total, reach = 0.0, -float("inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def merge(records: list[dict[str, Any]], configured: list[str]) -> dict[str, Any]:
    order = {n: i for i, n in enumerate(configured)}
    records = sorted(records, key=lambda r: (order.get(r["name"], len(order)), r["name"]))
    first = records[0]
    spans = [s for r in records for s in live_spans(r)]
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    live = union_s(spans)  # some cluster was alive
    wall = max(live, max(r["wall_s"] for r in records))
    tokens = sum(r["tokens"] for r in records)
    useful = sum(r.get("useful_s", 0.0) for r in records)
    reserved = sum(b - a for a, b in spans)  # every cluster's live seconds
    per_cluster = {r["name"]: r for r in records}
    return {
        "algo": first["algo"],
        "completed": all(n in per_cluster for n in configured),
        "steps": max(r["steps"] for r in records), "tokens": tokens, "wall_s": wall,
        "downtime_s": max(end - start - live, 0.0),
        "tokens_per_s": tokens / max(wall, 1e-9),
        "final_val_loss": first["final_val_loss"],
        **({"outer": first["outer"]} if "outer" in first else {}),  # the outer step and how it was chosen
        **({"final_val_loss_by_source": first["final_val_loss_by_source"]}
           if "final_val_loss_by_source" in first else {}),  # each source of a shared validation of several
        "initial_val_loss": next((r["initial_val_loss"] for r in records if r.get("initial_val_loss") is not None),
                                 None),  # a cluster that joined mid-run (healed) has none of its own
        "cross_cluster_bytes": sum(r["cross_cluster_bytes"] for r in records),
        "syncs": max(r["syncs"] for r in records), "anomalies": sum(r["anomalies"] for r in records),
        "blocked_s": max(r["blocked_s"] for r in records),
        "total_params": first["total_params"], "active_params": first["active_params"],
        "goodput": useful / max(reserved, 1e-9),
        "mfu": _mean([r.get("mfu") for r in records]),
        "per_cluster": per_cluster,
    }


def write_cluster_summary(run_dir: Path, record: dict[str, Any], configured: list[str]) -> dict[str, Any]:
    folder = run_dir / "clusters"
    folder.mkdir(parents=True, exist_ok=True)
    record = {**record, "end": now()}
    atomic_write_json(folder / f"{record['name']}.json", record)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = []
        for f in sorted(folder.glob("*.json")):
            if f.name.endswith((".progress.json", ".useful.json")):
                continue
            try:
                records.append(json.loads(f.read_text()))
            except (OSError, json.JSONDecodeError):
                continue
        summary = merge(records, configured)
        atomic_write_json(run_dir / "summary.json", summary)
    return summary


def cluster_record(state: TrainingState, group: ClusterGroup, stats: dict[str, Any], *, index: int, device: str,
                   algo: str, param_counts: dict[str, int], val_loss: float, restarts: int, slowdown_slept_s: float,
                   time_split: dict[str, float]) -> dict[str, Any]:
    """This cluster's record for the summary (every rank takes part: its bytes and blocked time count)."""
    state.live()
    wall = state.wall()
    from edit_train.federation import auth, identity
    from edit_train.local_sgd.sync.healing import DIGEST_S

    ranks = group.all_gather_json({"bytes_sent": stats["bytes_sent"], "blocked_s": stats["blocked_s"],
                                   "auth_s": auth.SPENT[0], "trust_s": identity.SPENT[0] + DIGEST_S[0],
                                   "trust_background_s": identity.BACKGROUND_SPENT[0]})
    c = state.carried
    blocked = max(r["blocked_s"] for r in ranks)
    return {
        "name": state.name, "index": index, "ranks": group.size, "device": device,
        "tokens": state.tokens, "steps": state.step, "steps_trained": c.steps_trained,
        "tokens_per_step": state.tokens_per_step, "skipped_steps": state.skipped_steps,
        "tokens_per_s": state.tokens / max(wall, 1e-9), "syncs": stats["syncs"], "syncs_joined": stats["syncs"],
        "syncs_missed": stats["syncs_missed"], "syncs_aborted": stats["syncs_aborted"],
        "anomalies": stats["anomalies"], "cross_cluster_bytes": sum(r["bytes_sent"] for r in ranks),
        "blocked_s": blocked, "blocked_frac": blocked / max(wall, 1e-9),
        "slowdown_slept_s": slowdown_slept_s, "local_steps": stats["local_steps_per_sync"],
        "restarts": max(restarts, c.restarts), "healed_from": stats["healed_from"],  # not a deliberate resume
        "wall_s": wall, "useful_s": c.useful_s, "first_start": c.first_start, "downtime_s": c.downtime_s,
        "live_s": c.live_s, "live_spans": c.live_spans, "alive_s": now() - state.t_start,
        "startup_s": state.startup_s,
        "final_val_loss": val_loss, "initial_val_loss": state.initial_val_loss, "algo": algo,
        "total_params": param_counts["total_params"], "active_params": param_counts["active_params"],
        "mfu": sum(state.mfu) / len(state.mfu) if state.mfu else None, "time": time_split,
        "auth_s": max(r["auth_s"] for r in ranks),  # computing and checking tags (part of sync/blocked time)
        "trust_s": max(r["trust_s"] for r in ranks),  # Ed25519 signatures and anchor digests (ditto)
        "trust_background_s": max(r["trust_background_s"] for r in ranks),  # of which the heartbeat's (off syncs)
    }
