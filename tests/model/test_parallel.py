"""Per-layer execution options (train/parallel.py): activation checkpointing and torch.compile leave the
numerics and the parameter names alone; the precision policy; fp32 anchors under bf16 parameters; the
trainer with checkpointing on and the `mfu` figure."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import read_events, run_train, tiny_overrides
from edit_train.local_sgd.sync.outer import OuterConfig, OuterState
from edit_train.model import CausalLM
from edit_train.model.config import ModelConfig
from edit_train.train.parallel import apply_layer_options, precision_policy

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _loss_and_grads(mode: str, compile: bool = False, warmup: int = 10
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
    cfg = dataclasses.replace(ModelConfig(), routing_warmup_steps=warmup)  # stochastic routing: RNG replayed
    torch.manual_seed(0)
    model = CausalLM(cfg)
    model.set_step(3)
    apply_layer_options(model, mode, compile)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(1)
    out = model(ids, ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}, list(model.state_dict())


@pytest.mark.parametrize("mode", ["full", "moe"])
def test_activation_checkpointing_is_numerically_identical(mode: str) -> None:
    loss0, grads0, keys0 = _loss_and_grads("none")
    loss, grads, keys = _loss_and_grads(mode)
    assert keys == keys0  # nothing renamed: checkpoints, FSDP units and sync hooks see the same modules
    assert abs(float(loss) - float(loss0)) <= 1e-6
    for name, g in grads0.items():
        assert (grads[name] - g).abs().max() <= 1e-6, name


def test_checkpointing_wraps_the_right_modules() -> None:
    model = CausalLM(ModelConfig())  # 4 layers, the first dense
    assert apply_layer_options(model, "full")["checkpointed"] == 4
    model = CausalLM(ModelConfig())
    assert apply_layer_options(model, "moe")["checkpointed"] == 3
    assert apply_layer_options(CausalLM(ModelConfig()), "none")["checkpointed"] == 0
    with pytest.raises(ValueError, match="train.activation_checkpointing"):
        apply_layer_options(CausalLM(ModelConfig()), "some")


def test_checkpointed_model_evaluates_without_grad() -> None:
    model = CausalLM(ModelConfig())
    apply_layer_options(model, "full")
    with torch.no_grad():
        out = model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    assert math.isfinite(float(out.loss))


@pytest.mark.slow
def test_compile_per_layer_matches_eager() -> None:
    loss0, grads0, keys0 = _loss_and_grads("none", warmup=0)
    loss, grads, keys = _loss_and_grads("full", compile=True, warmup=0)
    assert keys == keys0
    assert abs(float(loss) - float(loss0)) <= 1e-5
    for name, g in grads0.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_precision_policy() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    p = precision_policy("bf16", gpu, sharded=True)
    assert p.fsdp_param_dtype == torch.bfloat16 and p.autocast_dtype is None
    p = precision_policy("bf16", gpu, sharded=False)
    assert p.fsdp_param_dtype is None and p.autocast_dtype == torch.bfloat16
    p = precision_policy("bf16", cpu, sharded=True)  # FSDP mixed precision only on CUDA
    assert p.fsdp_param_dtype is None and p.autocast_dtype == torch.bfloat16
    p = precision_policy("fp32", gpu, sharded=True)
    assert p.fsdp_param_dtype is None and p.autocast_dtype is None and p.compute_dtype == torch.float32
    with p.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")


def test_anchor_and_outer_momentum_stay_fp32_for_bf16_params() -> None:
    params = [torch.randn(4, 3).to(torch.bfloat16), torch.randn(5).to(torch.bfloat16)]
    state = OuterState({"m": params}, OuterConfig(momentum=0.9))
    assert all(a.dtype == torch.float32 for a in state.anchors["m"])
    for a, p in zip(state.anchors["m"], params):
        assert torch.equal(a, p.float())
    with torch.no_grad():
        for p in params:
            p.add_(0.5)
    delta = state.pseudo_grad("m")
    assert all(d.dtype == torch.float32 for d in delta)
    state.step("m", [d.to(torch.bfloat16) for d in delta])  # even a bf16 delta lands in fp32 state
    assert all(a.dtype == torch.float32 for a in state.anchors["m"])
    buffers = [st["momentum_buffer"] for st in state.optimizers["m"].state.values()]
    assert len(buffers) == 2 and all(b.dtype == torch.float32 for b in buffers)


def test_trainer_checkpointing_same_losses_and_mfu(tmp_path, small_corpus) -> None:
    """A real run with `train.activation_checkpointing=full` logs exactly the losses of a run without it;
    `mfu` is null on CPU unless `train.peak_flops` is given, then tokens/s x FLOPs/token / peak."""
    from edit_train.model import count_params
    from edit_train.model.presets import load_preset
    from edit_train.train.mfu import flops_per_token

    losses, events = {}, {}
    summaries = {}
    for mode, extra in (("none", []), ("full", ["train.peak_flops=1e12"]), ("moe", [])):
        run_dir = tmp_path / mode
        summaries[mode] = run_train(tiny_overrides(run_dir, small_corpus, f"train.activation_checkpointing={mode}",
                                                   *extra))
        events[mode] = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "train"]
        losses[mode] = [e["loss"] for e in events[mode]]
    assert losses["full"] == losses["none"] and losses["moe"] == losses["none"]
    assert all("mfu" in e and e["mfu"] is None for e in events["none"])
    assert summaries["none"]["mfu"] is None
    cfg = load_preset("tiny")
    fpt = flops_per_token(cfg, 32, count_params(cfg)["active_params"])
    for e in events["full"]:
        assert e["mfu"] == pytest.approx(e["tokens_per_s"] * fpt / 1e12, rel=1e-9)
    assert summaries["full"]["mfu"] == pytest.approx(sum(e["mfu"] for e in events["full"]) / len(events["full"]))


def test_grouped_experts_checked_before_training() -> None:
    """`model.expert_impl=grouped` where it cannot run fails when the options are applied, not mid-step:
    under torch.compile the grouped GEMM traces in bf16 only."""
    cfg = dataclasses.replace(ModelConfig(), expert_impl="grouped")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="model.expert_impl=grouped"):
        apply_layer_options(CausalLM(cfg), "none", True, cpu, torch.float32)
    apply_layer_options(CausalLM(cfg), "none", False, cpu, torch.float32)  # eager fp32 on CPU: fine
    auto = dataclasses.replace(ModelConfig(), expert_impl="auto")
    apply_layer_options(CausalLM(auto), "none", False, cpu, torch.float32)  # auto never fails


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_checkpointing_under_fsdp2_same_losses(tmp_path, small_corpus) -> None:
    """A cluster of 2 CPU ranks sharding the replica with FSDP2 (gloo): recomputing each decoder layer in
    backward (inside the FSDP unit, after its all-gather) logs exactly the losses of a run without it, and the
    same routed tokens per expert: the recompute does not count again, and the cluster sums both ranks'."""
    from conftest import run_cli

    losses, experts = {}, {}
    for mode in ("none", "full"):
        run_dir = tmp_path / mode
        proc = run_cli("edit-train", "edit_train.cli.train",
                       tiny_overrides(run_dir, small_corpus, "cluster=local_1x2", "train.steps=4",
                                      "train.log_every=1", "train.eval_every=0",
                                      f"train.activation_checkpointing={mode}"), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        events = read_events(run_dir / "metrics.jsonl")
        losses[mode] = [e["loss"] for e in events if e["event"] == "train"]
        experts[mode] = [e["counts"] for e in events if e["event"] == "experts"]
    assert len(losses["none"]) == 4 and losses["full"] == losses["none"]
    assert len(experts["none"]) == 4 and experts["full"] == experts["none"]
    assert all(sum(row) == 2 * 2 * 32 * 2 for c in experts["none"] for row in c)  # 2 ranks x 2 x 32 tokens x top-2
