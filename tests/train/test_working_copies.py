"""Issue 52: with bf16 precision the weights are cast to bf16 once per optimizer step (working copies), not once
per micro-batch per layer; the fp32 master weights and the optimizer state are unchanged, and so are the loss
and the gradients (the copies are the same casts of the same fp32 weights)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_overrides
from edit_train.model import CausalLM
from edit_train.model.presets import load_preset
from edit_train.train.parallel import precision_policy

pytestmark = pytest.mark.usefixtures("torch_one_thread")


class ParamCasts(TorchDispatchMode):
    """Counts the fp32 → bf16 casts of the given parameters (by storage)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.casts = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
                and args[0].dtype == torch.float32 and args[0].untyped_storage().data_ptr() in self.ptrs):
            self.casts += 1
        return func(*args, **kwargs)


def _model(impl: str) -> CausalLM:
    cfg = dataclasses.replace(load_preset("tiny"), expert_impl=impl)
    torch.manual_seed(0)
    return CausalLM(cfg)


def _accumulate(model: CausalLM, batches: list[torch.Tensor], per_step: bool) -> tuple[list[float], list[torch.Tensor]]:
    """Forward + backward of every micro-batch in bf16 autocast: one region per micro-batch (the casts
    today's trainer made) or one region for the optimizer step (`PrecisionPolicy.optimizer_step`)."""
    policy = precision_policy("bf16", torch.device("cpu"), sharded=False)
    model.zero_grad(set_to_none=True)
    losses = []
    outer = policy.optimizer_step("cpu") if per_step else contextlib.nullcontext()
    with outer:
        for ids in batches:
            with policy.autocast("cpu"):
                out = model(ids, ids)
            with policy.backward("cpu") if per_step else contextlib.nullcontext():
                (out.loss / len(batches)).backward()
            losses.append(float(out.ce_loss))
    return losses, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("impl", ["grouped", "sorted"])
def test_working_copies_give_the_per_microbatch_losses_and_grads(impl: str) -> None:
    model = _model(impl)
    vocab = load_preset("tiny").vocab_size
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (2, 32), generator=gen) for _ in range(4)]
    params = list(model.parameters())
    with ParamCasts(params) as today:
        loss_a, grads_a = _accumulate(model, batches, per_step=False)
    with ParamCasts(params) as copies:
        loss_b, grads_b = _accumulate(model, batches, per_step=True)
    assert all(p.dtype == torch.float32 for p in params)  # the master weights stay fp32
    for a, b in zip(loss_a, loss_b):
        assert a == pytest.approx(b, rel=1e-2)  # bf16 tolerance (they are the same casts: equal in practice)
    for a, b in zip(grads_a, grads_b):
        assert a.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-2, atol=1e-4)
    # each weight is cast at most once per optimizer step (4 micro-batches: today up to 4 times)
    assert copies.casts <= today.casts / 3 and copies.casts > 0, (today.casts, copies.casts)


def test_trainer_step_casts_each_weight_once(tmp_path, small_corpus) -> None:
    """A real Trainer's bf16 step of 4 micro-batches casts every weight the matmuls read once (it cast them
    once per micro-batch before), and the optimizer steps the fp32 master weights."""
    from edit_train.cli.common import compose
    from edit_train.train.trainer import Trainer

    trainer = Trainer(compose(tiny_overrides(tmp_path, small_corpus, "train.precision=bf16", "train.grad_accum=4",
                                             "train.steps=2", "model.expert_impl=grouped", "train.spike_factor=0")))
    params = list(trainer.model.parameters())
    before = [p.detach().clone() for p in params]
    with ParamCasts(params) as casts:
        loss, applied = trainer.train_step(0)
    once = sum(1 for p in params if p.dim() >= 2)  # the matmul weights (norm weights stay fp32)
    assert casts.casts <= once, (casts.casts, once)
    assert bool(applied) and torch.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in params) and any(not torch.equal(a, p) for a, p in zip(before, params))
    state = trainer.optimizer.state[params[0]]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
