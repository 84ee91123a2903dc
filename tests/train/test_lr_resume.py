"""A resume that changes the learning-rate schedule (train.steps, lr, lr_warmup_steps, min_lr_ratio) continues
from the learning rate the checkpoint's schedule gives at the resume step instead of re-planning from step 0
(400 -> 800 steps used to jump the learning rate several times over without a word), says so in one line, and
keeps the continuation in the checkpoint for the next resume (issue 35)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from conftest import read_events, run_train, tiny_overrides
from edit_train.train.lr import LrSchedule, lr_at
from edit_train.train.progress import TrainingState

OLD = LrSchedule(3e-3, 400, 30, 0.1)


@pytest.mark.parametrize("s0", [200, 350, 399, 400])
@pytest.mark.parametrize("new_steps", [800, 450])
def test_a_longer_or_shorter_run_continues_without_a_jump(s0: int, new_steps: int) -> None:
    new = OLD.continued(LrSchedule(3e-3, new_steps, 30, 0.1), s0)
    assert abs(new.at(s0) - OLD.at(s0)) <= 1e-15  # no jump at the resume step
    plain = lr_at(s0, 3e-3, new_steps, 30, 0.1)
    if abs(plain - OLD.at(s0)) > 1e-6:
        assert abs(new.at(s0) - plain) > 1e-6  # what a re-plan from step 0 would have given
    lrs = [new.at(s) for s in range(s0, new_steps + 1)]
    assert all(b <= a + 1e-15 for a, b in zip(lrs, lrs[1:]))  # monotone decay ...
    assert lrs[-1] == pytest.approx(3e-4, rel=1e-12)  # ... to the minimum at the new end
    assert new.at(new_steps + 100) == pytest.approx(3e-4, rel=1e-12)
    # a small step moves the lr a little (smooth): at most the steepest slope of the old cosine
    steepest = max(abs(OLD.at(s + 1) - OLD.at(s)) for s in range(30, 400))
    assert max(abs(b - a) for a, b in zip(lrs, lrs[1:])) <= steepest * 400 / max(new_steps - s0, 1) + 1e-15


def test_a_cosine_from_the_resume_point() -> None:
    new = OLD.continued(LrSchedule(3e-3, 800, 30, 0.1), 200)
    lr0, end = OLD.at(200), 3e-4
    for s in (200, 300, 500, 650, 800):
        want = end + (lr0 - end) * 0.5 * (1 + math.cos(math.pi * (s - 200) / 600))
        assert new.at(s) == pytest.approx(want, rel=1e-12)


def test_inside_the_warm_up() -> None:
    # only train.steps changed, still warming up: the new plan gives the same lr there, kept as planned
    same = OLD.continued(LrSchedule(3e-3, 800, 30, 0.1), 10)
    assert same.from_step is None and [same.at(s) for s in range(10, 40)] == \
        [lr_at(s, 3e-3, 800, 30, 0.1) for s in range(10, 40)]
    # a longer warm-up to a lower peak: a line from the current lr to the new peak, then the planned cosine
    new = OLD.continued(LrSchedule(1e-3, 800, 60, 0.1), 10)
    assert new.at(10) == OLD.at(10) and new.at(60) == pytest.approx(1e-3)
    assert new.at(61) == lr_at(61, 1e-3, 800, 60, 0.1) and new.at(800) == pytest.approx(1e-4)


def test_an_unchanged_plan_is_the_plain_schedule_and_the_line_says_what_changed() -> None:
    assert [OLD.at(s) for s in range(0, 401, 7)] == [lr_at(s, 3e-3, 400, 30, 0.1) for s in range(0, 401, 7)]
    new = OLD.continued(LrSchedule(3e-3, 800, 30, 0.1), 200)
    line = OLD.change_line(new, 200)
    assert "\n" not in line and line.startswith("resume: train.steps 400 -> 800: the learning rate continues from "
                                                f"{OLD.at(200):.2e} at step 200") and "600 steps" in line


def test_the_continuation_survives_another_resume(tmp_path: Path) -> None:
    """checkpoint_json -> a new incarnation with the same config: the continued schedule, not the plain one."""
    first = TrainingState(name="c0", run_dir=tmp_path, tokens_per_step=1, step=200, schedule=OLD)
    second = TrainingState(name="c0", run_dir=tmp_path, tokens_per_step=1, schedule=LrSchedule(3e-3, 800, 30, 0.1))
    saved = first.checkpoint_json()
    second.restore(saved, record_found=True)
    assert second.continue_schedule(saved).startswith("resume: train.steps 400 -> 800")
    second.step = 500
    third = TrainingState(name="c0", run_dir=tmp_path, tokens_per_step=1, schedule=LrSchedule(3e-3, 800, 30, 0.1))
    saved = second.checkpoint_json()
    third.restore(saved, record_found=True)
    assert third.continue_schedule(saved) is None  # nothing changed: quiet
    assert third.schedule == second.schedule and third.schedule.from_step == 200
    assert third.schedule.at(500) != lr_at(500, 3e-3, 800, 30, 0.1)
    # a checkpoint written before the schedule was saved: its config planned it from step 0
    old_ckpt = {k: v for k, v in first.checkpoint_json().items() if k != "lr_schedule"}
    old_ckpt["config"] = {"train": {"lr": 3e-3, "steps": 400, "lr_warmup_steps": 30, "min_lr_ratio": 0.1}}
    fourth = TrainingState(name="c0", run_dir=tmp_path, tokens_per_step=1, schedule=LrSchedule(3e-3, 800, 30, 0.1))
    fourth.restore(old_ckpt, record_found=True)
    assert fourth.continue_schedule(old_ckpt) and fourth.schedule == second.schedule


@pytest.mark.usefixtures("torch_one_thread")
def test_a_resume_with_more_steps_does_not_jump(tmp_path: Path, small_corpus: str, caplog) -> None:
    """8 steps (checkpoint at the end), then resume=auto with train.steps=16: the lr of the first resumed step
    is the old schedule's at step 8, not the 16-step plan's, and one line says so."""
    run = tmp_path / "run"
    common = ("train.log_every=1", "train.eval_every=0", "train.lr_warmup_steps=2")
    run_train(tiny_overrides(run, small_corpus, *common, "train.steps=8"))
    n_first = len(read_events(run / "metrics.jsonl"))
    with caplog.at_level(logging.INFO, logger="edit_train"):
        s = run_train(tiny_overrides(run, small_corpus, *common, "train.steps=16", "resume=auto"))
    assert s["steps"] == 16
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: train.steps 8 -> 16")]
    assert len(lines) == 1 and "\n" not in lines[0], [r.getMessage() for r in caplog.records]
    events = read_events(run / "metrics.jsonl")
    before = [e["lr"] for e in events[:n_first] if e["event"] == "train"]
    after = [e for e in events[n_first:] if e["event"] == "train"]
    assert [e["step"] for e in after] == list(range(9, 17))
    # a train event's lr is that of the step just taken (0-based step - 1): step 9 took 0-based step 8
    assert after[0]["lr"] == pytest.approx(lr_at(8, 3e-3, 8, 2, 0.1), rel=1e-12)
    jump = lr_at(8, 3e-3, 16, 2, 0.1)
    assert jump > 3 * after[0]["lr"]  # what re-planning from step 0 gave
    lrs = [before[-1]] + [e["lr"] for e in after]
    assert all(b <= a + 1e-15 for a, b in zip(lrs, lrs[1:]))
    assert min(lrs) >= 3e-4 * (1 - 1e-9)
