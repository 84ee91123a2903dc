"""`expert_clusters.png`: which cluster feeds which expert.

One panel per run, from its `experts` events (train/routing.py: the tokens each cluster's MoE layers routed
to each expert over each interval): for every MoE layer a block of rows, one per cluster, and a column per
expert; a cell is that cluster's share of the tokens routed to that expert over the run (or its last
`last` intervals per cluster), white at the uniform share 1/clusters, red above it, blue below. With
clusters that see the same data every cell is near white; on per-site data an expert one site feeds shows
as one red cell in its column. Runs without `experts` events
get a "no experts events" panel. `routed_shares` extracts the numbers, so they are checked without drawing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edit_train.report.model import Run, _num
from edit_train.report.plots import _figure, _no_data, _percent_formatter


@dataclass
class RoutedShares:
    layers: list[int]  # decoder-layer index of each MoE layer
    clusters: list[str]  # cluster names, by index
    counts: np.ndarray  # [layers, experts, clusters] routed tokens
    intervals: list[int]  # intervals summed, per cluster

    @property
    def shares(self) -> np.ndarray:
        """[layers, experts, clusters]: each cluster's share of the tokens routed to the expert (0 where none)."""
        total = self.counts.sum(axis=2, keepdims=True)
        return np.divide(self.counts, total, out=np.zeros_like(self.counts, dtype=float), where=total > 0)


def _intervals(run: Run) -> dict[int, list[dict[str, Any]]]:
    """Each cluster's `experts` events by step (one per step: a restarted cluster's re-logged step keeps its
    last record), by cluster index."""
    by: dict[int, dict[float, dict[str, Any]]] = {}
    for e in run.of("experts"):
        g = e.get("cluster_index")
        if isinstance(g, int) and not isinstance(g, bool) and isinstance(e.get("counts"), list):
            by.setdefault(g, {})[_num(e.get("step"))] = e
    return {g: [by[g][s] for s in sorted(by[g])] for g in sorted(by)}


def routed_shares(run: Run, last: int = 0) -> RoutedShares | None:
    """The run's routed tokens per (MoE layer, expert, cluster), summed over every interval (`last` > 0: each
    cluster's last `last` intervals). None without `experts` events of one shape."""
    per = _intervals(run)
    sums: dict[int, np.ndarray] = {}
    used: dict[int, int] = {}
    layers: list[int] = []
    for g, events in per.items():
        for e in events[-last:] if last > 0 else events:
            try:
                c = np.array(e["counts"], dtype=float)
            except (TypeError, ValueError):
                continue
            if c.ndim != 2 or c.size == 0 or (sums and c.shape != next(iter(sums.values())).shape):
                continue
            sums[g] = sums.get(g, 0) + c
            used[g] = used.get(g, 0) + 1
            layers = list(e.get("layers") or layers)
    if not sums:
        return None
    order = sorted(sums)
    counts = np.stack([sums[g] for g in order], axis=2)
    if len(layers) != counts.shape[0]:
        layers = list(range(counts.shape[0]))
    return RoutedShares(layers, [run.cluster_name(g) for g in order], counts, [used[g] for g in order])


def plot_expert_clusters(runs: list[Run], out: Path, last: int = 0) -> Path:
    from matplotlib.colors import TwoSlopeNorm

    data = [(r, routed_shares(r, last)) for r in runs]
    rows = [(d.counts.shape[0] * d.counts.shape[2] if d is not None else 2) for _, d in data]
    max_e = max((d.counts.shape[1] for _, d in data if d is not None), default=8)
    fig = _figure(max(7.0, 0.62 * max_e + 4.2), max(3.5, sum(0.32 * h + 1.3 for h in rows) + 0.5))
    axes = fig.subplots(len(runs), 1, squeeze=False, height_ratios=[h + 2.0 for h in rows]).ravel()
    for ax, (r, d) in zip(axes, data):
        if d is None:
            _no_data(ax, "no experts events (a run before routed-token counts, or without MoE layers)")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(r.label, fontsize=10)
            continue
        n_layers, n_experts, n_clusters = d.counts.shape
        grid = d.shares.transpose(0, 2, 1).reshape(n_layers * n_clusters, n_experts)  # rows: (layer, cluster)
        norm = TwoSlopeNorm(vcenter=1 / n_clusters, vmin=0.0, vmax=1.0) if n_clusters > 1 else None
        image = ax.imshow(grid, cmap="RdBu_r", norm=norm, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(n_experts), [str(i) for i in range(n_experts)], fontsize=8)
        ax.set_yticks(range(len(grid)), [f"layer {layer} · {name}" for layer in d.layers for name in d.clusters],
                      fontsize=7)
        ax.set_xlabel("expert", fontsize=8)
        for k in range(1, n_layers):
            ax.axhline(k * n_clusters - 0.5, color="white", lw=1.5)
        if n_experts <= 24 and len(grid) <= 48:
            for (i, j), v in np.ndenumerate(grid):
                far = abs(v - 1 / n_clusters) > 0.6 * max(1 / n_clusters, 1 - 1 / n_clusters)
                ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=6,
                        color="white" if far else "black")
        cbar = fig.colorbar(image, ax=ax, shrink=0.9, pad=0.01)
        cbar.set_label("cluster's share of the expert's tokens", fontsize=8)
        cbar.ax.yaxis.set_major_formatter(_percent_formatter())
        window = f"last {last} intervals" if last > 0 else "whole run"
        ax.set_title(f"{r.label} — share of each expert's routed tokens by cluster ({window}: "
                     f"{', '.join(f'{n} {k}' for n, k in zip(d.clusters, d.intervals))} intervals); "
                     f"uniform {100 / n_clusters:.0f}%", fontsize=9)
    fig.suptitle("Which cluster feeds which expert", fontsize=11)
    path = out / "expert_clusters.png"
    fig.savefig(path)
    return path
