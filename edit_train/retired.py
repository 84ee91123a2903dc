"""Config keys that were renamed or moved. The rule, for every retired key: in a config file it is refused with a
one-line hint to its successor (`cli/common.py`), instead of Hydra's "no such key"; on the command line a key
with exactly one successor (`RENAMED`) is read as that successor with a one-line deprecation warning, so a
script written against the old name keeps running while it says what to change. A key whose successor
depends on other settings (the rule parameters of issue 36) is refused there too. Inside the entries of
`faults` and `cluster.slowdown_schedule` (values, wherever given) the retired field `group` is read as
`cluster` with the same warning (`entry_field`). A key under a moved prefix (`MOVED`: `algo.penalty.*` is
`algo.rule.*` and the rule's name `algo.rule.name`, issue 50) is read as its successor the same way.

Outputs: a run directory written before the one-word rename (issue 38) reads as today's (`current_event`,
`current_summary`: the report and the planner's calibration apply them when they load a run). Retired names and
today's: event field ``group`` (a cluster's index) → ``cluster_index``, ``participants`` → ``quorum``, an eval's
``scope: "group"`` → ``scope: "cluster"``; `summary.json`'s ``cross_group_bytes`` → ``cross_cluster_bytes`` (at the
top and in each per-cluster record) and ``per_group`` {index: record} → ``per_cluster`` {name: record}. A run dir
written today holds none of them (`tests/docs/test_words.py`)."""

from __future__ import annotations

import logging
from typing import Any

# the rule parameters that moved under the rule that owns them (issue 36)
_NORM_TEST = ("anomaly", "ewma_alpha", "warmup_syncs", "z_threshold", "sigma_floor", "readmit_after", "regime_change")
_VERIFIED = ("sketch_dim", "direction_rate", "direction_alpha", "direction_z", "probe_tokens", "probe_tolerance",
             "retract", "report_tolerance", "max_token_ratio", "left_out")
_EDIT_NORM = ("weighting", "temperature", "step_weight_ratio")

# one word per concept (issue 38, docs/glossary.md): a cluster is a cluster, its size is its ranks
RENAMED: dict[str, str] = {"cluster.groups": "cluster.count", "cluster.shard_size": "cluster.ranks"}
# issue 50: the aggregation rule's config is `algo.rule` (was `algo.penalty`), the rule it picks `algo.rule.name`;
# a key or every key under it (a prefix) -> its successor
MOVED: dict[str, str] = {"algo.penalty.rule": "algo.rule.name", "algo.penalty": "algo.rule"}

RETIRED: dict[str, str] = {
    **RENAMED,
    **MOVED,
    **{f"{p}.{k}": f"algo.rule.verified.{k} (rule verified) or algo.rule.edit_norm.{k} "
       "(rule edit_norm): each rule owns its parameters" for k in _NORM_TEST for p in ("algo.penalty", "algo.rule")},
    **{f"{p}.{k}": f"algo.rule.verified.{k}: the verified rule owns it" for k in _VERIFIED
       for p in ("algo.penalty", "algo.rule")},
    **{f"{p}.{k}": f"algo.rule.edit_norm.{k}: the edit_norm rule owns it" for k in _EDIT_NORM
       for p in ("algo.penalty", "algo.rule")},
}


def moved_key(key: str) -> str | None:
    """The successor of a key under a `MOVED` prefix (`algo.penalty.clip=false` → `algo.rule.clip`); None for
    any other key, and for one retired outright (refused with its hint)."""
    for old, new in MOVED.items():
        if key == old:
            return new
        if key.startswith(old + ".") and key not in RETIRED:
            return new + key[len(old):]
    return None


def retired_hint(key: str) -> str | None:
    """`"<key> was retired: use <new>"`, or None for a key that was never retired."""
    new = RETIRED.get(key)
    return f"{key} was retired: use {new}" if new is not None else None


_warned_fields: set[str] = set()


