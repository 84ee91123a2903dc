"""Issue 52: the memory plan (`edit_train/memplan.py`, what `edit-train-info` prints) within 10 % of the peak a
real `Trainer` step reaches, measured on the CPU allocator: torch.profiler's memory events (every allocation and
free of the step, in order) added to what was live before the step (parameters + AdamW state)."""

from __future__ import annotations

import logging

from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import tiny_overrides
from edit_train.memplan import plan_for_config

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _live_bytes(trainer: Any) -> int:
    """Bytes of the distinct storages of the parameters and the optimizer state."""
    storages: dict[int, int] = {}
    tensors = list(trainer.model.parameters())
    tensors += [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def measured_peak(trainer: Any, step: int) -> int:
    """The CPU allocator's peak over one `train_step`: bytes live before it + the largest running sum of the
    step's allocations and frees."""
    before = _live_bytes(trainer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step(step)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return before + peak


@pytest.mark.parametrize("extra", [
    [],
    ["train.grad_accum=2"],
    ["train.precision=bf16"],
    ["train.precision=bf16", "train.grad_accum=3", "model.expert_impl=grouped"],
    ["train.activation_checkpointing=full", "train.seq_len=128"],
], ids=["fp32", "fp32-accum2", "bf16", "bf16-accum3-grouped", "full-checkpointing"])
def test_plan_within_ten_percent_of_the_cpu_peak(tmp_path, small_corpus, extra: list[str]) -> None:
    from edit_train.cli.common import compose
    from edit_train.train.trainer import Trainer

    cfg = compose(tiny_overrides(tmp_path, small_corpus, "train.steps=2", "train.spike_factor=0", *extra))
    trainer = Trainer(cfg)
    trainer.train_step(0)  # the optimizer's state exists from the first step on
    peak = measured_peak(trainer, 1)
    plan = plan_for_config(cfg)
    assert 0.9 <= plan["total_bytes"] / peak <= 1.1, (plan["total_bytes"], peak, plan["phases"])


def test_out_of_memory_is_one_line_naming_the_plan(tmp_path, small_corpus, monkeypatch, capsys) -> None:
    """A cluster that runs out of device memory (simulated: `torch.OutOfMemoryError` from its step) stops with
    one line naming the plan's figure and what to change, exit 1 — not 2, the code that stops every cluster of
    a local federation: the launcher lets the others go on."""
    from omegaconf import OmegaConf

    from edit_train.cli.common import compose
    from edit_train.cli.train import _task
    from edit_train.memplan import OutOfMemory
    from edit_train.train.trainer import Trainer

    def oom(self: Any, step: int) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Trainer, "train_step", oom)
    monkeypatch.setattr("edit_train.cli.train._multirun_dir", lambda cfg: None)  # no Hydra app around it here
    cfg = compose(tiny_overrides(tmp_path, small_corpus, "train.steps=2", "train.batch_size=4"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # `_task` sets up the console log on capsys's stream
    try:
        with pytest.raises(SystemExit) as exc:
            _task(OmegaConf.structured(cfg))
    finally:
        root.handlers[:], root.level = handlers, level  # not left writing to a stream pytest closes
    assert exc.value.code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    plan = plan_for_config(cfg)
    assert len(err) == 1 and f"the memory plan says {plan['total_gib']:.1f} GiB per rank" in err[0], err
    assert "train.activation_checkpointing=full" in err[0] and "train.batch_size (now 4" in err[0]
    assert "Traceback" not in capsys.readouterr().err
    assert issubclass(OutOfMemory, RuntimeError)
