"""What a person watching a run sees (issue 22, items 5 and 6): periodic progress lines off a terminal and
log lines above the bars on one, the closing block on every launch path (a cluster's own job included),
a resumed run's summary, local steps and byte units in the closing block, "did you mean" for typos."""

from __future__ import annotations

import io
import json
import logging
import sys
from types import SimpleNamespace

import pytest

from conftest import run_cli, run_train, tiny_overrides

TRAIN = ("edit-train", "edit_train.cli.train")


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _capture(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "edit_train.train.progress"]


# ------------------------------------------------------------------------------------------- progress lines
def test_off_a_terminal_progress_is_periodic_log_lines_not_a_bar(caplog):
    from edit_train.train.progress import Progress

    stream = Stream(tty=False)
    with caplog.at_level(logging.INFO, logger="edit_train.train.progress"):
        p = Progress(["c0", "c1"], total=10, desc="edit", stream=stream, every_s=3600.0)
        assert not p.bars and p.lines
        for step in (2, 4, 6, 8):
            p.report("c0", step, 5.0 - step / 10, 1234.0)
        p.note("c1", "sync 1 with 2 cluster(s)")
        p.report("c1", 2, 4.5, 99.0)
        p.report("c1", 10, 3.25, 100.0)  # the last step is always said
        p.close()
    lines = _capture(caplog)
    # c0: its first line at once, nothing more within every_s, its latest one at close
    assert lines == ["cluster c0 step 2/10 loss 4.800 tok/s 1,234",
                     "cluster c1 step 2/10 loss 4.500 tok/s 99 (sync 1 with 2 cluster(s))",
                     "cluster c1 step 10/10 loss 3.250 tok/s 100",
                     "cluster c0 step 8/10 loss 4.200 tok/s 1,234"], lines
    assert stream.getvalue() == ""  # no bar, no carriage returns in a log file


def test_off_a_terminal_every_s_zero_says_every_logged_step(caplog):
    from edit_train.train.progress import Progress

    with caplog.at_level(logging.INFO, logger="edit_train.train.progress"):
        p = Progress(["c0"], total=6, desc="ddp", stream=Stream(tty=False), every_s=0.0)
        for step in (2, 4, 6):
            p.report("c0", step, 1.0, 10.0)
        p.close()
    assert [line.split(" loss")[0] for line in _capture(caplog)] == [
        "cluster c0 step 2/6", "cluster c0 step 4/6", "cluster c0 step 6/6"]


def test_progress_disabled_says_nothing(caplog):
    from edit_train.train.progress import Progress

    stream = Stream(tty=True)
    with caplog.at_level(logging.INFO, logger="edit_train.train.progress"):
        p = Progress(["c0"], total=6, desc="ddp", enabled=False, stream=stream, every_s=0.0)
        p.report("c0", 6, 1.0, 10.0)
        p.close()
    assert _capture(caplog) == [] and stream.getvalue() == ""


def test_on_a_terminal_log_lines_go_above_the_bars(monkeypatch):
    """While the bars are up, a console log line is written through tqdm (the bar is cleared first), not
    appended to the bar's text; after close, logging writes to the console directly again."""
    from edit_train.train.progress import Progress

    stream = Stream(tty=True)
    monkeypatch.setattr(sys, "stderr", stream)
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    before_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        p = Progress(["c0"], total=10, desc="edit", stream=stream, every_s=0.0)
        assert p.tty and set(p.bars) == {"c0"}
        p.report("c0", 3, 4.0, 100.0)
        p.bars["c0"].refresh()
        logging.getLogger("edit_train.test").info("checkpoint saved: somewhere")
        p.report("c0", 10, 3.0, 100.0)
        p.close()
        logging.getLogger("edit_train.test").info("after the bars")
        assert handler in root.handlers  # the redirect restored the console handler
    finally:
        root.removeHandler(handler)
        root.setLevel(before_level)
    out = stream.getvalue()
    i = out.index("checkpoint saved: somewhere")
    assert out[i - 1] in "\r\n", repr(out[max(i - 80, 0):i + 30])  # the bar was cleared before the line
    assert "edit c0" in out[:i]  # a bar was drawn before it
    assert "edit c0" in out[i:]  # and redrawn after it
    assert out.endswith("after the bars\n")


