"""The first progress lines after `resume=auto` describe the resumed run: the local launcher draws them from
run.dir/metrics.jsonl, which a resume appends to; it used to read that file from the start, so its first
lines were the previous launch's steps and losses (issue 35)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from edit_train.cli.launcher import Bars, ClusterJob
from edit_train.config import ClusterSpec


def _train(step: int, loss: float, cluster: str = "c0") -> str:
    return json.dumps({"event": "train", "step": step, "cluster_index": 0, "cluster": cluster, "loss": loss, "lr": 1e-3,
                       "tokens": step * 64, "tokens_per_s": 1000.0, "wall": float(step)}) + "\n"


def test_the_first_progress_line_after_a_resume_is_the_resumed_run(tmp_path: Path, caplog,
                                                                     monkeypatch) -> None:
    monkeypatch.setenv("EDIT_TRAIN_PROGRESS_EVERY_S", "0")  # a line per logged step
    monkeypatch.setattr("edit_train.train.progress.is_terminal", lambda _stream: False)  # lines, not bars
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(_train(s, 5.0 - s / 10) for s in (2, 4, 6, 8)))  # the previous launch
    jobs = [ClusterJob(ClusterSpec("c0", 1, 0)), ClusterJob(ClusterSpec("c1", 1, 1))]
    with caplog.at_level(logging.INFO, logger="edit_train.train.progress"):
        bars = Bars(metrics, jobs, total=16, enabled=True, desc="ddp")
        bars.update()  # nothing new yet: nothing said
        with metrics.open("a") as f:
            f.write(_train(10, 3.25) + _train(10, 3.5, "c1"))
        bars.update()
        bars.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cluster ")]
    assert lines == ["cluster c0 step 10/16 loss 3.250 tok/s 1,000", "cluster c1 step 10/16 loss 3.500 tok/s 1,000"]


def test_a_fresh_run_reads_its_metrics_from_the_start(tmp_path: Path, caplog, monkeypatch) -> None:
    monkeypatch.setenv("EDIT_TRAIN_PROGRESS_EVERY_S", "0")
    monkeypatch.setattr("edit_train.train.progress.is_terminal", lambda _stream: False)
    metrics = tmp_path / "metrics.jsonl"
    with caplog.at_level(logging.INFO, logger="edit_train.train.progress"):
        bars = Bars(metrics, [ClusterJob(ClusterSpec("c0", 1, 0))], total=4, enabled=True, desc="ddp")
        metrics.write_text(_train(2, 4.0))  # written after the launcher started
        bars.update()
        bars.close()
    assert [r.getMessage() for r in caplog.records] == ["cluster c0 step 2/4 loss 4.000 tok/s 1,000"]
