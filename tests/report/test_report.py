"""`edit-train-report`: plots + summary table from hand-written run directories (no training here).

Synthetic runs: a 2-cluster EDiT run with one anomalous sync and a fault in its config.json, a DDP run (no sync events), a crashed
single-cluster run (no summary.json, no evals, a torn last line) and a run that died before its first event;
and a run dir from before the one-word rename (summary.json with the retired `per_group`, `cross_group_bytes`;
events with `group`, `participants`).
Rendering is the slow part (~1 s of CPU per report), so only three tests draw."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest

from edit_train.cli.report import main
from edit_train.report import PLOTS, default_out, human_bytes, load_run, make_report
from edit_train import retired
from edit_train.report.weights import fault_windows, retractions, weight_series, weights_figure

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(path: Path, events: list[dict], summary: dict | None, config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def _train_events(groups: int, steps: int, every: int = 4, tokens_per_step: int = 128) -> list[dict]:
    out = []
    for step in range(every, steps + 1, every):
        for g in range(groups):
            out.append({"event": "train", "step": step, "cluster_index": g, "loss": 5.0 - 0.05 * step + 0.1 * g,
                        "lr": 1e-3, "tokens": step * tokens_per_step, "tokens_per_s": 900.0 + 50 * g,
                        "wall": 0.1 * step + 0.01 * g})
            out.append({"event": "moe", "step": step, "cluster_index": g,
                        "expert_load": [[10 + step, 5, 0, 7], [3, 3, 3, 3 + g]], "aux_loss": 0.01, "z_loss": 0.001})
    return out


def _evals(steps: int, every: int = 8, groups: int = 2) -> list[dict]:
    return [{"event": "eval", "step": s, "val_loss": 6.0 - 0.1 * s, "val_ppl": math.exp(6.0 - 0.1 * s),
             "tokens": s * 128 * groups, "wall": 0.1 * s + 0.05} for s in range(0, steps + 1, every)]


def _cluster(index: int, tokens: int, syncs: int, anomalies: int, nbytes: int, blocked: float, wall: float,
             local_steps: list[int]) -> dict:
    return {"name": f"c{index}", "index": index, "tokens": tokens, "steps": 24, "tokens_per_s": tokens / wall,
            "syncs": syncs, "anomalies": anomalies, "cross_cluster_bytes": nbytes, "blocked_s": blocked,
            "blocked_frac": blocked / wall, "local_steps": local_steps}


def _per_cluster(records: list[dict]) -> dict:
    """`per_cluster` {name: record}, as the trainer writes it."""
    return {"per_cluster": {r["name"]: r for r in records}}


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    steps, wall = 24, 2.5
    edit_events = [*_evals(steps), *_train_events(2, steps)]
    for k, step in enumerate((8, 16, 24), start=1):
        for g in range(2):
            bad = (k == 2 and g == 1)
            edit_events.append({"event": "sync", "sync": k, "step": step, "cluster_index": g, "local_steps": 8,
                                "pseudo_grad_norm": 9.0 if bad else 1.0, "weight": 0.0 if bad else 0.5,
                                "anomalous": bad, "anomalous_modules": ["layers.0"] if bad else [],
                                "clip_coef": 1.0, "bytes": 1000, "blocked_s": 0.05})
    edit_summary = {"algo": "edit", "completed": True, "steps": steps, "tokens": 2 * steps * 128, "wall_s": wall,
                    "tokens_per_s": 2 * steps * 128 / wall, "final_val_loss": 3.6, "initial_val_loss": 6.0,
                    "cross_cluster_bytes": 6000, "syncs": 3, "anomalies": 1, "blocked_s": 0.15,
                    **_per_cluster([_cluster(g, steps * 128, 3, int(g == 1), 3000, 0.15, wall, [8, 8, 8])
                                    for g in range(2)])}
    ddp_summary = {"algo": "ddp", "completed": True, "steps": steps, "tokens": 2 * steps * 128, "wall_s": 3.0,
                   "tokens_per_s": 2 * steps * 128 / 3.0, "final_val_loss": 3.5, "initial_val_loss": 6.0,
                   "cross_cluster_bytes": 5 * 2**30, "syncs": 0, "anomalies": 0, "blocked_s": 0.9,
                   **_per_cluster([_cluster(g, steps * 128, 0, 0, 5 * 2**29, 0.9 - 0.1 * g, 3.0, [])
                                   for g in range(2)])}
    crashed_events = _train_events(1, 12)[:-1] + ['{"event":"train","step":16,"gro']  # torn last line
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text(
        "".join((e if isinstance(e, str) else json.dumps(e) + "\n") for e in crashed_events))
    (crashed / "config.json").write_text(json.dumps({"algo": {"name": "diloco"}}))
    return {
        "edit": _write_run(tmp_path / "edit", edit_events, edit_summary,
                           {"algo": {"name": "edit"},
                            "faults": [{"kind": "garbage_data", "cluster": 1, "start": 10, "end": 18}]}),
        "ddp": _write_run(tmp_path / "ddp", [*_evals(steps), *_train_events(2, steps)], ddp_summary),
        "crashed": crashed,
        "empty": _write_run(tmp_path / "empty", [], None),
    }


def _assert_pngs(out: Path) -> None:
    from matplotlib.image import imread

    for name in PLOTS:
        path = out / name
        assert path.is_file(), f"{name} missing"
        assert path.read_bytes()[:8] == PNG_MAGIC, name
        assert path.stat().st_size > 10_000, f"{name} suspiciously small ({path.stat().st_size} B)"
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300, (name, image.shape)
        assert image.std() > 0.01, f"{name} is blank"


def _table_rows(text: str) -> list[list[str]]:
    """Data rows of the first Markdown table in `text` (header and rule skipped)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_report_on_three_runs(runs, tmp_path, capsys):
    out = tmp_path / "out"
    main([str(runs[k]) for k in ("edit", "ddp", "crashed", "empty")] + ["--out", str(out)])
    _assert_pngs(out)

    md = (out / "summary.md").read_text()
    rows = _table_rows(md)
    assert [r[0] for r in rows] == ["edit", "ddp", "crashed (incomplete)", "empty (incomplete)"]
    by_run = {r[0]: r for r in rows}
    # run, algo, steps, tokens, wall_s, tokens/s, final val loss, cross-cluster bytes, syncs, anomalies, blocked %,
    # downtime_s (n/a: a summary.json written before it was kept)
    assert by_run["edit"][1:] == ["edit", "24", "6,144", "2.5", "2,458", "3.600", "5.9 KiB", "3", "1", "6.0%", "n/a"]
    assert by_run["ddp"][1] == "ddp" and by_run["ddp"][7] == "5.0 GiB" and by_run["ddp"][8] == "0"
    crashed = by_run["crashed (incomplete)"]
    assert crashed[1] == "diloco"  # from config.json
    assert crashed[2] == "12"  # the torn last line is skipped
    assert crashed[6] == "n/a" and crashed[7] == "n/a"  # no evals; bytes unknown without sync events
    assert "incomplete" in md and "no summary.json" in md
    assert by_run["empty (incomplete)"][1:] == ["?", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "0", "0", "n/a",
                                                "n/a"]

    printed = capsys.readouterr().out
    assert _table_rows(printed) == rows  # the same table on stdout


