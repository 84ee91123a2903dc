"""Issue 52: a training step that does not log reads nothing back from the device (no host sync), so the CPU
queues the next step while the accelerator runs this one.

A real `Trainer` (tiny, CPU) runs under `HostReads`, a TorchFunctionMode that counts the calls that would block
on a GPU (`.item()`, `float()` / `bool()` / `int()` on a tensor, `.tolist()`, `.cpu()`, `.numpy()`): every step
that does not log makes none (today's `train_step` made two per step: the loss per micro-batch and the
finite-gradient check). The `cuda` twin runs the same steps under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import math
import traceback
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import read_events, tiny_overrides

pytestmark = pytest.mark.usefixtures("torch_one_thread")

READS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


class HostReads(TorchFunctionMode):
    """Counts the tensor → host reads made inside it (a list of their names)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in READS:
            caller = traceback.extract_stack(limit=2)[0]
            self.reads.append(f"{getattr(func, '__name__', func)} at {caller.filename}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


def _trainer(overrides: list[str]) -> Any:
    from edit_train.cli.common import compose
    from edit_train.train.trainer import Trainer

    return Trainer(compose(overrides))


def _count_per_step(trainer: Any, mode_factory: Any) -> dict[int, int]:
    """Run the trainer with every step's work (train_step → algo.after_step) inside `mode_factory()`;
    returns {step: host reads}."""
    per_step: dict[int, int] = {}
    reads: list[str] = []  # where the first reads of each step were made (the failure message)
    train_step, after_step = trainer.train_step, trainer.algo.after_step
    current: dict[str, Any] = {}

    def counted_train_step(step: int) -> Any:
        current["mode"] = mode = mode_factory()
        mode.__enter__()
        current["step"] = step
        return train_step(step)

    def counted_after_step(step: int, seconds: float) -> Any:
        mode = current.pop("mode")
        try:
            return after_step(step, seconds)
        finally:
            mode.__exit__(None, None, None)
            per_step[step] = len(getattr(mode, "reads", []))
            reads.extend(getattr(mode, "reads", [])[:3])

    trainer.train_step, trainer.algo.after_step = counted_train_step, counted_after_step
    trainer.run()
    per_step[-1] = reads  # type: ignore[assignment]
    return per_step


@pytest.mark.parametrize("extra", [
    [],  # fp32, the spike guard on (its default), ddp's gradient exchange with the loss riding it
    ["train.precision=bf16", "train.grad_accum=2", "train.spike_factor=0"],  # autocast + working copies
], ids=["fp32-spike", "bf16-accum2"])
def test_no_host_read_on_steps_that_do_not_log(tmp_path, small_corpus, extra: list[str]) -> None:
    log_every = 4
    trainer = _trainer(tiny_overrides(tmp_path, small_corpus, "train.steps=8", f"train.log_every={log_every}",
                                      "train.eval_every=0", "model.expert_impl=grouped", *extra))
    per_step = _count_per_step(trainer, HostReads)
    where = per_step.pop(-1)
    quiet = {s: n for s, n in per_step.items() if (s + 1) % log_every and s > 0}
    assert len(quiet) == 5 and all(n == 0 for n in quiet.values()), (per_step, where[:6])
    logged = [e for e in read_events(tmp_path / "metrics.jsonl") if e.get("event") == "train"]
    assert [e["step"] for e in logged] == [4, 8] and all(math.isfinite(e["loss"]) for e in logged)


def test_local_sgd_steps_between_syncs_read_nothing(tmp_path, small_corpus) -> None:
    """A local-SGD cluster (EDiT, one cluster, interval 4): the sync reads its norms and decisions (step 3's
    exchange, step 4's forward that applies the units); the local steps between syncs read nothing."""
    trainer = _trainer(tiny_overrides(tmp_path, small_corpus, "algo=edit", "algo.interval=4", "train.steps=8",
                                      "train.log_every=8", "train.eval_every=0", "model.expert_impl=grouped"))
    per_step = _count_per_step(trainer, HostReads)
    where = per_step.pop(-1)
    assert trainer.algo.stats()["syncs"] == 2
    assert [per_step[s] for s in (1, 2, 5, 6)] == [0, 0, 0, 0], (per_step, where[:6])
    assert per_step[3] > 0  # the sync's own reads (not this issue's)


def test_a_non_finite_step_is_skipped_on_the_device_and_logged_at_the_log_step(tmp_path, small_corpus) -> None:
    """Step 2's gradients are NaN: the fused optimizer leaves the weights and its state as they were (decided on
    the device), and the `skip` event and the count come at the next log step."""
    trainer = _trainer(tiny_overrides(tmp_path, small_corpus, "train.steps=4", "train.log_every=4",
                                      "train.eval_every=0", "train.spike_factor=0"))
    grads = trainer.sim.grads
    seen: dict[int, list[torch.Tensor]] = {}

    def poison(step: int, model: torch.nn.Module) -> None:
        grads(step, model)
        if step == 2:
            seen[2] = [p.detach().clone() for p in model.parameters()]
            next(iter(model.parameters())).grad.fill_(float("nan"))

    trainer.sim.grads = poison
    train_step = trainer.train_step
    after: dict[int, list[torch.Tensor]] = {}

    def step_and_keep(step: int) -> Any:
        out = train_step(step)
        after[step] = [p.detach().clone() for p in trainer.model.parameters()]
        return out

    trainer.train_step = step_and_keep
    summary = trainer.run()
    assert all(torch.equal(a, b) for a, b in zip(seen[2], after[2]))  # step 2 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(after[1], after[3]))  # step 3 trained
    skips = [e for e in read_events(tmp_path / "metrics.jsonl") if e.get("event") == "skip"]
    assert [(e["step"], e["reason"]) for e in skips] == [(3, "non_finite")]
    assert trainer.state.skipped_steps == 1 and summary


def test_a_spike_is_decided_on_the_device_and_requeued_at_the_log_step(tmp_path, small_corpus) -> None:
    """The spike guard's decision is taken on the device: step 3's agreed loss is 1000 (injected), the update is
    skipped (weights unchanged), and the log step logs the `spike` event with that loss and re-queues the batch
    `requeue_after` steps after step 3."""
    trainer = _trainer(tiny_overrides(tmp_path, small_corpus, "train.steps=6", "train.log_every=6",
                                      "train.eval_every=0", "train.spike_factor=2", "train.spike_patience=1",
                                      "train.spike_requeue_after=10"))
    trainer.spike.warmup = 1
    after_backward, train_step = trainer.algo.after_backward, trainer.train_step
    params: dict[int, list[torch.Tensor]] = {}

    def agreed(step: int, loss: Any) -> Any:
        out = after_backward(step, loss)
        return out * 0 + 1000.0 if step == 3 else out

    def step_and_keep(step: int) -> Any:
        out = train_step(step)
        params[step] = [p.detach().clone() for p in trainer.model.parameters()]
        return out

    trainer.algo.after_backward, trainer.train_step = agreed, step_and_keep
    trainer.run()
    assert all(torch.equal(a, b) for a, b in zip(params[2], params[3]))  # step 3's update was skipped
    assert not all(torch.equal(a, b) for a, b in zip(params[3], params[4]))
    spikes = [e for e in read_events(tmp_path / "metrics.jsonl") if e.get("event") == "spike"]
    assert [(e["step"], e["loss"], e["requeued_for"]) for e in spikes] == [(4, 1000.0, 13)]
    assert [due for due, _ in trainer.spike.queue] == [13] and trainer.spike.skipped == 1
    assert not [e for e in read_events(tmp_path / "metrics.jsonl") if e.get("event") == "skip"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_device_sync_on_steps_that_do_not_log_cuda(tmp_path, small_corpus) -> None:
    import contextlib

    started: list[bool] = []

    def sync_debug_error() -> contextlib.AbstractContextManager:
        """From the second step on (the first builds the optimizer's and the spike guard's state)."""
        if not started:
            started.append(True)
            return contextlib.nullcontext()
        return SyncDebugError()

    class SyncDebugError(contextlib.AbstractContextManager):
        def __enter__(self) -> "SyncDebugError":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            return self

        def __exit__(self, *exc: Any) -> None:
            torch.cuda.set_sync_debug_mode("default")

    log_every = 4
    trainer = _trainer(tiny_overrides(tmp_path, small_corpus, "train.device=cuda", "train.precision=bf16",
                                      "train.steps=8", f"train.log_every={log_every}", "train.eval_every=0",
                                      "train.grad_accum=2", "model.expert_impl=grouped"))
    per_step = _count_per_step(trainer, sync_debug_error)  # a sync inside raises
    assert len(per_step) == 9  # 8 steps + the (empty) list of reads
