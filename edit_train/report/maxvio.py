"""`expert_maxvio.png`: how balanced the experts are, per site and for the federation, over the run.

From the `sync` events' `expert_bias` (algo.expert_bias, local_sgd/moe/expert_bias.py): at every committed sync each
cluster's MaxVio (max over the experts it owns of its interval load / mean load − 1) and the federation's (of the
summed load), per MoE layer. One row of panels per run, one panel per MoE layer (up to `MAX_LAYERS`, then the mean
over the layers in the last panel): one line per cluster, the federation in black. `maxvio_series` extracts the
numbers, so they are checked without drawing. Runs without them get a "no expert-bias syncs" panel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edit_train.report.model import Run, _num
from edit_train.report.plots import _colors, _figure, _no_data

MAX_LAYERS = 4


@dataclass
class MaxVio:
    syncs: list[float]  # the sync index of each point
    clusters: dict[str, list[list[float]]]  # cluster -> per sync, per MoE layer
    federation: list[list[float]]  # per sync, per MoE layer
    rule: str

    @property
    def layers(self) -> int:
        return len(self.federation[0]) if self.federation else 0


def maxvio_series(run: Run) -> MaxVio | None:
    """The MaxVio the first cluster's `sync` events report (every cluster reports the same numbers), by sync."""
    first = min((e.get("cluster_index", 0) for e in run.of("sync") if isinstance(e.get("expert_bias"), dict)),
                default=None)
    if first is None:
        return None
    by: dict[float, dict] = {}
    for e in run.of("sync"):
        eb = e.get("expert_bias")
        if e.get("cluster_index", 0) == first and isinstance(eb, dict) and isinstance(eb.get("maxvio"), dict) \
                and eb["maxvio"].get("federation"):
            by[_num(e.get("sync"))] = eb
    if not by:
        return None
    syncs = sorted(by)
    fed = [[float(v) for v in by[s]["maxvio"]["federation"]] for s in syncs]
    names = sorted({n for s in syncs for n in (by[s]["maxvio"].get("clusters") or {})})
    nan = [float("nan")] * len(fed[0])
    clusters = {n: [[float(v) for v in (by[s]["maxvio"].get("clusters") or {}).get(n, nan)] for s in syncs]
                for n in names}
    return MaxVio(syncs, clusters, fed, str(by[syncs[-1]].get("rule", "")))


def _layer(values: list[list[float]], i: int | None) -> list[float]:
    return [sum(v) / len(v) if i is None else v[i] for v in values]


def plot_maxvio(runs: list[Run], out: Path) -> Path:
    data = [(r, maxvio_series(r)) for r in runs]
    cols = max((min(d.layers, MAX_LAYERS) + (d.layers > MAX_LAYERS) for _, d in data if d is not None), default=1)
    fig = _figure(max(6.0, 3.6 * cols), 2.9 * len(runs) + 0.6)
    axes = fig.subplots(len(runs), cols, squeeze=False)
    for row, (r, d) in zip(axes, data):
        if d is None:
            _no_data(row[0], "no expert-bias syncs (a model without an expert bias, or no local SGD)")
            for ax in row:
                ax.set_xticks([])
                ax.set_yticks([])
            row[0].set_title(r.label, fontsize=10)
            continue
        panels: list[int | None] = list(range(min(d.layers, MAX_LAYERS)))
        if d.layers > MAX_LAYERS:
            panels.append(None)
        for ax, i in zip(row, panels):
            for (name, values), color in zip(d.clusters.items(), _colors(len(d.clusters))):
                ax.plot(d.syncs, _layer(values, i), color=color, lw=1.2, label=name)
            ax.plot(d.syncs, _layer(d.federation, i), color="black", lw=2.0, label="federation")
            ax.set_title(f"{r.label} · {'mean over MoE layers' if i is None else f'MoE layer {i}'}"
                         f" ({d.rule})", fontsize=9)
            ax.set_xlabel("sync", fontsize=8)
            ax.set_ylabel("MaxVio", fontsize=8)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
        for ax in row[len(panels):]:
            ax.axis("off")
    fig.suptitle("Expert balance: MaxVio (max load / mean load − 1) per cluster, the federation in black",
                 fontsize=11)
    path = out / "expert_maxvio.png"
    fig.savefig(path)
    return path
