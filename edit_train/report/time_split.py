"""Where every second went, per cluster and run: the report's `time.png` and its markdown table.

Reads `summary.json` `per_cluster.time` (docs/architecture.md §5) of finished runs; for a run that did not finish, the
`time_s` windows of its `train` events summed per cluster (the loop's time up to the last logged step; its
start-up and final eval are not in any window).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from edit_train.report.model import Run, _num, markdown_table
from edit_train.report.plots import _figure, _no_data
from edit_train.timing import BUCKETS

BUCKET_COLORS = {"compute": "tab:green", "slowdown": "tab:olive", "eval": "tab:purple", "sync": "tab:orange",
                 "probe": "tab:pink", "blocked": "tab:red", "checkpoint": "tab:brown", "data": "tab:cyan",
                 "startup": "tab:blue", "other": "0.75"}


def cluster_times(run: Run) -> dict[str, dict[str, float]]:
    """{cluster: {bucket: seconds, "wall_s": seconds}}, in the run's cluster order."""
    out: dict[str, dict[str, float]] = {}
    for name, c in run.per_cluster.items():
        t = c.get("time") if isinstance(c, dict) else None
        if isinstance(t, dict) and all(math.isfinite(_num(t.get(b))) for b in (*BUCKETS, "wall_s")):
            out[str(name)] = {k: _num(t[k]) for k in (*BUCKETS, "wall_s")}
    if out:
        return out
    for e in run.of("train"):  # an unfinished run: sum the windows its train events carry
        split = e.get("time_s")
        if not isinstance(split, dict):
            continue
        name = e.get("cluster") if isinstance(e.get("cluster"), str) else run.cluster_name(e.get("cluster_index", 0))
        acc = out.setdefault(name, dict.fromkeys((*BUCKETS, "wall_s"), 0.0))
        for k in acc:
            v = _num(split.get(k))
            acc[k] += v if math.isfinite(v) else 0.0
    return out


def time_rows(runs: list[Run]) -> list[tuple[str, str, dict[str, float]]]:
    return [(r.label, name, t) for r in runs for name, t in cluster_times(r).items()]


def draw_breakdown(ax: Any, rows: list[tuple[str, dict[str, float]]], title: str | None = None) -> None:
    """One stacked horizontal bar per row (label, {bucket: seconds, "wall_s": seconds}): each bucket's share
    of that wall time, labelled where it is wide enough, the wall seconds at the end."""
    for i, (_, t) in enumerate(rows):
        left, wall = 0.0, max(t["wall_s"], 1e-9)
        for b in BUCKETS:
            share = max(t[b], 0.0) / wall
            if share <= 0:
                continue
            ax.barh(i, share, left=left, color=BUCKET_COLORS[b], edgecolor="white", linewidth=0.5)
            if share >= 0.06:
                ax.text(left + share / 2, i, f"{100 * share:.0f}%", ha="center", va="center", fontsize=7)
            left += share
        ax.text(1.01, i, f"{t['wall_s']:.0f}s", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.07)
    ax.set_title(title or "Where every second goes, per cluster: each bucket's share of its wall time",
                 fontsize=10, pad=22 if rows else 6)
    if rows:
        from matplotlib.patches import Patch

        handles = [Patch(facecolor=BUCKET_COLORS[b], label=b) for b in BUCKETS]
        ax.legend(handles=handles, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=len(BUCKETS),
                  frameon=False, handlelength=1.2, columnspacing=0.8)


def plot_time(runs: list[Run], out: Path) -> Path:
    """The report's `time.png`: one bar per (run, cluster)."""
    rows = [(f"{label} · {cluster}", t) for label, cluster, t in time_rows(runs)]
    fig = _figure(12, 1.2 + 0.45 * max(len(rows), 2))
    ax = fig.subplots()
    if not rows:
        _no_data(ax, "no time breakdown recorded (runs from before per_cluster.time)")
    draw_breakdown(ax, rows)
    path = out / "time.png"
    fig.savefig(path)
    return path


def time_table(runs: list[Run]) -> str:
    """Markdown: one row per (run, cluster), the wall seconds and every bucket's share of it."""
    rows = time_rows(runs)
    if not rows:
        return ""
    numeric = ("wall s", *BUCKETS)
    cells = [{"run": label, "cluster": cluster, "wall s": f"{t['wall_s']:.1f}",
              **{b: f"{100 * t[b] / max(t['wall_s'], 1e-9):.1f}%" for b in BUCKETS}} for label, cluster, t in rows]
    return markdown_table(cells, ("run", "cluster", *numeric), numeric)