def test_default_out_dirs(runs, capsys):
    main([str(runs["ddp"])])  # one run → RUN_DIR/report
    assert len(_table_rows((runs["ddp"] / "report" / "summary.md").read_text())) == 1
    _assert_pngs(runs["ddp"] / "report")
    assert default_out([runs["edit"], runs["ddp"]]) == Path("report")  # several → ./report


def test_anomalous_sync_is_found_per_cluster(runs):
    run = load_run(runs["edit"])
    flagged = [(e["sync"], e["cluster_index"], e["step"]) for e in run.syncs() if e["anomalous"]]
    assert flagged == [(2, 1, 16)]
    assert run.clusters == [(0, "c0"), (1, "c1")]
    assert list(run.stats()["per_cluster"]) == ["c0", "c1"]
    # an unfinished run: per cluster from the events (no `cluster` field here: named c<index>)
    assert load_run(runs["crashed"]).stats()["per_cluster"]["c0"]["tokens_per_s"] > 0


def test_old_run_dir_with_retired_names_is_reported_and_warned_once(runs, tmp_path, caplog, monkeypatch):
    """A run dir from before the one-word rename: summary.json has only `per_group` {index: record} and
    `cross_group_bytes`, its events `group` and `participants`. It is still reported, per cluster by each
    record's `name` (`c<index>` without one), and a one-line warning is logged once per process, however
    many such run dirs are loaded."""
    monkeypatch.setattr(retired, "_warned_outputs", False)
    summary = json.loads((runs["ddp"] / "summary.json").read_text())
    records = summary.pop("per_cluster")
    summary["per_group"] = {str(r["index"]): dict(r) for r in records.values()}
    summary["cross_group_bytes"] = summary.pop("cross_cluster_bytes")
    summary["per_group"]["0"]["name"] = "fast"
    del summary["per_group"]["1"]["name"]  # no name at all: c<index>
    events = [json.loads(line) for line in (runs["ddp"] / "metrics.jsonl").read_text().splitlines()]
    old_events = [{("group" if k == "cluster_index" else "participants" if k == "quorum" else k): v
                   for k, v in e.items()} for e in events]
    assert any("group" in e for e in old_events)
    old = []
    for name in ("old1", "old2"):
        shutil.copytree(runs["ddp"], tmp_path / name)
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in old_events))
        old.append(tmp_path / name)

    with caplog.at_level(logging.WARNING, logger=retired.__name__):
        report = make_report(old, tmp_path / "out")
    warned = [r for r in caplog.records if "predates" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert warned[0].levelno == logging.WARNING and "\n" not in warned[0].getMessage()
    assert f"{old[0]} predates the one-word rename" in warned[0].getMessage()

    _assert_pngs(tmp_path / "out")
    rows = _table_rows(report.table)
    assert [r[0] for r in rows] == ["old1", "old2"] and rows[0][1:] == rows[1][1:]
    assert rows[0][1] == "ddp" and rows[0][7] == "5.0 GiB" and rows[0][10] == "30.0%"
    for run in report.runs:
        assert run.clusters == [(0, "fast"), (1, "c1")]
        per = run.stats()["per_cluster"]
        assert list(per) == ["fast", "c1"]
        assert per["fast"]["blocked_s"] == pytest.approx(0.9) and per["c1"]["blocked_s"] == pytest.approx(0.8)
        assert per["c1"]["tokens_per_s"] == pytest.approx(24 * 128 / 3.0)


@pytest.mark.parametrize("make", ["missing", "plain_dir"])
def test_not_a_run_dir_is_one_line_exit_2(runs, tmp_path, capsys, make):
    bad = tmp_path / "nope"
    if make == "plain_dir":
        bad.mkdir()
    with pytest.raises(SystemExit) as exc:
        main([str(runs["edit"]), str(bad), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {bad}: no metrics.jsonl (is it a run.dir?)"]
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(112469376) == "107.3 MiB"
    assert human_bytes(None) == "n/a"


def test_weights_data_from_crafted_run(tmp_path, caplog):
    """`weights.png`'s data: each cluster's (step, weight, anomalous) per sync, by name, a re-logged sync
    counted once and a missing weight NaN; the fault windows of config.json as parse_faults reads them."""
    def sync(k, step, g, name, weight, bad=False, **extra):
        return {"event": "sync", "sync": k, "step": step, "cluster_index": g, "cluster": name, "weight": weight,
                "anomalous": bad, "anomalous_modules": ["layers.0"] if bad else [],
                "anomaly_details": {"layers.0": {"reasons": ["norm"]}} if bad else {}, **extra}

    names = ("west", "east", "north")
    back = {"west": {"sync": 2, "probe": 0.4}}  # sync 3 took back west's update of sync 2 (every cluster says so)
    events = [*(sync(1, 8, g, n, 1 / 3) for g, n in enumerate(names)),
              sync(2, 16, 0, "west", 0.5), sync(2, 16, 1, "east", 0.0, bad=True), sync(2, 16, 2, "north", 0.5),
              sync(2, 16, 1, "east", 0.0, bad=True),  # re-logged after a resume: counted once
              sync(3, 24, 0, "west", 0.4), sync(3, 24, 1, "east", 0.2, bad=True, retracted=back),
              sync(3, 24, 2, "north", None, retracted=back)]
    faults = [{"kind": "garbage_data", "cluster": 1, "start": 10, "end": 18},
              {"kind": "lr_spike", "cluster": "north", "start": 20, "factor": 5},  # no end: to the end of the run
              {"kind": "kill_cluster", "cluster": 2, "step": 12},
              {"kind": "partition", "cluster": "west", "step": 4, "seconds": 3},
              {"kind": "bogus", "cluster": 0}]  # rejected by parse_faults: skipped with a warning
    run = load_run(_write_run(tmp_path / "crafted", events, None, {"algo": {"name": "edit"}, "faults": faults}))

    series = weight_series(run)
    assert list(series) == ["west", "east", "north"]
    assert series["west"] == [(8, pytest.approx(1 / 3), False), (16, 0.5, False), (24, 0.4, False)]
    assert series["east"] == [(8, pytest.approx(1 / 3), False), (16, 0.0, True), (24, 0.2, True)]
    assert series["north"][:2] == [(8, pytest.approx(1 / 3), False), (16, 0.5, False)]
    step, weight, bad = series["north"][2]
    assert step == 24 and math.isnan(weight) and not bad
    assert retractions(run) == [("west", 16, 0.5, 3)]

    with caplog.at_level(logging.WARNING):
        windows = fault_windows(run)
    assert windows == [("garbage_data on east", 10, 18), ("lr_spike on north", 20, math.inf),
                       ("kill_cluster on north", 12, None), ("partition on west", 4, None)]
    assert any("faults[4] skipped" in r.getMessage() for r in caplog.records)

    # the panel: a line per cluster, a span per window, a dashed line per one-step fault (no rendering here)
    ax = weights_figure([run]).axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert {"west", "east", "north", "garbage_data on east", "lr_spike on north (to the end)",
            "kill_cluster on north", "partition on west", "taken back at the next sync (probe)"} <= set(labels)
    assert not [t for t in ax.texts if t.get_text() == "no syncs"]


def test_weights_without_syncs_or_faults(runs):
    """DDP (no sync events): a "no syncs" panel, no error; no config.json / no faults: no windows."""
    ddp, edit = load_run(runs["ddp"]), load_run(runs["edit"])
    assert weight_series(ddp) == {} and fault_windows(ddp) == []
    assert fault_windows(edit) == [("garbage_data on c1", 10, 18)]
    assert weight_series(edit)["c1"] == [(8, 0.5, False), (16, 0.0, True), (24, 0.5, False)]
    fig = weights_figure([edit, ddp, load_run(runs["empty"])])
    texts = [[t.get_text() for t in ax.texts] for ax in fig.axes]
    assert texts[0] == [] and texts[1] == ["no syncs"] and texts[2] == ["no syncs"]


def test_every_time_bucket_has_a_colour() -> None:
    from edit_train.report.time_split import BUCKET_COLORS
    from edit_train.timing import BUCKETS

    assert set(BUCKETS) <= set(BUCKET_COLORS), set(BUCKETS) - set(BUCKET_COLORS)
