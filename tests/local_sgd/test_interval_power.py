"""Syncs that follow the learning rate (`algo.interval_power`, issue 51): the same number of syncs as every
`algo.interval` steps, at equal quantiles of Σ lr^p — short intervals while the lr is high, long ones as it decays.
The placement against its closed form, the schedule's arithmetic, a two-cluster federation syncing exactly at
the boundaries, the claim bound and the checkpoints that follow them, the config's one-line refusals."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from edit_train.cli.common import compose
from edit_train.config import ConfigError, validate
from edit_train.local_sgd.sync.schedule import ScheduleConfig, lr_boundaries
from edit_train.train.build import fingerprint, sync_boundaries
from edit_train.train.lr import lr_at
from toy_federation import config, run_inproc

LRS = [lr_at(s, 3e-2, 320, 30, 0.1) for s in range(320)]


def test_power_zero_is_every_interval_and_a_warm_up_shifts_it() -> None:
    assert lr_boundaries(LRS, 0, 8, 0.0) == tuple(range(8, 321, 8))
    assert lr_boundaries(LRS, 20, 8, 0.0) == tuple(range(28, 317, 8))  # 37 syncs; the 4-step tail is not one


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0])
def test_each_interval_holds_an_equal_share_of_the_lr_sum(power: float) -> None:
    b = lr_boundaries(LRS, 0, 8, power)
    assert len(b) == 40 and b[-1] == 320 and all(x < y for x, y in zip((0, *b), b))
    w = [x ** power for x in LRS]
    share = sum(w) / 40
    sums = [sum(w[s:e]) for s, e in zip((0, *b), b)]
    # each interval ends at the first step whose running sum reaches its quantile: within one step's weight
    assert all(abs(sum(w[:e]) - share * k) <= max(w) for k, e in enumerate(b, start=1)), sums
    # p = 1: intervals ~ 1/lr — short where the lr peaks (step 30), long at the end
    peak = next(i for i, e in enumerate(b) if e > 30)
    assert b[peak] - b[peak - 1] < 8 < b[-1] - b[-2]


def test_the_schedule_counts_steps_through_its_boundaries() -> None:
    s = ScheduleConfig(interval=8, warmup_steps=4, boundaries=(10, 13, 20))
    s.validate()
    assert [s.steps_at(k) for k in range(6)] == [4, 10, 13, 20, 28, 36]
    assert [s.interval_after(t) for t in (4, 10, 11, 13, 20, 25, 28)] == [6, 3, 2, 7, 8, 3, 8]
    # checkpoints every 12 steps: at the first boundary at or past 12, 24, 36
    assert [t for t in range(1, 45) if s.saves_at(t, 12)] == [13, 28, 36]
    plain = ScheduleConfig(interval=8)
    assert [plain.steps_at(k) for k in range(3)] == [0, 8, 16] and plain.interval_after(5) == 8
    assert [t for t in range(1, 40) if plain.saves_at(t, 16)] == [16, 32]
    with pytest.raises(ValueError, match="boundaries must increase"):
        ScheduleConfig(interval=8, warmup_steps=10, boundaries=(10, 12)).validate()


def test_two_clusters_sync_exactly_at_the_boundaries() -> None:
    cfg = config("at_end", syncs=6)  # 24 steps, H = 4
    bounds = (2, 5, 9, 14, 19, 24)
    cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, boundaries=bounds))
    outs = run_inproc(["c0", "c1"], cfg)
    for name, o in outs.items():
        steps = [e["step"] for e in o.events if e["event"] == "sync"]
        assert steps == list(bounds), (name, steps)
        assert [e["local_steps"] for e in o.events if e["event"] == "sync"] == [2, 3, 4, 5, 5, 5]


def test_the_config_places_them_from_the_lr_and_the_fingerprint_holds_them() -> None:
    on = compose(["algo=edit", "algo.interval=8", "train.steps=320", "train.lr=0.03", "algo.interval_power=1"])
    validate(on)
    assert sync_boundaries(on) == lr_boundaries(LRS, 0, 8, 1.0)
    off = compose(["algo=edit", "algo.interval=8", "train.steps=320", "train.lr=0.03"])
    assert sync_boundaries(off) == ()
    other = compose(["algo=edit", "algo.interval=8", "train.steps=320", "train.lr=0.03", "train.min_lr_ratio=0.5",
                     "algo.interval_power=1"])
    assert fingerprint(on) != fingerprint(other)  # clusters that would sync at other steps do not meet
    # the quantiles of Σ lr^p do not move with the lr's scale: another peak lr syncs at the same steps
    assert sync_boundaries(compose(["algo=edit", "algo.interval=8", "train.steps=320", "train.lr=0.01",
                                    "algo.interval_power=1"])) == sync_boundaries(on)
    # off, the fingerprint is what it was: the lr schedule is not part of it
    assert fingerprint(off) == fingerprint(compose(["algo=edit", "algo.interval=8", "train.steps=320",
                                                     "train.lr=0.03", "train.min_lr_ratio=0.5"]))
    # checkpoint.every need not be a multiple of the interval: the first boundary past each multiple
    validate(compose(["algo=edit", "algo.interval=8", "algo.interval_power=1", "checkpoint.every=50"]))


@pytest.mark.parametrize("overrides, needle", [
    (["algo=a_edit", "algo.interval_power=1"], "step schedule"),
    (["algo=ddp", "algo.interval_power=1"], "step schedule"),
    (["algo=edit", "algo.interval_power=-1"], "must be in [0, 4]"),
])
def test_bad_settings_are_refused_in_one_line(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        validate(compose(overrides))
    assert "algo.interval_power" in str(exc.value) and needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_run_checkpointed_between_boundaries_resumes_bit_identically(tmp_path, small_corpus, torch_one_thread,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """`algo=edit`, the syncs following a warm-up-then-cosine lr (p = 1), `checkpoint.every=5` (no multiple of the
    interval): the checkpoints land on the first boundary past each multiple of 5, and a run resumed from the
    first of them ends bit for bit where the uninterrupted run ends (model, inner and outer state)."""
    import shutil

    from safetensors.torch import load_file

    from conftest import run_train, tiny_overrides
    common = ["algo=edit", "algo.interval=3", "algo.warmup_steps=0", "algo.interval_power=1", "train.steps=12",
              "train.lr_warmup_steps=2", "train.min_lr_ratio=0.1", "checkpoint.every=5", "checkpoint.keep=5",
              "train.eval_every=0"]
    cfg = compose(tiny_overrides(tmp_path / "full", small_corpus, *common))
    bounds = sync_boundaries(cfg)
    assert len(bounds) == 4 and bounds != (3, 6, 9, 12), bounds
    full = tmp_path / "full"
    run_train(tiny_overrides(full, small_corpus, *common))
    saved = sorted(int(p.name.removeprefix("step_")) for p in (full / "checkpoints").rglob("step_*")
                   if (p / "manifest.json").is_file())
    want = sorted({next(b for b in bounds if b >= m) for m in (5, 10)} | {12})
    assert sorted(set(saved)) == want, (saved, bounds)
    seg = tmp_path / "seg"
    shutil.copytree(full, seg)
    for p in list((seg / "checkpoints").rglob("step_*")):
        if p.is_dir() and int(p.name.removeprefix("step_")) > want[0]:
            shutil.rmtree(p)
    with caplog.at_level(logging.INFO, logger="edit_train.train.resume"):
        s2 = run_train(tiny_overrides(seg, small_corpus, *common, "resume=auto"))
    assert s2["steps"] == 12
    assert [r.getMessage() for r in caplog.records if f"(step {want[0]})" in r.getMessage()
            and r.getMessage().startswith("resumed from")], [r.getMessage() for r in caplog.records]
    a_files = sorted((full / "checkpoints").rglob("step_00000012/**/*.safetensors"))
    b_files = sorted((seg / "checkpoints").rglob("step_00000012/**/*.safetensors"))
    assert a_files and [f.relative_to(full) for f in a_files] == [f.relative_to(seg) for f in b_files]
    for fa, fb in zip(a_files, b_files):
        a, b = load_file(str(fa)), load_file(str(fb))
        assert a.keys() == b.keys() and not [k for k in a if not torch.equal(a[k], b[k])], fa.name
