"""The report's data model: one run directory read into a `Run`, and the summary table built from runs.

Reads only the run-directory contract of docs/architecture.md §5 — `metrics.jsonl` (+ `summary.json` when the run
finished, `config.json` for the algorithm name of a run that did not) — so it works on the output of
every algorithm: DDP (no `sync` events), single-cluster runs, runs without evals, and crashed runs (no
`summary.json`: the table marks the run incomplete and derives its numbers from the events).

A leaf: it imports no other `edit_train` module, so the figures and the orchestrator (`edit_train.report`)
can depend on it without a cycle.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from edit_train.retired import as_index, current_event, current_summary

COLUMNS = ("run", "algo", "steps", "tokens", "wall_s", "tokens/s", "final val loss", "cross-cluster bytes",
           "syncs", "anomalies", "blocked %", "downtime_s")
NUMERIC_COLUMNS = frozenset(COLUMNS[2:])

log = logging.getLogger(__name__)


class ReportError(ValueError):
    """A path the user gave cannot be reported on (the message names it)."""


# --------------------------------------------------------------------------------------------- loading
def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Load a `metrics.jsonl` file (skipping a torn last line)."""
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def _num(value: Any) -> float:
    """A metric value as float; missing / null (NaN written as null) / non-numeric → NaN."""
    if isinstance(value, bool) or value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def summary_clusters(summary: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """`summary.json`'s per-cluster records, {cluster name: record} (a run dir written before the one-word
    rename is read as today's by `retired.current_summary` when it is loaded)."""
    per_cluster = (summary or {}).get("per_cluster")
    if isinstance(per_cluster, dict):
        return {str(k): v for k, v in per_cluster.items() if isinstance(v, dict)}
    return {}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class Run:
    """One run directory: its events, its summary (None if the run did not finish) and its config."""

    path: Path
    events: list[dict[str, Any]]
    summary: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    label: str = ""
    _stats: dict[str, Any] | None = field(default=None, repr=False)
    #: {cluster name: summary record}, in the summary's cluster order (empty without a summary)
    per_cluster: dict[str, dict[str, Any]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.per_cluster = summary_clusters(self.summary)

    # ----------------------------------------------------------------------------- identity
    @property
    def name(self) -> str:
        return self.path.name or str(self.path)

    @property
    def algo(self) -> str:
        if self.summary and self.summary.get("algo"):
            return str(self.summary["algo"])
        algo = (self.config or {}).get("algo")
        if isinstance(algo, dict) and algo.get("name"):
            return str(algo["name"])
        return "?"

    @property
    def completed(self) -> bool:
        return self.summary is not None and bool(self.summary.get("completed", True))

    # ------------------------------------------------------------------------------- events
    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def indices(self) -> list[int]:
        found: set[int] = set()
        for e in self.events:
            if e.get("event") in ("train", "sync", "moe") and isinstance(e.get("cluster_index"), int):
                found.add(e["cluster_index"])
        found.update(self._summary_index().values())
        return sorted(found)

    def _summary_index(self) -> dict[str, int]:
        """{cluster name: index} of the summary's records (a record without `index`: its position)."""
        out = {}
        for pos, (name, rec) in enumerate(self.per_cluster.items()):
            index = as_index(rec.get("index"))
            out[name] = pos if index is None else index
        return out

    def cluster_name(self, index: int) -> str:
        """The name of the cluster with this index (events' `cluster_index`): from the summary, else the events'
        `cluster` field, else `c<index>`."""
        for name, i in self._summary_index().items():
            if i == index:
                return name
        for e in self.events:
            if e.get("cluster_index") == index and isinstance(e.get("cluster"), str):
                return e["cluster"]
        return f"c{index}"

    @property
    def clusters(self) -> list[tuple[int, str]]:
        """(index, name) of every cluster, by index."""
        return [(g, self.cluster_name(g)) for g in self.indices]

    def train(self, index: int) -> dict[str, np.ndarray]:
        """The cluster's `train` events as arrays sorted by step (a step logged twice, e.g. re-logged after a
        resume, keeps its last record)."""
        by_step = {e.get("step"): e for e in self.of("train") if e.get("cluster_index", 0) == index}
        rows = sorted((s, e) for s, e in by_step.items() if isinstance(s, (int, float)))
        return {key: np.array([_num(e.get(key)) if key != "step" else float(s) for s, e in rows], dtype=float)
                for key in ("step", "loss", "tokens", "tokens_per_s", "wall")}

    def evals(self, index: int | None = None) -> list[dict[str, Any]]:
        """World evals (index=None) or one cluster's `scope: "cluster"` evals, by step, last record wins — except
        at step 0, where the run's first evaluation is its start (a restarted incarnation that logs a step-0
        eval of the weights it healed to is not)."""
        if index is None:
            chosen = [e for e in self.of("eval") if e.get("scope", "world") != "cluster"]
        else:
            chosen = [e for e in self.of("eval") if e.get("scope") == "cluster" and e.get("cluster_index") == index]
        by_step: dict[Any, dict[str, Any]] = {}
        for e in chosen:
            if isinstance(e.get("step"), (int, float)) and not (e["step"] == 0 and 0 in by_step):
                by_step[e["step"]] = e
        return [by_step[s] for s in sorted(by_step)]

    def world_eval_series(self, x: str) -> dict[int | None, list[tuple[float, float]]]:
        """(x, val loss) of the world evaluations; `x` is "tokens" (the tokens every cluster had trained when it
        was logged: each cluster logs its own, the others' are their latest `train`/`eval` record before it in
        metrics.jsonl, one file every cluster appends to in the order things happened) or "wall".

        One series (key None) when every cluster evaluates at the same steps (one cluster; lockstep, where they
        evaluate the same model: a step logged by several keeps its last record). Else one series per cluster
        (key: its index), each by its own steps: under A-EDiT every cluster evaluates after each exchange at its
        own step count, and joining them by step would zig-zag between the clusters. A step logged twice keeps
        its last record, except step 0: the run's first evaluation is its start (`evals`)."""
        latest: dict[Any, float] = {}
        own: dict[Any, dict[Any, tuple[float, float]]] = {}
        joined: dict[Any, tuple[float, float]] = {}
        for e in self.events:
            if e.get("event") not in ("train", "eval"):
                continue
            g = e.get("cluster_index", 0)
            tokens = _num(e.get("tokens"))
            if math.isfinite(tokens):
                latest[g] = tokens
            step = e.get("step")
            if e["event"] != "eval" or e.get("scope", "world") == "cluster" or not isinstance(step, (int, float)):
                continue
            at = (sum(latest.values()) if math.isfinite(tokens) else math.nan) if x == "tokens" else _num(e.get(x))
            point = (at, _num(e.get("val_loss")))
            steps = own.setdefault(g, {})
            if not (step == 0 and 0 in steps):
                steps[step] = point
            if not (step == 0 and 0 in joined):
                joined[step] = point
        if len({frozenset(steps) for steps in own.values()}) <= 1:
            return {None: [joined[s] for s in sorted(joined)]} if joined else {}
        return {g: [steps[s] for s in sorted(steps)] for g, steps in sorted(own.items(), key=lambda kv: _num(kv[0]))}

    def evals_vs_tokens(self) -> list[tuple[float, float]]:
        """(tokens all clusters had trained, val loss) of each world evaluation (`world_eval_series`): the one
        series, or every cluster's points ordered by tokens."""
        series = self.world_eval_series("tokens")
        if list(series) == [None]:
            return [p for p in series[None] if math.isfinite(p[0])]
        return sorted(p for points in series.values() for p in points if math.isfinite(p[0]))

    def eval_clusters(self) -> list[int]:
        return sorted({e["cluster_index"] for e in self.of("eval") if e.get("scope") == "cluster"
                       and isinstance(e.get("cluster_index"), int)})

    def syncs(self, index: int | None = None) -> list[dict[str, Any]]:
        """`sync` events (optionally of one cluster), deduplicated on (sync, cluster), by sync index."""
        keyed = {(e.get("sync"), e.get("cluster_index")): e for e in self.of("sync")
                 if index is None or e.get("cluster_index") == index}
        return sorted(keyed.values(), key=lambda e: (_num(e.get("sync")), _num(e.get("cluster_index"))))

    @property
    def wall_s(self) -> float:
        if self.summary and math.isfinite(_num(self.summary.get("wall_s"))):
            return _num(self.summary["wall_s"])
        walls = [_num(e.get("wall")) for e in self.events]
        walls = [w for w in walls if math.isfinite(w)]
        return max(walls) if walls else math.nan

    # -------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """The numbers of the summary table (and per-cluster bars, `per_cluster` keyed by cluster name): from
        `summary.json` when it exists,
        else derived from the events (None where the events cannot tell, e.g. a DDP run's bytes)."""
        if self._stats is None:
            self._stats = self._from_summary() if self.summary is not None else self._from_events()
        return self._stats

    def _from_summary(self) -> dict[str, Any]:
        s = self.summary or {}
        wall = _num(s.get("wall_s"))
        blocked = _num(s.get("blocked_s"))
        per_cluster: dict[str, dict[str, float]] = {}
        index = self._summary_index()
        for name in sorted(self.per_cluster, key=lambda n: index[n]):
            pc = self.per_cluster[name]
            b = _num(pc.get("blocked_s"))
            frac = _num(pc.get("blocked_frac"))
            if not math.isfinite(frac) and math.isfinite(b) and wall > 0:
                frac = b / wall
            per_cluster[name] = {"tokens_per_s": _num(pc.get("tokens_per_s")), "blocked_s": b, "blocked_frac": frac}
        blocked_fracs = [v["blocked_frac"] for v in per_cluster.values() if math.isfinite(v["blocked_frac"])]
        if math.isfinite(blocked) and wall > 0:
            blocked_frac = blocked / wall
        else:
            blocked_frac = max(blocked_fracs) if blocked_fracs else math.nan
        final = _num(s.get("final_val_loss"))
        if not math.isfinite(final):
            final = self._last_val()
        return {"steps": s.get("steps"), "tokens": s.get("tokens"), "wall_s": wall,
                "downtime_s": _num(s.get("downtime_s")),  # live time only: downtime is its own bucket (n/a: older)
                "tokens_per_s": _num(s.get("tokens_per_s")), "final_val_loss": final,
                "cross_cluster_bytes": s.get("cross_cluster_bytes"), "syncs": s.get("syncs"),
                "anomalies": s.get("anomalies"), "blocked_frac": blocked_frac, "per_cluster": per_cluster}

    def _from_events(self) -> dict[str, Any]:
        wall = self.wall_s
        per_cluster: dict[str, dict[str, float]] = {}
        steps, tokens = [], 0.0
        syncs = self.syncs()
        for g, name in self.clusters:
            tr = self.train(g)
            ok = np.isfinite(tr["tokens"]) & np.isfinite(tr["wall"])
            g_tokens = float(tr["tokens"][ok][-1]) if ok.any() else math.nan
            g_wall = float(tr["wall"][ok][-1]) if ok.any() else math.nan
            if len(tr["step"]):
                steps.append(int(tr["step"][-1]))
            if math.isfinite(g_tokens):
                tokens += g_tokens
            mine = [e for e in syncs if e.get("cluster_index") == g]
            blocked = float(sum(_num(e.get("blocked_s")) for e in mine)) if mine else math.nan
            per_cluster[name] = {"tokens_per_s": g_tokens / g_wall if g_wall > 0 else math.nan,
                                 "blocked_s": blocked,
                                 "blocked_frac": blocked / wall if wall > 0 else math.nan}
        blocked_fracs = [v["blocked_frac"] for v in per_cluster.values() if math.isfinite(v["blocked_frac"])]
        sync_ids = {e.get("sync") for e in syncs}
        return {"steps": max(steps) if steps else None, "tokens": int(tokens) if steps else None, "wall_s": wall,
                "downtime_s": math.nan,  # the events' `wall` is live time; the downtime is in summary.json only
                "tokens_per_s": tokens / wall if steps and wall > 0 else math.nan,
                "final_val_loss": self._last_val(),
                # without sync events the bytes moved are unknown (DDP all-reduces every step, unlogged)
                "cross_cluster_bytes": int(sum(_num(e.get("bytes")) for e in syncs
                                             if math.isfinite(_num(e.get("bytes"))))) if syncs else None,
                "syncs": len(sync_ids), "anomalies": sum(bool(e.get("anomalous")) for e in syncs),
                "blocked_frac": max(blocked_fracs) if blocked_fracs else math.nan, "per_cluster": per_cluster}

    def _last_val(self) -> float:
        last = self.last_eval()
        return last[1] if last else math.nan

    def last_eval(self) -> tuple[int, float] | None:
        """(step, val loss) of the newest world evaluation with a finite loss, or None."""
        found = [(e.get("step"), _num(e.get("val_loss"))) for e in self.evals()]
        found = [(int(s), v) for s, v in found if isinstance(s, (int, float)) and math.isfinite(v)]
        return found[-1] if found else None


def load_run(path: str | Path) -> Run:
    """Read a run directory; `ReportError` if it has no `metrics.jsonl`."""
    p = Path(path)
    metrics = p / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{path}: no metrics.jsonl (is it a run.dir?)")
    try:
        events = [current_event(e) for e in read_metrics(metrics) if isinstance(e, dict)]
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{metrics}: cannot read ({exc})") from exc
    summary = current_summary(_read_json(p / "summary.json"), p)
    config = _read_json(p / "config.json") or _read_json(p / "launch_config.json")
    return Run(path=p, events=events, summary=summary, config=config)


# ---------------------------------------------------------------------------------------- formatting
def human_bytes(n: float | int | None) -> str:
    if n is None or not math.isfinite(float(n)):
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"  # unreachable


def _fmt_int(v: Any) -> str:
    x = _num(v)
    return f"{int(round(x)):,}" if math.isfinite(x) else "n/a"


def _fmt_float(v: Any, digits: int) -> str:
    x = _num(v)
    return f"{x:,.{digits}f}" if math.isfinite(x) else "n/a"


def _val_cell(run: Run, val: Any) -> str:
    """A finished run's final val loss; an unfinished run only has its last evaluation (maybe step 0's,
    before any training), which the cell says instead of passing it off as final."""
    text = _fmt_float(val, 3)
    last = run.last_eval()
    if run.completed or text == "n/a" or last is None:
        return text
    return f"{text} (last eval, step {last[0]})"


def table_rows(runs: list[Run]) -> list[dict[str, str]]:
    rows = []
    for r in runs:
        s = r.stats()
        frac = _num(s["blocked_frac"])
        rows.append({
            "run": r.name if r.completed else f"{r.name} (incomplete)",
            "algo": r.algo,
            "steps": _fmt_int(s["steps"]),
            "tokens": _fmt_int(s["tokens"]),
            "wall_s": _fmt_float(s["wall_s"], 1),
            "tokens/s": _fmt_int(s["tokens_per_s"]),
            "final val loss": _val_cell(r, s["final_val_loss"]),
            "cross-cluster bytes": human_bytes(s["cross_cluster_bytes"]),
            "syncs": _fmt_int(s["syncs"]),
            "anomalies": _fmt_int(s["anomalies"]),
            "blocked %": f"{100 * frac:.1f}%" if math.isfinite(frac) else "n/a",
            "downtime_s": _fmt_float(s["downtime_s"], 1),  # between launches: not in wall_s, not in tokens/s
        })
    return rows


def markdown_table(rows: list[dict[str, str]], columns: Sequence[str] = COLUMNS,
                   numeric: Collection[str] = NUMERIC_COLUMNS) -> str:
    """Aligned markdown; `numeric` columns right-aligned."""
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) if rows else len(c) for c in columns}

    def line(cells: dict[str, str]) -> str:
        return "| " + " | ".join(cells[c].rjust(widths[c]) if c in numeric else cells[c].ljust(widths[c])
                                 for c in columns) + " |"

    rule = "|" + "|".join(("-" * (widths[c] + 1) + ":") if c in numeric else ("-" * (widths[c] + 2))
                          for c in columns) + "|"
    return "\n".join([line({c: c for c in columns}), rule, *(line(r) for r in rows)])
