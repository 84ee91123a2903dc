"""The report's figures (headless matplotlib `Figure` objects, no pyplot): one function per PNG."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edit_train.report.model import Run, _num

DPI = 110


# -------------------------------------------------------------------------------------------- plots
def _figure(width: float, height: float):  # type: ignore[no-untyped-def]
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


CLUSTER_STYLES = ("-", "--", ":", "-.")


def _no_data(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4", fontsize=11)


def _wrap(label: str, width: int = 22) -> str:
    return "\n".join(textwrap.wrap(label, width, break_long_words=True, break_on_hyphens=False)) or label


def plot_val_loss(runs: list[Run], out: Path, x: str) -> Path:
    """World val loss vs `tokens` or `wall`: one line per run, or per cluster where the clusters evaluate at their
    own step counts (A-EDiT: `Run.world_eval_series`), one colour per run; vs wall also each cluster's evals of
    its own replica (`scope: "cluster"`), dashed."""
    fig = _figure(8, 4.8)
    ax = fig.add_subplot()
    drawn = False
    for r, color in zip(runs, _colors(len(runs))):
        series = r.world_eval_series(x)  # one line, or one per cluster where each evaluates at its own steps
        shown = False
        for (g, pts), style in zip(series.items(), CLUSTER_STYLES * 8):
            pts = [(a, b) for a, b in pts if math.isfinite(a) and math.isfinite(b)]
            if not pts:
                continue
            xs, ys = zip(*pts)
            name = r.label if g is None else f"{r.label} {r.cluster_name(g)}"
            ax.plot(xs, ys, style, marker="o", ms=4, color=color, label=f"{name}: {ys[-1]:.3f}")
            ax.annotate(f"{ys[-1]:.3f}", (xs[-1], ys[-1]), xytext=(4, 0), textcoords="offset points",
                        va="center", fontsize=8, color=color)
            drawn = shown = True
        if not shown:
            ax.plot([], [], color=color, label=f"{r.label}: no world evals")
        if x == "wall":
            for g, style in zip(r.eval_clusters(), CLUSTER_STYLES[1:] * 8):
                gp = [(_num(e.get("wall")), _num(e.get("val_loss"))) for e in r.evals(g)]
                gp = [(a, b) for a, b in gp if math.isfinite(a) and math.isfinite(b)]
                if gp:
                    gx, gy = zip(*gp)
                    ax.plot(gx, gy, style, lw=1, alpha=0.7, color=color,
                            label=f"{r.label} {r.cluster_name(g)} (own replica)")
                    drawn = True
    if not drawn:
        _no_data(ax, "no eval events")
    ax.set_xlabel("tokens (all clusters)" if x == "tokens" else "wall clock (s)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"Validation loss vs {'tokens' if x == 'tokens' else 'wall clock'}")
    if x == "tokens":
        ax.xaxis.set_major_formatter(_si_formatter())
    ax.margins(x=0.07)  # room for the final-value labels
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    path = out / ("val_loss_vs_tokens.png" if x == "tokens" else "val_loss_vs_wall.png")
    fig.savefig(path)
    return path


def _si_formatter():  # type: ignore[no-untyped-def]
    from matplotlib.ticker import FuncFormatter

    def fmt(v: float, _pos: int) -> str:
        for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(v) >= div:
                return f"{v / div:g}{suffix}"
        return f"{v:g}"

    return FuncFormatter(fmt)


def _panel_grid(n: int) -> tuple[int, int]:
    cols = 1 if n <= 3 else 2
    return math.ceil(n / cols), cols


def plot_loss(runs: list[Run], out: Path) -> Path:
    """Train loss per cluster, one panel per run, a red x at each sync that flagged that cluster anomalous."""
    nrows, ncols = _panel_grid(len(runs))
    fig = _figure(8 * ncols if ncols > 1 else 9, 3.2 * nrows + 0.4)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=False).ravel()
    for ax in axes[len(runs):]:
        ax.set_visible(False)
    for r, ax in zip(runs, axes):
        clusters = r.clusters
        colors = _colors(max(len(clusters), 1))
        drawn, marked, flagged = False, False, 0
        for (g, name), color in zip(clusters, colors):
            tr = r.train(g)
            ok = np.isfinite(tr["loss"])
            if ok.any():
                ax.plot(tr["step"][ok], tr["loss"][ok], marker=".", ms=4, lw=1.3, color=color, label=name)
                drawn = True
            bad = [e for e in r.syncs(g) if e.get("anomalous")]
            flagged += len(bad)
            if not bad:
                continue
            steps = np.array([_num(e.get("step")) for e in bad])
            if ok.any():
                ys = np.interp(steps, tr["step"][ok], tr["loss"][ok])
                ax.plot(steps, ys, "x", color="red", ms=9, mew=2,
                        label=None if marked else "anomalous sync (cluster flagged)")
            else:  # no loss to sit on: mark along the bottom edge
                ax.plot(steps, np.full(len(steps), 0.03), "x", color="red", ms=9, mew=2,
                        transform=ax.get_xaxis_transform(), label=None if marked else "anomalous sync")
            marked = True
        if not drawn and not marked:
            _no_data(ax, "no train events")
        title = r.label
        if r.of("sync"):
            title += f" — {flagged} anomalous of {len(r.syncs())} cluster-syncs"
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.grid(alpha=0.3)
        if drawn or marked:
            handles, labels = ax.get_legend_handles_labels()
            order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("anomalous"))
            ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8, loc="upper left",
                      bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle("Train loss per cluster (red x: sync where that cluster's pseudo-gradient was rejected)", fontsize=11)
    path = out / "loss.png"
    fig.savefig(path)
    return path


GROUP_HATCHES = ("", "//", "..", "xx", "\\\\", "oo", "++", "--")


def _grouped_bars(ax: Any, runs: list[Run], value: Callable[[Run, str], float], fmt: Callable[[float], str],
                  missing: str = "n/a") -> bool:
    """x = runs, one bar per cluster (`value(run, cluster name)`): colored by run (as in every other plot),
    hatched by cluster index, the legend naming the clusters; the value is written on each bar. Returns whether
    anything was drawn."""
    from matplotlib.patches import Patch

    run_colors = _colors(len(runs))
    width = 0.8 / max(max((len(r.indices) for r in runs), default=1), 1)
    seen: dict[int, list[str]] = {}  # hatch (cluster index) → the names it stands for
    drawn, top = False, 0.0
    for i, r in enumerate(runs):
        clusters = r.clusters
        vals = [value(r, name) for _, name in clusters]
        if not any(math.isfinite(v) for v in vals):
            ax.text(i, 0, missing, ha="center", va="bottom", color="0.4", fontsize=9)
            continue
        for j, ((g, name), v) in enumerate(zip(clusters, vals)):
            xpos = i + (j - (len(clusters) - 1) / 2) * width
            if not math.isfinite(v):
                ax.text(xpos, 0, missing, ha="center", va="bottom", color="0.4", fontsize=8)
                continue
            ax.bar(xpos, v, width * 0.92, color=run_colors[i], edgecolor="white", linewidth=0.5,
                   hatch=GROUP_HATCHES[g % len(GROUP_HATCHES)])
            names = seen.setdefault(g, [])
            if name not in names:
                names.append(name)
            ax.annotate(fmt(v), (xpos, v), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                        fontsize=8)
            drawn, top = True, max(top, v)
    ax.set_xticks(range(len(runs)), [_wrap(r.label) for r in runs], fontsize=8)
    ax.set_xlim(-0.6, len(runs) - 0.4)
    ax.set_ylim(0, top * 1.3 if top > 0 else 1)  # headroom: value labels, then a one-line legend
    ax.grid(axis="y", alpha=0.3)
    if len(seen) > 1:
        handles = [Patch(facecolor="0.6", edgecolor="white", hatch=GROUP_HATCHES[g % len(GROUP_HATCHES)],
                         label=" / ".join(seen[g])) for g in sorted(seen)]
        ax.legend(handles=handles, fontsize=8, loc="upper right", ncols=min(len(handles), 4))
    return drawn


def plot_tokens_per_s(runs: list[Run], out: Path) -> Path:
    """Left: per-cluster tokens/s over the whole run (bars). Right: the windowed train-event throughput vs wall."""
    fig = _figure(13, 4.8)
    left, right = fig.subplots(1, 2, width_ratios=[1, 1.3])
    drawn = _grouped_bars(left, runs, lambda r, c: _num(r.stats()["per_cluster"].get(c, {}).get("tokens_per_s")),
                          lambda v: f"{v:,.0f}")
    if not drawn:
        _no_data(left, "no throughput recorded")
    left.set_ylabel("tokens/s (cluster tokens / run wall)")
    left.set_title("Throughput per cluster, whole run")
    any_curve = False
    for r, color in zip(runs, _colors(len(runs))):
        for (g, name), style in zip(r.clusters, CLUSTER_STYLES * 8):
            tr = r.train(g)
            ok = np.isfinite(tr["tokens_per_s"]) & np.isfinite(tr["wall"])
            if ok.any():
                right.plot(tr["wall"][ok], tr["tokens_per_s"][ok], style, marker=".", ms=4, color=color,
                           label=f"{r.label} {name}")
                any_curve = True
    if any_curve:
        right.legend(fontsize=7, loc="best")
        right.set_ylim(bottom=0)
    else:
        _no_data(right, "no train events")
    right.set_xlabel("wall clock (s)")
    right.set_ylabel("tokens/s (per logging window)")
    right.set_title("Throughput per cluster over time")
    right.grid(alpha=0.3)
    path = out / "tokens_per_s.png"
    fig.savefig(path)
    return path


def plot_blocked(runs: list[Run], out: Path) -> Path:
    """Time each cluster spent blocked on cross-cluster communication: seconds and share of wall clock."""
    fig = _figure(12, 4.8)
    sec, frac = fig.subplots(1, 2)
    stat = lambda key: (lambda r, c: _num(r.stats()["per_cluster"].get(c, {}).get(key)))  # noqa: E731
    if not _grouped_bars(sec, runs, stat("blocked_s"), lambda v: f"{v:.2f}s"):
        _no_data(sec, "no blocking recorded")
    if not _grouped_bars(frac, runs, lambda r, c: 100 * stat("blocked_frac")(r, c), lambda v: f"{v:.1f}%"):
        _no_data(frac, "no blocking recorded")
    sec.set_ylabel("seconds blocked")
    sec.set_title("Time blocked on cross-cluster sync")
    frac.set_ylabel("% of wall clock")
    frac.set_title("Share of wall clock blocked")
    fig.suptitle("Blocked on cross-cluster communication (DDP: gradient all-reduce; local SGD: the syncs)",
                 fontsize=10)
    path = out / "blocked.png"
    fig.savefig(path)
    return path


def expert_shares(r: Run) -> tuple[np.ndarray | None, str]:
    """[layers, experts] share of each MoE layer's routed tokens, summing every cluster's last `moe` event."""
    last: dict[Any, dict[str, Any]] = {}
    for e in r.of("moe"):
        g = e.get("cluster_index", 0)
        newer = g not in last or _num(e.get("step")) >= _num(last[g].get("step"))
        if isinstance(e.get("expert_load"), list) and newer:
            last[g] = e
    total: np.ndarray | None = None
    steps = []
    for e in last.values():
        try:
            load = np.array(e["expert_load"], dtype=float)
        except (TypeError, ValueError):  # ragged: layers with different expert counts are not a grid
            continue
        if load.ndim != 2 or load.size == 0:
            continue
        if total is None:
            total = np.nan_to_num(load)
        elif total.shape == load.shape:
            total = total + np.nan_to_num(load)
        else:
            continue
        steps.append(int(_num(e.get("step"))) if math.isfinite(_num(e.get("step"))) else -1)
    if total is None:
        return None, ""
    rows = total.sum(axis=1, keepdims=True)
    shares = np.divide(total, rows, out=np.zeros_like(total), where=rows > 0)
    where = f"step {steps[0]}" if len(set(steps)) == 1 else f"steps {min(steps)}–{max(steps)}"
    return shares, f"{where}, {len(steps)} cluster{'s' if len(steps) != 1 else ''}"


def _layer_names(r: Run, n: int) -> list[str]:
    model = (r.config or {}).get("model") or {}
    k, total = model.get("first_k_dense_replace"), model.get("num_hidden_layers")
    if isinstance(k, int) and isinstance(total, int) and total - k == n:
        return [f"layer {k + i}" for i in range(n)]
    return [f"MoE {i}" for i in range(n)]


def _ratio(row: np.ndarray) -> str:
    lo, hi = float(row.min()), float(row.max())
    if hi <= 0:
        return "no tokens"
    if lo <= 0:
        return f"max/min ∞ ({int((row <= 0).sum())} idle)"
    ratio = hi / lo
    return f"max/min {ratio:.1f}×" if ratio < 100 else f"max/min {ratio:,.0f}×"


def plot_expert_load(runs: list[Run], out: Path) -> Path:
    data = [(r, *expert_shares(r)) for r in runs]
    vmax = max((float(s.max()) for _, s, _ in data if s is not None), default=1.0) or 1.0
    heights = [(s.shape[0] if s is not None else 2) for _, s, _ in data]
    max_e = max((s.shape[1] for _, s, _ in data if s is not None), default=8)
    fig = _figure(max(7.0, 0.62 * max_e + 4.2), sum(0.5 * h + 1.2 for h in heights) + 0.5)
    axes = fig.subplots(len(runs), 1, squeeze=False, height_ratios=[h + 1.6 for h in heights]).ravel()
    image = None
    for ax, (r, shares, where) in zip(axes, data):
        if shares is None:
            _no_data(ax, "no moe events")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(r.label, fontsize=10)
            continue
        n_layers, n_experts = shares.shape
        image = ax.imshow(shares, cmap="viridis", vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(n_experts), [str(i) for i in range(n_experts)], fontsize=8)
        ax.set_yticks(range(n_layers), _layer_names(r, n_layers), fontsize=8)
        ax.set_xlabel("expert", fontsize=8)
        right = ax.secondary_yaxis("right")
        right.set_yticks(range(n_layers), [_ratio(row) for row in shares], fontsize=8)
        right.tick_params(length=0)
        if n_experts <= 24 and n_layers <= 32:
            for (i, j), v in np.ndenumerate(shares):
                ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=7,
                        color="white" if v < 0.6 * vmax else "black")
        ax.set_title(f"{r.label} — last moe event ({where}); cell = % of layer's tokens, uniform "
                     f"{100 / n_experts:.1f}%", fontsize=9)
    if image is not None:
        cbar = fig.colorbar(image, ax=list(axes), shrink=0.9, pad=0.01)
        cbar.set_label("share of the layer's tokens", fontsize=8)
        cbar.ax.yaxis.set_major_formatter(_percent_formatter())
    fig.suptitle("Expert load per MoE layer", fontsize=11)
    path = out / "expert_load.png"
    fig.savefig(path)
    return path


def _percent_formatter():  # type: ignore[no-untyped-def]
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(xmax=1.0, decimals=0)
