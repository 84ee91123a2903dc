"""What makes a step fast on a GPU, checked where it can be on the CPU: the decoder block compiles to one graph
with no graph break (with and without activation checkpointing, grouped experts in bf16, the fused head loss's
kernel too) and computes what the eager block computes; attention takes SDPA's flash kernel with our layout and
grouped-query heads."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from edit_train.model import CausalLM
from edit_train.model.config import ModelConfig
from edit_train.model.transformer import Attention
from edit_train.train.parallel import apply_activation_checkpointing, apply_compile

pytestmark = [pytest.mark.usefixtures("torch_one_thread"),
              pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")]

# every layer an MoE layer with grouped experts (bf16: what torch.compile traces), the fused head loss on
CFG = dataclasses.replace(ModelConfig(), expert_impl="grouped", first_k_dense_replace=0, num_hidden_layers=2,
                          loss_chunk=16)


def _step(model: CausalLM) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [pytest.param("none", marks=pytest.mark.slow), "full",
                                           pytest.param("moe", marks=pytest.mark.slow)])
def test_decoder_block_compiles_without_graph_breaks(checkpointing: str) -> None:
    """Dynamo's trace only (backend=eager, no inductor): a graph break, or a whole layer silently left eager (as
    the MoE block's side effects did under checkpointing), would show here. `full` traces the whole layer inside
    the checkpoint and the loss kernel (default run, ~8 s); `none` and `moe` are slow."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    eager = CausalLM(CFG)
    compiled = CausalLM(CFG)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        apply_activation_checkpointing(model, checkpointing)
    assert apply_compile(compiled, backend="eager") == CFG.num_hidden_layers
    loss, grads = _step(compiled)
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    # one graph for the decoder layers (shared by both) + the head loss's chunk kernel
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])
    assert all(b.experts.last_impl == "grouped" for b in compiled.moe_blocks())
    ref_loss, ref_grads = _step(eager)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for name, g in ref_grads.items():  # bf16: the traced graph may round differently
        torch.testing.assert_close(grads[name], g, rtol=5e-2, atol=5e-3, msg=name)


def test_attention_runs_on_the_flash_kernel() -> None:
    """Only SDPA's flash backend allowed: our q/k/v layout (views of the fused projection) and grouped-query heads
    (enable_gqa) are accepted, and the result is the math backend's."""
    cfg = ModelConfig()
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, 32, cfg.hidden_size, requires_grad=True)
    outs = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        x.grad = None
        with sdpa_kernel([backend]):
            y = attn(x)
        y.square().sum().backward()
        outs[backend] = (y.detach(), x.grad.clone())
    for a, b in zip(outs[SDPBackend.FLASH_ATTENTION], outs[SDPBackend.MATH]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


V2 = dataclasses.replace(CFG, score_function="sigmoid", moe_router_enable_expert_bias=True, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, use_qk_norm=True, partial_rotary_factor=0.5,
                         num_nextn_predict_layers=1, router_aux_loss_coef=0.0, router_z_loss_coef=3.5e-6)


def test_ling2_router_and_mtp_layer_compile_without_graph_breaks() -> None:
    """Ling 2.0's block (sigmoid scores, the expert bias choosing, group-limited top-k, scaling, QK-norm, half RoPE)
    and the MTP layer, compiled as the trainer compiles them (Dynamo's trace, backend=eager): no graph break, the
    eager block's loss and gradients, and the expert bias update after the step sees the compiled forward's load."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    eager = CausalLM(V2)
    with torch.no_grad():  # a bias that changes the choice (zero would leave the bias path untested)
        for b in eager.moe_blocks():
            b.gate.expert_bias.copy_(torch.randn(V2.num_experts) * 0.05)
    compiled = CausalLM(V2)
    compiled.load_state_dict(eager.state_dict())
    assert apply_compile(compiled, backend="eager") == V2.num_hidden_layers + 1  # the MTP layer too
    loss, grads = _step(compiled)
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    ref_loss, ref_grads = _step(eager)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=5e-2, atol=5e-3, msg=name)
    for model in (eager, compiled):
        model.update_expert_bias()
    for a, b in zip(eager.moe_blocks(), compiled.moe_blocks()):
        torch.testing.assert_close(a.gate.expert_bias, b.gate.expert_bias)