# ------------------------------------------------------------------------------------------------ restarts
def test_restart_count_reads_every_launcher():
    from edit_train.train.progress import restart_count

    assert restart_count({}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert restart_count({"EDIT_TRAIN_RESTART": "1"}) == 1
    assert restart_count({"SLURM_RESTART_COUNT": "3", "TORCHELASTIC_RESTART_COUNT": "0"}) == 3
    assert restart_count({"SLURM_RESTART_COUNT": "junk", "EDIT_TRAIN_RESTART": ""}) == 0


def test_begin_on_a_record_keeps_the_initial_loss_and_counts_only_real_restarts(tmp_path, monkeypatch):
    from edit_train.train.progress import TrainingState, record_path

    for var in ("TORCHELASTIC_RESTART_COUNT", "EDIT_TRAIN_RESTART", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    first = TrainingState.begin(tmp_path, "c0", tokens_per_step=64)
    first.set_initial_val_loss(6.099)
    first.trained()
    first.save()
    assert json.loads(record_path(tmp_path, "c0").read_text())["initial_val_loss"] == 6.099

    resumed = TrainingState.begin(tmp_path, "c0", tokens_per_step=64)  # a new launch, resume=auto
    assert resumed.initial_val_loss == 6.099
    assert resumed.carried.incarnations == 2 and resumed.carried.restarts == 0
    assert resumed.tokens == 64
    resumed.save()

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun started it again after a failure
    restarted = TrainingState.begin(tmp_path, "c0", tokens_per_step=64)
    assert restarted.carried.incarnations == 3 and restarted.carried.restarts == 1
    assert restarted.initial_val_loss == 6.099


def test_restore_takes_the_initial_loss_from_a_checkpoint_without_a_record(tmp_path):
    from edit_train.train.progress import TrainingState

    state = TrainingState.begin(tmp_path, "c0", tokens_per_step=64, restarted=False)
    assert state.initial_val_loss is None
    state.restore({"step": 6, "skipped_steps": 0, "wall_s": 1.0, "tokens": 384, "initial_val_loss": 6.05},
                  record_found=False)
    assert state.initial_val_loss == 6.05 and state.carried.initial_val_loss == 6.05
    assert state.step == 6 and state.tokens == 384


def test_merge_takes_the_initial_loss_of_any_cluster():
    from edit_train.train.summary import merge

    def rec(index: int, init: float | None) -> dict:
        return {"name": f"c{index}", "index": index, "steps": 40, "total_params": 10, "active_params": 10,
                "tokens": 100, "wall_s": 2.0, "final_val_loss": 3.0,
                "initial_val_loss": init, "cross_cluster_bytes": 0, "syncs": 1, "anomalies": 0, "blocked_s": 0.0,
                "useful_s": 1.0, "first_start": 0.0, "alive_s": 2.0, "algo": "edit", "restarts": 0}

    # c0 first: a cluster that healed in mid-run has no step-0 eval of its own
    assert merge([rec(0, None), rec(1, 6.1)], ["c0", "c1"])["initial_val_loss"] == 6.1


def test_resume_auto_keeps_the_starting_loss_and_is_not_a_restart(tmp_path, monkeypatch, torch_one_thread):
    """The issue's run: 6 steps, then `resume=auto` to 10. The summary says `initial -> final` and 0 restarts."""
    from edit_train.cli.train import closing_block

    for var in ("TORCHELASTIC_RESTART_COUNT", "EDIT_TRAIN_RESTART", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    run = tmp_path / "run"
    s1 = run_train(tiny_overrides(run))
    s2 = run_train(tiny_overrides(run, None, "train.steps=10", "resume=auto"))
    assert s1["initial_val_loss"] is not None
    assert s2["steps"] == 10
    assert s2["initial_val_loss"] == s1["initial_val_loss"]
    assert s2["per_cluster"]["c0"]["restarts"] == 0
    first = closing_block(s2, str(run)).splitlines()[0]
    assert f"val loss {s1['initial_val_loss']:.3f} -> {s2['final_val_loss']:.3f}" in first, first


# ------------------------------------------------------------------------------------------- closing block
@pytest.mark.parametrize("steps,text", [
    ([32, 8], "32 and 8 local steps"),  # a 40-step run at H=32: not "median 32"
    ([8], "8 local steps"),
    ([16, 16, 16], "16, 16 and 16 local steps"),
    ([8, 16, 16, 32, 32, 32], "median 24 local steps each"),  # the middle two of an even count
    ([4, 8, 16, 32, 64], "median 16 local steps each"),
    ([], ""),
])
def test_local_steps_text(steps, text):
    from edit_train.cli.train import local_steps_text

    assert local_steps_text(steps) == text


def _cluster(name: str, local_steps: list[int], steps: int = 40) -> dict:
    return {"ranks": 1, "steps": steps, "tokens": steps * 64, "wall_s": 10.0, "tokens_per_s": 256.0,
            "syncs_joined": len(local_steps), "syncs_missed": 0, "local_steps": local_steps, "blocked_frac": 0.1,
            "anomalies": 0, "restarts": 0, "final_val_loss": 3.5, "initial_val_loss": 6.099}


def _summary(clusters: dict, completed: bool = True) -> dict:
    return {"algo": "edit", "completed": completed, "steps": 40, "tokens": 40 * 64 * len(clusters),
            "wall_s": 12.0, "final_val_loss": 3.5, "initial_val_loss": 6.099, "cross_cluster_bytes": 14_000_000,
            "syncs": 2, "anomalies": 0, "goodput": 0.5, "per_cluster": clusters}


def test_closing_block_of_a_federation():
    from edit_train.cli.train import closing_block

    block = closing_block(_summary({"c0": _cluster("c0", [32, 8]), "c1": _cluster("c1", [32, 8])}), "runs/x")
    lines = block.splitlines()
    assert lines[0].startswith("done: 40 steps") and "val loss 6.099 -> 3.500" in lines[0]
    assert "13.4 MiB over the cross-cluster link" in block and " MB " not in block  # as the report says it
    assert block.count("32 and 8 local steps") == 2 and "median" not in block
    assert lines[-1] == "  report: edit-train-report runs/x"


def test_closing_block_of_a_cluster_job_before_the_others_finish():
    """Under torchrun / Slurm each cluster's job prints its own block: its numbers, what the federation's
    summary holds so far and who is still training."""
    from edit_train.cli.train import closing_block

    summary = _summary({"c0": _cluster("c0", [32, 8])}, completed=False)
    block = closing_block(summary, "runs/fed", cluster="c0", expected=["c0", "c1"])
    lines = block.splitlines()
    assert lines[0].startswith("done: cluster c0, 40 steps"), lines[0]
    assert "1 of 2 clusters so far" in block
    assert "c1 still training" in block
    assert lines[-1] == "  report: edit-train-report runs/fed"


# -------------------------------------------------------------------------------------------- did you mean
def _main(monkeypatch, capsys, *argv: str) -> SimpleNamespace:
    from edit_train.cli.train import main

    monkeypatch.setattr(sys, "argv", ["edit-train", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return SimpleNamespace(returncode=exc.value.code, stdout=out.out, stderr=out.err)


@pytest.mark.parametrize("typo,hint", [("train.stpes=10", "did you mean train.steps?"),
                                       ("model=tiyn", "did you mean model=tiny?")])
def test_typo_gets_one_line_with_did_you_mean(tmp_path, monkeypatch, capsys, typo, hint):
    proc = _main(monkeypatch, capsys, *tiny_overrides(tmp_path / "run"), typo)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert hint in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ end to end
def test_cluster_job_off_a_terminal_logs_progress_lines_and_ends_with_the_closing_block(tmp_path):
    """A cluster's own job (what torchrun / Slurm start: EDIT_TRAIN_CLUSTER set), its output into a file:
    progress as log lines (no carriage return anywhere), the `model:` line once, the closing block."""
    run = tmp_path / "run"
    proc = run_cli(*TRAIN, tiny_overrides(run, None, "train.progress=true", "cluster.only=c0"),
                   EDIT_TRAIN_CLUSTER="c0", EDIT_TRAIN_PROGRESS_EVERY_S="0")
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "\r" not in proc.stdout
    progress = [line.split("] ", 1)[1] for line in proc.stderr.splitlines() if "] cluster c0 step " in line]
    assert [line.split(" loss")[0] for line in progress] == [
        "cluster c0 step 2/6", "cluster c0 step 4/6", "cluster c0 step 6/6"], proc.stderr
    assert sum("model: " in line for line in proc.stderr.splitlines()) == 1, proc.stderr
    done = [line for line in proc.stdout.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and str(run) in done[0] and " -> " in done[0], proc.stdout
    assert f"report: edit-train-report {run}" in proc.stdout
