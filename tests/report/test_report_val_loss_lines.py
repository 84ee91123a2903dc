"""Issue 64 item 8: the report's val_loss_vs_tokens.png joined both A-EDiT clusters' evals by step, each at its own
step count (a zig-zag); it draws one line per cluster there. After a restart the closing line and the plot showed
the restart's step-0 eval (3.043) as the run's starting loss (6.099): the start is the run's first eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import read_events, run_train, tiny_overrides
from edit_train.cli.train import closing_block
from edit_train.report import plots
from edit_train.report.model import Run


def _a_edit_events() -> list[dict]:
    """Two clusters, c1 three times slower: each evaluates after every exchange at its own step count (c0 at
    steps 0, 30, 60; c1 at 0, 10, 20), then c1 restarts and logs a step-0 eval of the weights it healed to."""
    ev: list[dict] = [{"event": "eval", "step": 0, "cluster_index": g, "cluster": f"c{g}", "tokens": 0,
                       "val_loss": 6.099, "wall": 1.0} for g in (0, 1)]
    for k, loss in ((1, 4.0), (2, 3.0)):
        for g, steps in ((0, 30 * k), (1, 10 * k)):
            ev.append({"event": "train", "step": steps, "cluster_index": g, "cluster": f"c{g}",
                       "tokens": steps * 100, "loss": loss})
        for g, steps in ((0, 30 * k), (1, 10 * k)):
            ev.append({"event": "eval", "step": steps, "cluster_index": g, "cluster": f"c{g}",
                       "tokens": steps * 100, "val_loss": loss + 0.01 * g, "wall": 10.0 * k + g})
    ev.append({"event": "eval", "step": 0, "cluster_index": 1, "cluster": "c1", "tokens": 2000, "val_loss": 3.043,
               "wall": 25.0})  # the restart's
    return ev


def test_a_edit_evals_are_one_line_per_cluster_starting_at_the_runs_first_eval(tmp_path: Path) -> None:
    run = Run(tmp_path, _a_edit_events())
    series = run.world_eval_series("tokens")
    assert list(series) == [0, 1]
    # x: every cluster's tokens when the eval was logged (c0's 3,000 + c1's 1,000 at c0's step 30)
    assert series[0] == [(0.0, 6.099), (4000.0, 4.0), (8000.0, 3.0)]
    assert series[1] == [(0.0, 6.099), (4000.0, 4.01), (8000.0, 3.01)]
    for points in series.values():
        xs = [x for x, _ in points]
        assert xs == sorted(xs)  # no line goes back
    assert run.evals()[0]["val_loss"] == 6.099  # the run's start, not the restart's 3.043
    assert run.evals_vs_tokens()[0] == (0.0, 6.099)
    path = plots.plot_val_loss([run], tmp_path, "tokens")
    assert path.name == "val_loss_vs_tokens.png" and path.stat().st_size > 0


def test_lockstep_evals_stay_one_line(tmp_path: Path) -> None:
    """Every cluster evaluates at the same steps (the same model): one series, a step's last record (step 0: its
    first)."""
    events = []
    for step in (0, 10, 20):
        for g in (0, 1):
            events.append({"event": "train", "step": step, "cluster_index": g, "tokens": step * 100, "loss": 3.0})
        for g in (0, 1):
            events.append({"event": "eval", "step": step, "cluster_index": g, "tokens": step * 100,
                           "val_loss": 5.0 - step / 10 + g * 0.001, "wall": float(step)})
    series = Run(tmp_path, events).world_eval_series("tokens")
    assert series == {None: [(0.0, 5.0), (2000.0, 4.001), (4000.0, 3.001)]}  # step 0: the first record


def test_the_plot_draws_a_line_per_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[str] = []
    from matplotlib.axes import Axes

    real = Axes.plot

    def plot(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        drawn.append(str(kwargs.get("label")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    plots.plot_val_loss([Run(tmp_path, _a_edit_events())], tmp_path, "tokens")
    assert len(drawn) == 2 and drawn[0].endswith("c0: 3.000") and drawn[1].endswith("c1: 3.010"), drawn


@pytest.mark.usefixtures("torch_one_thread")
def test_a_restart_at_step_0_keeps_the_runs_starting_loss(tmp_path: Path, small_corpus: str) -> None:
    """A cluster that comes back at step 0 (no checkpoint; in a federation it heals to the others' weights) does
    not replace the run's starting loss with an eval of its own: the summary, the closing line and the report
    keep the run's first eval."""
    run_dir = tmp_path / "run"
    quick = ("train.steps=2", "train.eval_every=0", "checkpoint.at_end=false")
    first = run_train(tiny_overrides(run_dir, small_corpus, *quick))
    record = run_dir / "clusters" / "c0.progress.json"
    carried = json.loads(record.read_text())
    assert carried["initial_val_loss"] == first["initial_val_loss"]
    carried["initial_val_loss"] = 9.5  # stands for the run's first eval (a healed restart's would be lower)
    record.write_text(json.dumps(carried))
    again = run_train(tiny_overrides(run_dir, small_corpus, *quick, "train.steps=4", "resume=auto"))
    assert again["initial_val_loss"] == 9.5
    assert "val loss 9.500 -> " in closing_block(again, str(run_dir))
    zeros = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "eval" and e["step"] == 0]
    assert len(zeros) == 1  # the restart logged no step-0 eval of its own
