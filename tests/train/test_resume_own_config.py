"""Issue 64 item 2: a resume continues the run it names with the run's own configuration (config.json, plus the
changes earlier resumes recorded in resumes.jsonl); an override that changes it is refused in one line naming
the keys, an allowed change (its length) is said and recorded without touching config.json, and the line a
finished run is refused with suggests a command that trains it further."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import cli_env, read_events, script_cmd
from edit_train.train import run_config as rc

# the run's own configuration differs from edit-train's defaults in many keys (algo, cluster, model, batch, ...)
FIRST = ["experiment=single", "model=tiny", "logger=none", "train.progress=false", "train.seq_len=32",
         "train.batch_size=2", "train.eval_every=0", "train.eval_batches=1", "train.log_every=2",
         "train.lr=0.002", "train.steps=4"]


def _cli(run_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*script_cmd("edit-train", "edit_train.cli.train"), f"run.dir={run_dir}", *args],
                          capture_output=True, text=True, env=cli_env(), cwd=run_dir.parent, timeout=timeout)


def _said(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def test_resume_keeps_the_runs_own_configuration(tmp_path: Path, small_corpus: str) -> None:
    run_dir = tmp_path / "run"
    first = _cli(run_dir, *FIRST, f"data.source={small_corpus}")
    assert first.returncode == 0, first.stderr[-3000:]
    config = (run_dir / "config.json").read_bytes()
    events = (run_dir / "metrics.jsonl").read_bytes()

    # an override that changes the run: refused in one line naming the keys; nothing written
    refused = _cli(run_dir, *FIRST, f"data.source={small_corpus}", "resume=auto", "train.batch_size=4",
                   "seed=3", "train.steps=8")
    assert refused.returncode == 2, refused.stderr[-3000:]
    said = _said(refused)
    assert len(said) == 1 and said[0].startswith("error: resume:"), refused.stderr[-3000:]
    assert "train.batch_size=4 (the run has 2)" in said[0] and "seed=3 (the run has 0)" in said[0], said[0]
    assert "train.steps" not in said[0]  # a resume may change its length
    assert (run_dir / "config.json").read_bytes() == config
    assert (run_dir / "metrics.jsonl").read_bytes() == events
    assert not (run_dir / rc.RESUMES).exists()

    # resume=auto alone: the run's own length (4, not edit-train's default 420): finished, in one line
    again = _cli(run_dir, "resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    said = _said(again)
    assert len(said) == 1 and "holds a finished run (step 4 of train.steps=4)" in said[0], again.stderr[-3000:]
    assert "resume=auto train.steps=8" in said[0]

    # without resume: refused, and the line suggests a command that does train further
    plain = _cli(run_dir)
    assert plain.returncode == 2
    said = _said(plain)
    assert len(said) == 1 and "already holds a finished run" in said[0], plain.stderr[-3000:]
    suggested = said[0].split("train it further with ", 1)[1].split(" (", 1)[0].split()
    assert suggested == ["resume=auto", "train.steps=8"], said[0]

    # the suggestion trains; every key but its length is the run's own (not edit-train's defaults: the demo's
    # two clusters, batch 16, seq 128, lr 3e-3, the stdlib corpus), and config.json is untouched
    more = _cli(run_dir, *suggested)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resume: train.steps 4 -> 8" in more.stderr, more.stderr[-3000:]
    assert (run_dir / "config.json").read_bytes() == config
    lines = (run_dir / rc.RESUMES).read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["changes"] == {"train.steps": [4, 8]}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and list(summary["per_cluster"]) == ["c0"]
    trains = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "train" and e["step"] > 4]
    assert [e["step"] for e in trains] == [6, 8]
    assert all(e["tokens"] == e["step"] * 2 * 32 for e in trains)  # the run's batch 2 x seq 32 per step
    assert all(e["lr"] < 0.002 for e in trains)  # its own lr plan, continued (not 3e-3)
    recorded = rc.recorded(run_dir)
    assert recorded is not None and recorded["train"]["steps"] == 8 and recorded["data"]["source"] == small_corpus


def test_which_keys_a_resume_may_change() -> None:
    assert rc.resumable("train.steps") and rc.resumable("checkpoint.every") and rc.resumable("logger.kind")
    assert rc.resumable("federation.lighthouse") and rc.resumable("cluster.only") and rc.resumable("run.dir")
    assert not rc.resumable("train.batch_size") and not rc.resumable("sync.mode") and not rc.resumable("algo.name")
    assert not rc.resumable("model.hidden_size") and not rc.resumable("data.source") and not rc.resumable("seed")


def test_resolve_and_record(tmp_path: Path) -> None:
    record = {"run": {"dir": "x"}, "train": {"steps": 4, "batch_size": 2}, "sync": {"mode": "layerwise"},
              "resume": "false"}
    given = {"run": {"dir": "x"}, "train": {"steps": 420, "batch_size": 16}, "sync": {"mode": "overlap"},
             "resume": "auto"}
    with pytest.raises(rc.ResumeRefused, match=r"sync\.mode='overlap' \(the run has 'layerwise'\)"):
        rc.resolve(record, given, {"sync.mode", "train.batch_size"}, set())
    # keys the command line did not set keep the run's values; an allowed one it set is taken and returned
    out, changes = rc.resolve(record, given, set(), {"train.steps"})
    assert out == {"run": {"dir": "x"}, "train": {"steps": 420, "batch_size": 2}, "sync": {"mode": "layerwise"},
                   "resume": "auto"}
    assert changes == {"train.steps": [4, 420]}
    assert rc.note_start(tmp_path, record) == {}
    written = (tmp_path / "config.json").read_bytes()
    assert rc.note_start(tmp_path, out) == {"train.steps": [4, 420]}
    assert rc.note_start(tmp_path, out) == {}  # the run's configuration already says 420
    assert (tmp_path / "config.json").read_bytes() == written
    assert rc.recorded(tmp_path)["train"]["steps"] == 420
