"""A plan's outputs: the table (text), the JSON, the plot, and the recommendation block with its overrides."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from edit_train.plan.planner import Plan, summary_line


def _fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def table(plan: Plan, top: int = 25) -> str:
    """The best `top` candidates by ddp-equivalent tokens/s (every one is in the JSON)."""
    rows = sorted(plan.rows, key=lambda r: -r.effective)[:top]
    names = plan.scenario.clusters
    head = ["candidate", "tokens/s", *[f"blk {c.name}" for c in names], "goodput", "B/token", "MB/s",
            "×tokens", "ddp-eq tok/s", "fits"]
    body = []
    for r in rows:
        body.append([r.cand.label, _fmt(r.tokens_per_s, ",.0f"),
                     *[_fmt(r.blocked.get(c.name, 0.0) * 100, ".1f") + "%" for c in names],
                     _fmt(r.goodput, ".3f"), _fmt(r.bytes_per_token, ",.1f"), _fmt(r.bytes_per_s / 1e6, ",.2f"),
                     f"{r.multiplier:.2f}±{r.multiplier_err:.2f}", _fmt(r.effective, ",.0f"),
                     "yes" if r.fits else "no"])
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
             for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def recommendation(plan: Plan) -> str:
    b = plan.best
    lines = [f"recommendation: {summary_line(b)}",
             "  edit-train overrides (the same on every cluster):",
             "    " + " ".join(_quote(o) for o in plan.overrides)]
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def subsets_block(plan: Plan) -> str:
    """What the scenario's expert subsets save, per cluster, in one short block ("" when off)."""
    sub = plan.subsets
    if not sub:
        return ""
    lines = [f"expert subsets ({sub['spec']}; on {sub['candidate']}; the loss model does not charge them: "
             "docs/noniid.md measures their cost):"]
    for name, c in sub["clusters"].items():
        lines.append(f"  {name}: {c['bytes_per_sync'] / 1e6:,.2f} MB/sync instead of "
                     f"{c['bytes_per_sync_every_expert'] / 1e6:,.2f} (-{c['bytes_saved_fraction']:.1%}), at_end sync "
                     f"{c['at_end_sync_s']:.3g} s instead of {c['at_end_sync_s_every_expert']:.3g}; per rank "
                     f"+{c['frozen_copy_bytes_per_rank'] / 1e6:,.1f} MB frozen-rows copy, no optimizer state saved")
    lines += [f"  note: {sub['note']}"] if sub["note"] else []
    return "\n".join(lines)


def _quote(o: str) -> str:
    return f"'{o}'" if any(ch in o for ch in "[]{},") else o


def to_json(plan: Plan) -> dict[str, Any]:
    s = plan.scenario
    return {"scenario": s.name, "model": s.model, "accelerators": s.accelerators,
            "clusters": [{"name": c.name, "ranks": c.ranks, "accelerator": c.accelerator, "step_s": c.step_s}
                         for c in s.clusters],
            "horizon_h": s.hours if not s.steps else None, "steps": s.steps or None,
            "recommendation": {**plan.best.to_json(), "overrides": plan.overrides},
            "candidates": [r.to_json() for r in sorted(plan.rows, key=lambda r: -r.effective)],
            "loss_model": plan.loss.to_json(), "profile_calibrated": plan.profile.calibrated,
            "profile_fit": plan.profile.fit, "notes": plan.notes,
            **({"expert_subsets": plan.subsets} if plan.subsets else {}),
            "elapsed_s": plan.elapsed_s, "events": plan.events, "cluster_steps": plan.cluster_steps,
            "events_per_s": plan.events_per_s}


def write_json(plan: Plan, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(to_json(plan), indent=1, default=lambda x: None) + "\n")
    tmp.replace(path)
    return path


def plot(plan: Plan, path: str | Path, top: int = 12) -> Path:
    """Left: tokens/s against cross-site bytes per token, every candidate (colour = algorithm), the
    recommendation circled. Right: the best `top` by ddp-equivalent tokens/s — tokens/s and each cluster's
    blocked share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    colours = {"ddp": "tab:gray", "post_local_sgd": "tab:olive", "diloco": "tab:orange", "edit": "tab:blue",
               "a_edit": "tab:green"}
    for algo, colour in colours.items():
        pts = [r for r in plan.rows if r.cand.algo == algo]
        if pts:
            ax.scatter([max(r.bytes_per_token, 1e-3) for r in pts], [r.tokens_per_s for r in pts], s=14,
                       color=colour, label=algo, alpha=0.7)
    b = plan.best
    ax.scatter([max(b.bytes_per_token, 1e-3)], [b.tokens_per_s], s=160, facecolors="none", edgecolors="red",
               label="recommended")
    ax.set_xscale("log")
    ax.set_xlabel("cross-site bytes per token")
    ax.set_ylabel("predicted tokens/s (failure model applied)")
    ax.set_title(f"{plan.scenario.name}: {len(plan.rows)} candidates")
    ax.legend(fontsize=8)
    best = sorted(plan.rows, key=lambda r: -r.effective)[:top]
    ys = range(len(best))
    bx.barh(list(ys), [r.tokens_per_s for r in best], color=[colours.get(r.cand.algo, "k") for r in best])
    bx.set_yticks(list(ys), [r.cand.label for r in best], fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("tokens/s (bar); worst cluster blocked % (text)")
    for y, r in zip(ys, best):
        worst = max(r.blocked.values()) if r.blocked else 0.0
        bx.text(r.tokens_per_s, y, f" {worst:.0%} blk, ×{r.multiplier:.2f} tok", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

