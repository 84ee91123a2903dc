"""The plot of `benchmarks/penalty_faults.py`, drawn from its JSON result (so it can be redrawn from the file):
one panel per fault kind (and each oracle) with every cluster's `weight` per sync for the first seed at the
smallest cluster count, the fault window's syncs shaded, flagged syncs marked (×) and updates taken back a sync
later marked (▼); then the final val loss of
each kind over the clean run and over the oracle run, per cluster count (bar: mean over seeds, whiskers: best, worst).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import _common as C

COLORS = ("tab:blue", "tab:red", "tab:green", "tab:purple", "tab:brown", "tab:olive")


def _weights_panel(ax: Any, run: dict[str, Any], title: str, interval: int) -> None:
    trace = run["trace"]
    steps = dict(zip(trace["syncs"], trace["steps"]))
    for i, (cluster, ws) in enumerate(sorted(trace["weights"].items())):
        faulty = cluster == run["faulty"]
        color = COLORS[i % len(COLORS)]
        ax.plot(trace["steps"], ws, color=color, lw=2.0 if faulty else 1.2, alpha=0.9, zorder=3 if faulty else 2,
                label=f"{cluster}{' (faulty)' if faulty else ''}", drawstyle="steps-mid")
        flagged = [k for k in trace["anomalous"][cluster] if k in steps]
        if flagged:
            ax.scatter([steps[k] for k in flagged], [ws[trace["syncs"].index(k)] for k in flagged], marker="x",
                       s=28, color=color, zorder=5)
    faulty_ws = trace["weights"].get(run["faulty"], [])
    back = [int(k) for k in run.get("c1_retracted", {}) if int(k) in steps]  # updates taken back a sync later
    if back and faulty_ws:
        ax.scatter([steps[k] for k in back], [faulty_ws[trace["syncs"].index(k)] for k in back], marker="v", s=40,
                   color="black", zorder=6, label="taken back (probe)")
    win = [steps[k] for k in run["window_syncs"] if k in steps]
    if win:
        ax.axvspan(min(win) - interval / 2, max(win) + interval / 2, color="orange", alpha=0.2,
                   label="fault window syncs")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step (sync)")
    ax.set_ylabel("weight in the merged update")
    ax.grid(alpha=0.3)


def _ratio_panel(ax: Any, rows: list[dict[str, Any]], key: str, bound: float, title: str) -> None:
    kinds = list(dict.fromkeys(r["kind"] for r in rows if r.get(f"{key}_mean") is not None))
    counts = sorted({r["clusters"] for r in rows})
    width = 0.8 / max(len(counts), 1)
    for j, n in enumerate(counts):
        mean, worst, best = [], [], []
        for kind in kinds:
            r = next((r for r in rows if r["clusters"] == n and r["kind"] == kind), {})
            m, w, b = r.get(f"{key}_mean"), r.get(f"{key}_worst"), r.get(f"{key}_best")
            mean.append(m if m is not None else math.nan)
            worst.append((w - m) if (w is not None and m is not None) else 0.0)
            best.append((m - b) if (b is not None and m is not None) else 0.0)
        xs = [i + (j - (len(counts) - 1) / 2) * width for i in range(len(kinds))]
        ax.bar(xs, [m - 1 for m in mean], width, bottom=1, color=COLORS[j % len(COLORS)], alpha=0.8,
               label=f"{n} clusters")
        ax.errorbar(xs, mean, yerr=[[max(b, 0) for b in best], [max(w, 0) for w in worst]], fmt="none", ecolor="black",
                    capsize=2, lw=0.8)
    ax.axhline(bound, color="black", ls="--", lw=1, label=f"target {bound}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(kinds)), kinds, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


def plot(result: dict[str, Any], path: Path) -> Path:
    plt = C.pyplot()
    setup = result["setup"]
    traced = [r for r in result["runs"] if r.get("trace") and r["run"] not in ("clean", "clean_jitter")]
    n0 = min((r["clusters"] for r in traced), default=0)
    panels = [r for r in traced if r["clusters"] == n0]
    order = {k: i for i, k in enumerate(setup["kinds"])}
    panels.sort(key=lambda r: (order.get(r["run"], len(order)), r["run"]))
    total = len(panels) + 2
    ncols = 3 if total <= 6 else 4
    nrows = math.ceil(total / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, run in zip(flat, panels):
        share = run.get("weight0_share")
        title = (f"{run['run']} on {run['faulty']} ({n0} clusters, seed {run['seed']})\n{run['faulty']} weight 0 at "
                 f"{C.fmt(share, '.0%')} of {len(run['window_syncs'])} window syncs")
        _weights_panel(ax, run, title, setup["interval"])
    flat[0].legend(fontsize=7, loc="lower left")
    rows = result["rows"]
    tokens = {r.get("final_val_tokens") for r in result["runs"]}
    on = f" on {tokens.pop():,} val tokens" if len(tokens) == 1 and None not in tokens else ""
    bars = "(bar: mean over seeds, whiskers: best, worst)"
    _ratio_panel(flat[len(panels)], rows, "vs_clean", setup["targets"]["vs_clean"],
                 f"final val loss{on} / clean (oracles: the lost tokens)\n{bars}")
    _ratio_panel(flat[len(panels) + 1], [r for r in rows if not r["kind"].startswith("oracle_")], "vs_oracle",
                 setup["targets"]["vs_oracle"], f"final val loss{on} / its oracle\n{bars}")
    for ax in flat[total:]:
        ax.set_visible(False)
    fig.suptitle(f"verified rule, EDiT H={setup['interval']}, W={setup['warmup_syncs']}: fault on c1 for steps "
                 f"[{setup['window'][0]}, {setup['window'][1]}) of {setup['steps']} (x: flagged)", fontsize=10)
    return C.save_fig(fig, path)
