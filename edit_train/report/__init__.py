"""Plots and a summary table from one or more run directories (the `edit-train-report` logic).

The orchestrator of the report package: `make_report` loads the runs (`report.model`), draws the figures
(`report.plots`, `report.time_split`, `report.weights`, `report.experts`) and writes `summary.md`. It works on
the output of every algorithm: DDP (no `sync` events), single-cluster runs, runs without evals, and crashed runs (no
`summary.json`: what the metrics hold is still plotted, the table marks the run incomplete and derives its
numbers from the events).

Matplotlib is used through `Figure` objects only (no pyplot, no global backend switch), so it is headless.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from edit_train.report import plots as fig
from edit_train.report.experts import plot_expert_clusters
from edit_train.report.maxvio import plot_maxvio
from edit_train.report.model import ReportError, Run, human_bytes, load_run, markdown_table, table_rows
from edit_train.report.time_split import plot_time, time_table
from edit_train.report.weights import plot_weights

__all__ = ["PLOTS", "Report", "ReportError", "Run", "default_out", "human_bytes", "load_run", "make_report",
           "markdown_table", "table_rows"]

log = logging.getLogger(__name__)

PLOTS = ("val_loss_vs_tokens.png", "val_loss_vs_wall.png", "loss.png", "tokens_per_s.png", "blocked.png",
         "expert_load.png", "time.png", "weights.png", "expert_clusters.png",
         "expert_maxvio.png")


def _assign_labels(runs: list[Run]) -> None:
    """Label = run dir name + algo; dir names that collide get their parent prepended."""
    names = [r.name for r in runs]
    for r in runs:
        name = r.name
        if names.count(name) > 1:
            name = f"{r.path.resolve().parent.name}/{name}"
        r.label = f"{name} ({r.algo})" + ("" if r.completed else " [incomplete]")


# --------------------------------------------------------------------------------------------- report
@dataclass
class Report:
    out: Path
    plots: list[Path]
    table: str
    runs: list[Run]


def default_out(run_dirs: list[str | Path]) -> Path:
    return Path(run_dirs[0]) / "report" if len(run_dirs) == 1 else Path("report")


def make_report(run_dirs: list[str | Path], out: str | Path | None = None, expert_intervals: int = 0) -> Report:
    """Load every run (all paths checked before anything is written), draw the plots, write summary.md.
    `expert_intervals` > 0: `expert_clusters.png` sums each cluster's last that many intervals, not the run."""
    if not run_dirs:
        raise ReportError("no run directory given")
    runs = [load_run(p) for p in run_dirs]
    _assign_labels(runs)
    out_dir = Path(out) if out is not None else default_out(run_dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [
        fig.plot_val_loss(runs, out_dir, "tokens"),
        fig.plot_val_loss(runs, out_dir, "wall"),
        fig.plot_loss(runs, out_dir),
        fig.plot_tokens_per_s(runs, out_dir),
        fig.plot_blocked(runs, out_dir),
        fig.plot_expert_load(runs, out_dir),
        plot_time(runs, out_dir),
        plot_weights(runs, out_dir),
        plot_expert_clusters(runs, out_dir, expert_intervals),
        plot_maxvio(runs, out_dir),
    ]
    table = markdown_table(table_rows(runs))
    notes = []
    for r in runs:
        if not r.completed:
            why = "summary.json says completed=false" if r.summary is not None else "no summary.json"
            notes.append(f"- `{r.path}`: incomplete ({why}; crashed or still running) — its numbers are derived "
                         "from metrics.jsonl, `n/a` where the events cannot tell; its val loss is "
                         "the last evaluation's, not a final one.")
    md = ["# edit-train report", "", table, ""]
    breakdown = time_table(runs)
    if breakdown:
        md += ["## Where the time goes (share of each cluster's wall time)", "", breakdown, ""]
    if notes:
        md += [*notes, ""]
    md += ["Runs: " + ", ".join(f"`{r.path}`" for r in runs), "",
           *(f"![{p.stem}]({p.name})" for p in plots), ""]
    (out_dir / "summary.md").write_text("\n".join(md))
    log.info("report written to %s", out_dir)
    return Report(out=out_dir, plots=plots, table=table, runs=runs)
