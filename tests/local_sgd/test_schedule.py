"""Tests for the sync schedules: warm-up, step interval, A-EDiT time planner, step timer."""

from __future__ import annotations

import json
import math

import pytest

from edit_train.local_sgd.sync.schedule import ScheduleConfig, StepSchedule, StepTimer, TimePlanner


def test_step_schedule() -> None:
    s = StepSchedule(ScheduleConfig(interval=4, warmup_steps=3))
    assert [s.is_warmup(i) for i in range(5)] == [True, True, True, False, False]
    assert not StepSchedule(ScheduleConfig()).is_warmup(0)


def test_planner_closed_form() -> None:
    p = TimePlanner(ScheduleConfig(kind="time", sync_time_s=10.0))
    assert [p.steps_for(s) for s in (0.1, 0.3)] == [100, 33]
    assert [p.steps_for(s) for s in (0.2, 0.2)] == [50, 50]  # re-plan when the times change
    assert TimePlanner(ScheduleConfig(kind="time", sync_time_s=0.7)).steps_for(0.1) == 7


def test_planner_floor_and_cap() -> None:
    p = TimePlanner(ScheduleConfig(kind="time", sync_time_s=1.0, min_steps=4, max_steps=20))
    assert [p.steps_for(s) for s in (1.0, 0.01, 0.1)] == [4, 20, 10]


def test_planner_unknown_times() -> None:
    p = TimePlanner(ScheduleConfig(kind="time", interval=16, sync_time_s=1.0, min_steps=2))
    assert [p.steps_for(s) for s in (math.nan, 0.0, math.inf)] == [16, 16, 2]


def test_step_timer() -> None:
    t = StepTimer()
    assert math.isnan(t.mean())
    for s in (0.1, 0.2, 0.3, math.inf):
        t.record(s)
    assert t.count == 3 and t.mean() == pytest.approx(0.2)
    t.reset()
    assert t.count == 0 and math.isnan(t.mean())
    e = StepTimer(ewma=0.5)
    for s in (1.0, 3.0, 2.0):
        e.record(s)
    assert e.mean() == pytest.approx(2.0)  # 1 → 2 → 2
    f = StepTimer(ewma=0.5)
    f.load_state_dict(json.loads(json.dumps(e.state_dict())))
    assert f.mean() == e.mean() and f.count == 3
    with pytest.raises(ValueError):
        t.record(-1.0)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"kind": "wall"}, "schedule"),
        ({"interval": 0}, "interval"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"sync_time_s": 0.0}, "sync_time_s"),
        ({"min_steps": 0}, "min_steps"),
        ({"max_steps": -1}, "max_steps"),
        ({"min_steps": 5, "max_steps": 2}, "max_steps"),
    ],
)
def test_validate(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"algo.{field}"):
        ScheduleConfig(**kw).validate()