def entry_field(spec: dict, where: str) -> dict:
    """A `faults` / `cluster.slowdown_schedule` entry with its retired `group` field read as `cluster` (one
    deprecation line per list per process); the entry itself when it has none."""
    if "group" not in spec or "cluster" in spec:
        return spec
    if where not in _warned_fields:
        _warned_fields.add(where)
        logging.getLogger(__name__).warning("%s: the field `group` is deprecated: read as `cluster` (the cluster's "
                                            "index or name; docs/glossary.md)", where)
    out = {k: v for k, v in spec.items() if k != "group"}
    out["cluster"] = spec["group"]
    return out


def current_override(o: str) -> tuple[str, str | None]:
    """One command-line override with a `RENAMED` (or moved) key read as its successor, and the retired key it had
    (None: already today's)."""
    prefix = o[:len(o) - len(o.lstrip("+~"))]
    key, eq, value = o[len(prefix):].partition("=")
    new = (RENAMED.get(key) or moved_key(key)) if not o.startswith("-") else None
    return (o, None) if new is None else (f"{prefix}{new}{eq}{value}", key)


def renamed_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides with every `RENAMED` key read as its successor (`cluster.groups=2` →
    `cluster.count=2`, also with a `+`/`~` prefix and in sweeps), one deprecation line on stderr per key."""
    import sys

    out = []
    for o in overrides:
        now, old = current_override(o)
        if old is not None:
            new, _, value = now.lstrip("+~").partition("=")
            print(f"warning: {old} is deprecated: read as {new} (docs/glossary.md); use {new}={value}" if "=" in o
                  else f"warning: {old} is deprecated: read as {new} (docs/glossary.md)", file=sys.stderr, flush=True)
        out.append(now)
    return out


# ------------------------------------------------------------------------------ outputs
# defaults that changed: (the value a run got when it did not name the key, the Unix time the change landed).
# Issue 51: `sync.compression=topk` sends 3 of 32 groups of 8 with error feedback as momentum (β 0.6); before, 1 %
# element-wise with plain error feedback. A record of a run from before that names none of these ran the old values.
_TOPK_DEFAULTS_CHANGED = 1_795_915_800.0  # 2026-11-29 01:30 UTC
CHANGED_DEFAULTS: dict[str, tuple[str, float]] = {
    key: (old, _TOPK_DEFAULTS_CHANGED)
    for key, old in {"sync.topk_density": "0.01", "sync.topk_group": "1", "sync.error_feedback_decay": "1.0"}.items()}


def implicit_before(overrides: list[str], recorded: list[str], recorded_at: float) -> list[str]:
    """`overrides` less each one that pins a changed default to the value it had (`CHANGED_DEFAULTS`) when
    `recorded` (a run's overrides, recorded at Unix time `recorded_at`) does not name that key and was recorded
    before the change: what the same run's overrides were then."""
    named = {o.lstrip("+~").split("=", 1)[0] for o in recorded}
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        old = CHANGED_DEFAULTS.get(key)
        if old is not None and key not in named and recorded_at < old[1] and _same_number(value, old[0]):
            continue
        out.append(o)
    return out


# Issue 66: `algo=edit` leaves algo.outer.lr / momentum unset (the default by cluster count); before, its preset
# named the EDiT paper's 0.7 / Nesterov 0.8. A run recorded then that named neither ran those: its config.json holds
# them as numbers (today's holds null).
EDIT_OUTER_BEFORE = {"algo.outer.lr": "0.7", "algo.outer.momentum": "0.8"}


def edit_outer_then(overrides: list[str], recorded: list[str], config: dict[str, Any] | None) -> list[str] | None:
    """`overrides` as a run recorded with `recorded` (its resolved `config`, config.json) would have named them, when
    it ran `algo=edit`'s outer step of before issue 66 without naming it: the same run only if `overrides` pin both
    old numbers (returned without those pins), else None (today it would run the default by cluster count: another
    run). Any other run: `overrides` unchanged."""
    algo = (config or {}).get("algo") or {}
    outer = algo.get("outer") or {}
    named = {o.lstrip("+~").split("=", 1)[0] for o in recorded}
    if algo.get("name") != "edit" or named & set(EDIT_OUTER_BEFORE) or outer.get("lr") is None \
            or outer.get("momentum") is None:
        return overrides
    pins = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] in EDIT_OUTER_BEFORE}
    if set(pins) != set(EDIT_OUTER_BEFORE) or not all(_same_number(v, EDIT_OUTER_BEFORE[k]) for k, v in pins.items()):
        return None
    return [o for o in overrides if o.split("=", 1)[0] not in EDIT_OUTER_BEFORE]


