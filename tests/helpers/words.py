"""The retired synonyms for a cluster (docs/glossary.md) and a check of what a run wrote: no config key, event
field or `summary.json` field may use one (issue 38). Other tests call `retired_in_run` on the run dirs they make."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

#: a component of a key or field name that names a cluster (or its size) by a retired word
RETIRED = re.compile(r"^(groups?|workers?|members?|participants?|replicas?|peers?|contributors?|shard_size|world_size"
                     r"|per_group|cross_group_bytes)$")


def retired_keys(doc: Any, where: str = "") -> list[str]:
    """Every key path in a JSON/YAML document (dicts, lists of dicts) one of whose names is retired."""
    found: list[str] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            path = f"{where}.{k}" if where else str(k)
            if RETIRED.match(str(k)) and path != "data.workers":  # tokenizer processes (docs/glossary.md)
                found.append(path)
            found += retired_keys(v, path)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found += retired_keys(v, f"{where}[{i}]")
    return found


def retired_in_run(run_dir: Path) -> list[str]:
    """Retired names among the fields of every event in `metrics.jsonl` and of `summary.json` (with its
    per-cluster records). Each event counts by its kind: `sync.quorum`, never the event's values."""
    found: set[str] = set()
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        found.update(f"{e.get('event')}.{k}" for k in e if RETIRED.match(k))
    summary = run_dir / "summary.json"
    if summary.is_file():
        doc = json.loads(summary.read_text())
        found.update(f"summary.{k}" for k in doc if RETIRED.match(k))
        for name, rec in (doc.get("per_cluster") or {}).items():
            found.update(f"summary.per_cluster.*.{k}" for k in rec if RETIRED.match(k))
    return sorted(found)


def retired_in_events(events: list[dict[str, Any]]) -> list[str]:
    return sorted({f"{e.get('event')}.{k}" for e in events for k in e if RETIRED.match(k)})
