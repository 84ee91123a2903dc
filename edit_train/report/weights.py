"""`weights.png`: each cluster's weight in the merged update per sync, with the injected faults shaded.

One panel per run: a line per cluster of the `weight` its `sync` events report (its coefficient in the
merged update; 0 when every module left it out), a red × where that sync flagged the cluster anomalous, a
black ▼ on a sync whose update of that cluster a later sync took back (the others' probes found it harmful,
`retracted` in the sync events), and each fault window of `config.json`'s `faults` shaded ([start, end) in
steps; `kill`, `kill_cluster` and `partition` happen at one step and are drawn as a vertical line). Runs without sync events (DDP, a lone
cluster) get a "no syncs" panel.

The data is extracted by pure functions (`weight_series`, `retractions`, `fault_windows`) so it can be checked
without drawing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edit_train.report.model import Run, _num
from edit_train.report.plots import CLUSTER_STYLES, _colors, _figure, _no_data, _panel_grid

log = logging.getLogger(__name__)

#: fault kinds that happen at one step (their window is drawn as a vertical line, `end` is None)
INSTANT_KINDS = ("kill", "kill_cluster", "partition")
_NO_END = 1 << 62  # parse_faults' `end` when the spec gives none: the fault lasts to the end of the run
FAULT_HATCHES = ("//", "\\\\", "xx", "..", "++", "oo")
MARKERS = ("o", "s", "^", "D", "v", "P")


def _placed(run: Run) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(cluster index, step, event) of every `sync` event that says which cluster and which step it is."""
    for e in run.syncs():
        g, step = e.get("cluster_index", 0), _num(e.get("step"))
        if isinstance(g, int) and not isinstance(g, bool) and math.isfinite(step):
            yield g, int(step), e


def weight_series(run: Run) -> dict[str, list[tuple[int, float, bool]]]:
    """{cluster name: [(step, weight, anomalous), ...] by step} from the run's `sync` events (deduplicated on
    (sync, cluster)), clusters in index order; a missing/null weight is NaN. Empty without sync events."""
    by_group: dict[int, list[tuple[int, float, bool]]] = {}
    for g, step, e in _placed(run):
        by_group.setdefault(g, []).append((step, _num(e.get("weight")), bool(e.get("anomalous"))))
    return {run.cluster_name(g): sorted(by_group[g], key=lambda p: p[0]) for g in sorted(by_group)}


def retractions(run: Run) -> list[tuple[str, int, float, int]]:
    """[(cluster name, step of the taken-back sync, the weight it had there, sync that took it back), ...] from
    the `retracted` field of the run's `sync` events (each cluster reports the same; counted once)."""
    at: dict[tuple[str, int], tuple[int, float]] = {}
    taken: dict[tuple[str, int], int] = {}
    for g, step, e in _placed(run):
        k = e.get("sync")
        if not isinstance(k, int):
            continue
        at[(run.cluster_name(g), k)] = (step, _num(e.get("weight")))
        back = e.get("retracted")
        for who, v in (back.items() if isinstance(back, dict) else []):
            if isinstance(v, dict) and isinstance(v.get("sync"), int):
                taken.setdefault((str(who), v["sync"]), k)
    return sorted((who, *at[(who, k)], by) for (who, k), by in taken.items() if (who, k) in at)


def fault_windows(run: Run) -> list[tuple[str, int, float | None]]:
    """[(label "<kind> on <cluster>", start, end), ...] of the run's configured faults, in config order: `end`
    is exclusive, `math.inf` for a window that lasts to the end of the run, None for a fault that happens at
    one step (`kill`, `kill_cluster`, `partition`). Read with `sim.faults.parse_faults` (the trainer's own
    reading); an entry it rejects is skipped with a warning."""
    return [(f"{kind} on {target}", start, end) for kind, target, start, end in _faults(run)]


def _faults(run: Run) -> list[tuple[str, str, int, float | None]]:
    """(kind, cluster name, start, end) of each configured fault (see `fault_windows`)."""
    specs = (run.config or {}).get("faults")
    if not isinstance(specs, list) or not specs:
        return []
    # imported here, not at the top: sim.faults imports torch (~2 s), which a run without faults need not pay
    from edit_train.sim.faults import FaultError, parse_faults

    out: list[tuple[str, str, int, float | None]] = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            log.warning("%s: config.json faults[%d] skipped (not a mapping: %r)", run.path, i, spec)
            continue
        try:
            (fault,) = parse_faults([spec])
        except FaultError as exc:
            log.warning("%s: config.json faults[%d] skipped (%s)", run.path, i, exc)
            continue
        target = fault.cluster or run.cluster_name(fault.group)
        if fault.kind in INSTANT_KINDS:
            end: float | None = None
        else:
            end = math.inf if fault.end >= _NO_END else float(fault.end)
        out.append((fault.kind, target, fault.start, end))
    return out