def _same_number(a: str, b: str) -> bool:
    """`0.01` and `1e-2` alike; a value that is no number (`null`) is not the old default."""
    try:
        return float(a) == float(b)
    except ValueError:
        return False


EVENT_FIELDS = {"group": "cluster_index", "participants": "quorum"}
SUMMARY_FIELDS = {"cross_group_bytes": "cross_cluster_bytes"}
_warned_outputs = False  # the notice is logged once per process


def current_rule_name(cfg: dict[str, Any], default: str = "verified") -> str:
    """The rule a run dir's config picked: `algo.rule.name`, or (written before issue 50) `algo.penalty.rule`."""
    algo = cfg.get("algo") or {}
    rule, old = algo.get("rule"), algo.get("penalty")
    if isinstance(rule, dict) and rule.get("name"):
        return str(rule["name"])
    return str(old.get("rule", default)) if isinstance(old, dict) else default


def current_event(event: dict[str, Any]) -> dict[str, Any]:
    """`event` with retired field names read as today's (the same dict when it has none)."""
    if not any(old in event for old in EVENT_FIELDS) and event.get("scope") != "group":
        return event
    out = {EVENT_FIELDS.get(k, k): v for k, v in event.items()}
    if out.get("scope") == "group":
        out["scope"] = "cluster"
    return out


def as_index(value: Any) -> int | None:
    """A cluster index as written in a run dir (an int or its string; a bool or anything else: None)."""
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _record(rec: dict[str, Any]) -> dict[str, Any]:
    return {SUMMARY_FIELDS.get(k, k): v for k, v in rec.items()}


def current_summary(summary: dict[str, Any] | None, where: object = "") -> dict[str, Any] | None:
    """`summary.json` with retired field names read as today's; a `per_group` {index: record} becomes
    `per_cluster` {name: record} (each record's `name`, `c<index>` without one). Logs one line, once."""
    global _warned_outputs
    if summary is None or not (set(summary) & {*SUMMARY_FIELDS, "per_group"}):
        return summary
    if not _warned_outputs:
        _warned_outputs = True
        logging.getLogger(__name__).warning("run dir %s predates the one-word rename: reading its retired summary.json fields as today's "
                    "(said once, for the first such run dir)", where or "?")
    out = _record(summary)
    per_group = out.pop("per_group", None)
    if isinstance(out.get("per_cluster"), dict):
        out["per_cluster"] = {k: _record(v) if isinstance(v, dict) else v for k, v in out["per_cluster"].items()}
    elif isinstance(per_group, dict):
        per_cluster: dict[str, Any] = {}
        for key, rec in sorted(per_group.items(), key=lambda kv: (as_index(kv[0]) is None, as_index(kv[0]) or 0)):
            if not isinstance(rec, dict):
                continue
            index = as_index(rec.get("index"))
            index = as_index(key) if index is None else index
            name = rec.get("name") if isinstance(rec.get("name"), str) else f"c{index if index is not None else key}"
            per_cluster[name] = {**_record(rec), "name": name, **({"index": index} if index is not None else {})}
        out["per_cluster"] = per_cluster
    return out