def weights_figure(runs: list[Run]):  # type: ignore[no-untyped-def]
    """The `weights.png` figure (a matplotlib `Figure`), one panel per run."""
    nrows, ncols = _panel_grid(len(runs))
    fig = _figure(8 * ncols if ncols > 1 else 9.5, 3.4 * nrows + 0.5)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(runs):]:
        ax.set_visible(False)
    for r, ax in zip(runs, axes):
        _panel(ax, r)
    fig.suptitle("Each cluster's weight in the merged update per sync (red ×: flagged anomalous; ▼: taken back; "
                 "shaded: injected fault)", fontsize=11)
    return fig


def _panel(ax: Any, r: Run) -> None:
    series = weight_series(r)
    ax.set_title(r.label, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("weight in merged update")
    if not series or not any(math.isfinite(w) for pts in series.values() for _, w, _ in pts):
        _no_data(ax, "no syncs" if not series else "sync events carry no weight")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    names = [name for _, name in r.clusters]
    names += [n for n in series if n not in names]
    color_of = dict(zip(names, _colors(len(names))))
    for k, (name, pts) in enumerate(series.items()):
        ax.plot([s for s, _, _ in pts], [w for _, w, _ in pts], CLUSTER_STYLES[k % len(CLUSTER_STYLES)],
                marker=MARKERS[k % len(MARKERS)], ms=4, lw=1.4, color=color_of[name], label=name, zorder=3)
    # after every line, so the legend lists the clusters first; a flagged sync without a weight sits at 0
    bad = [(s, w if math.isfinite(w) else 0.0) for pts in series.values() for s, w, a in pts if a]
    if bad:
        xs, ys = zip(*bad)
        ax.plot(xs, ys, "x", color="red", ms=9, mew=2, zorder=4, label="anomalous (some module rejected it)")
    back = [(s, w if math.isfinite(w) else 0.0) for _, s, w, _ in retractions(r)]
    if back:
        xs, ys = zip(*back)
        ax.plot(xs, ys, "v", color="black", ms=8, zorder=5, label="taken back at the next sync (probe)")
    n = len(series)
    if n > 1:
        ax.axhline(1 / n, color="0.5", lw=0.8, ls=":", zorder=1, label=f"equal share 1/{n}")
    _shade_faults(ax, r, color_of)
    ax.set_ylim(-0.04, max(1.0, max((w for p in series.values() for _, w, _ in p if math.isfinite(w)),
                                    default=1.0)) * 1.06)
    total = sum(len(pts) for pts in series.values())
    ax.set_title(f"{r.label} — {len(bad)} anomalous of {total} cluster-syncs", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _shade_faults(ax: Any, r: Run, color_of: dict[str, Any]) -> None:
    """Each fault window in the color of the cluster it hits (grey for a cluster the run has no events of)."""
    windows = _faults(r)
    if not windows:
        return
    from matplotlib.colors import to_rgba

    lo, hi = ax.get_xlim()
    finite = [x for _, _, s, e in windows for x in (s, e) if x is not None and math.isfinite(x)]
    lo, hi = min(lo, *finite), max(hi, *finite)
    for k, (kind, target, start, end) in enumerate(windows):
        label = f"{kind} on {target}"
        color = color_of.get(target, "0.35")
        if end is None:
            ax.axvline(start, color=color, ls="--", lw=1.6, zorder=2, label=label)
            continue
        # alpha in the colors, not `alpha=`: that would wash out the hatch and the edge too
        ax.axvspan(start, hi if math.isinf(end) else end, facecolor=to_rgba(color, 0.12),
                   edgecolor=to_rgba(color, 0.7), lw=0.8, hatch=FAULT_HATCHES[k % len(FAULT_HATCHES)], zorder=0,
                   label=label if math.isfinite(end) else f"{label} (to the end)")
    ax.set_xlim(lo, hi)


def plot_weights(runs: list[Run], out: Path) -> Path:
    """Draw `weights.png` into `out`."""
    fig = weights_figure(runs)
    path = out / "weights.png"
    fig.savefig(path)
    return path
