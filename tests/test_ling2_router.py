"""Ling 2.0 (BailingMoeV2) routing, attention and MTP against closed forms and direct computations."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from edit_train.model.config import ModelConfig
from edit_train.model.moe import MoEBlock, bias_update, group_limited_mask
from edit_train.model.transformer import CausalLM

V2 = dict(score_function="sigmoid", moe_router_enable_expert_bias=True, n_group=4, topk_group=2,
          routed_scaling_factor=2.5, router_z_loss_coef=3.5e-6)


def _block(**kw) -> MoEBlock:
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, **kw)
    block = MoEBlock(cfg)
    block.reset_parameters()
    return block


def test_sigmoid_scores_weights_and_scaling_factor():
    block = _block(score_function="sigmoid", routed_scaling_factor=2.5)
    x = torch.randn(32, 16)
    logits, _, idx, w = block.route(x)
    s = torch.sigmoid(x @ block.gate.weight.t())
    assert torch.equal(logits, x @ block.gate.weight.t())
    want_idx = s.topk(2, dim=-1).indices
    assert torch.equal(idx, want_idx)
    picked = s.gather(1, want_idx)
    torch.testing.assert_close(w, 2.5 * picked / picked.sum(-1, keepdim=True), rtol=0, atol=1e-6)
    torch.testing.assert_close(w.sum(-1), torch.full((32,), 2.5), rtol=0, atol=1e-5)


def test_sigmoid_without_renormalisation_keeps_the_scores():
    block = _block(score_function="sigmoid", norm_topk_prob=False, routed_scaling_factor=2.0)
    x = torch.randn(8, 16)
    _, _, idx, w = block.route(x)
    s = torch.sigmoid(x @ block.gate.weight.t())
    torch.testing.assert_close(w, 2.0 * s.gather(1, idx), rtol=0, atol=0)


def test_group_limit_chooses_only_inside_the_best_groups():
    block = _block(score_function="sigmoid", n_group=4, topk_group=2)
    x = torch.randn(256, 16)
    _, _, idx, _ = block.route(x)
    s = torch.sigmoid(x @ block.gate.weight.t())
    group_score = s.view(256, 4, 2).topk(2, dim=-1).values.sum(-1)  # two experts a group: the sum of both
    best = group_score.topk(2, dim=-1).indices
    groups_of_choice = idx // 2
    assert all(set(g.tolist()) <= set(b.tolist()) for g, b in zip(groups_of_choice, best))
    # and some token's overall top-2 experts straddle a losing group: the limit is not a no-op here
    free = s.topk(2, dim=-1).indices
    assert not torch.equal(free.sort(-1).values, idx.sort(-1).values)


def test_group_mask_closed_form():
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3, 0.5, 0.5, 0.0, 0.8]])  # groups: 1.0, 0.5, 1.0, 0.8
    mask = group_limited_mask(scores, n_group=4, topk_group=2)
    assert mask.tolist() == [[True, True, False, False, True, True, False, False]]


def test_bias_changes_selection_never_the_weights():
    block = _block(score_function="sigmoid", moe_router_enable_expert_bias=True)
    x = torch.randn(64, 16)
    _, _, idx0, w0 = block.route(x)
    assert not (idx0 == 7).any(-1).all()
    with torch.no_grad():
        block.gate.expert_bias[7] = 10.0  # expert 7 wins every token's choice
    _, _, idx1, w1 = block.route(x)
    assert (idx1 == 7).any(-1).all()
    s = torch.sigmoid(x @ block.gate.weight.t())
    picked = s.gather(1, idx1)  # the unbiased scores of the chosen experts
    torch.testing.assert_close(w1, picked / picked.sum(-1, keepdim=True), rtol=0, atol=1e-6)
    rows = (idx0.sort(-1).values == idx1.sort(-1).values).all(-1)  # tokens that chose the same experts anyway
    if rows.any():
        torch.testing.assert_close(w0[rows].sort(-1).values, w1[rows].sort(-1).values, rtol=0, atol=0)


def test_bias_update_closed_form_is_zero_mean():
    load = torch.tensor([10, 2, 6, 6, 0, 12, 6, 6])  # mean 6
    delta = bias_update(load, 1e-3, zero_mean=True)
    raw = 1e-3 * torch.tensor([-1.0, 1, 0, 0, 1, -1, 0, 0])
    torch.testing.assert_close(delta, raw - raw.mean(), rtol=0, atol=0)
    assert abs(float(delta.sum())) < 1e-9
    torch.testing.assert_close(bias_update(load, 1e-3, zero_mean=False), raw, rtol=0, atol=0)
    skewed = torch.tensor([9, 1, 1, 1, 1, 1, 1, 1])  # not zero-mean before the correction
    assert abs(float(bias_update(skewed, 1e-3).sum())) < 1e-9


def test_one_bias_update_per_optimizer_step_from_the_step_load():
    torch.manual_seed(0)
    cfg = ModelConfig(**V2, moe_router_bias_update_rate=1e-2)
    model = CausalLM(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    loads = []
    for _ in range(2):  # two micro-batches of one step: their loads add up
        out = model(x, x)
        out.loss.backward()
        loads.append([b.last_expert_load.clone() for b in model.moe_blocks()])
    opt.step()
    before = [b.gate.expert_bias.clone() for b in model.moe_blocks()]
    model.update_expert_bias()
    for i, b in enumerate(model.moe_blocks()):
        step_load = loads[0][i] + loads[1][i]
        torch.testing.assert_close(b.gate.expert_bias - before[i], bias_update(step_load, 1e-2), rtol=0, atol=0)
        assert abs(float(b.gate.expert_bias.sum())) < 1e-6
        assert int(b.step_tokens.sum()) == 0  # consumed: the next step starts from zero
    after = [b.gate.expert_bias.clone() for b in model.moe_blocks()]
    model.update_expert_bias()  # no forward since: a balanced (empty) load moves nothing
    assert all(torch.equal(a, b.gate.expert_bias) for a, b in zip(after, model.moe_blocks()))
    assert not any(n.endswith("expert_bias") for n, _ in model.named_parameters())  # a buffer, no optimizer sees it
    assert all(f"layers.{i}.mlp.gate.expert_bias" in model.state_dict() for i in model.moe_layers())


def test_no_aux_loss_when_the_bias_is_on_and_z_loss_closed_form():
    block = _block(**V2)
    x = torch.randn(32, 16)
    block.train()
    block(x)
    assert float(block.aux_loss) == 0.0
    logits = x @ block.gate.weight.t()
    want = 3.5e-6 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(block.z_loss, want, rtol=1e-6, atol=0)
    off = _block(score_function="sigmoid")  # sigmoid without the bias: the balance loss still applies
    off(x)
    assert float(off.aux_loss.detach()) > 0


def _qk_direct(attn, x, cfg):
    """Attention written out: split, RMSNorm per head, RoPE on the first rotary dims, causal softmax."""
    b, t, _ = x.shape
    nq, nkv, hd, rd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    qkv = (x @ attn.query_key_value.weight.t()).view(b, t, nq + 2 * nkv, hd)
    q, k, v = qkv[:, :, :nq], qkv[:, :, nq:nq + nkv], qkv[:, :, nq + nkv:]

    def rms(z, w):
        return w * (z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    q, k = rms(q, attn.query_layernorm.weight), rms(k, attn.key_layernorm.weight)
    pos = torch.arange(t, dtype=torch.float64)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = pos[:, None] * inv[None, :]  # [T, rd/2]: pair (i, i + rd/2) turns by ang[:, i]

    def rope(z):
        z = z.double()
        a, c, rest = z[..., :rd // 2], z[..., rd // 2:rd], z[..., rd:]
        cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        return torch.cat((a * cos - c * sin, c * cos + a * sin, rest), -1)

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(nq // nkv, dim=2)
    v = v.double().repeat_interleave(nq // nkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, t, nq * hd)
    return out.float() @ attn.dense.weight.t()


@pytest.mark.parametrize("factor", [0.5, 0.25, 1.0])
def test_qk_norm_and_partial_rope_against_direct_computation(factor):
    torch.manual_seed(1)
    cfg = ModelConfig(use_qk_norm=True, partial_rotary_factor=factor)
    model = CausalLM(cfg)
    attn = model.layers[1].attention
    with torch.no_grad():
        attn.query_layernorm.weight.uniform_(0.5, 1.5)
        attn.key_layernorm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 12, cfg.hidden_size)
    torch.testing.assert_close(attn(x), _qk_direct(attn, x, cfg), rtol=1e-5, atol=1e-5)


def test_mtp_loss_against_direct_t_plus_2_cross_entropy():
    torch.manual_seed(2)
    cfg = ModelConfig(**V2, num_nextn_predict_layers=1, mtp_loss_scaling_factor=0.1, use_qk_norm=True,
                      partial_rotary_factor=0.5)
    model = CausalLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = model(x, y)
    # direct: the main model's normed hidden state h_t and the embedding of token t+1 predict token t+2
    with torch.no_grad():
        h = model.word_embeddings(x)
        for layer in model.layers[:cfg.num_hidden_layers]:
            h = layer(h)
        h = model.norm(h)
        mtp = model.layers[cfg.num_hidden_layers]
        e = model.word_embeddings(x[:, 1:])  # token t+1 at position t (t < T-1)
        z = mtp.eh_proj(torch.cat((mtp.enorm(e), mtp.hnorm(h[:, :-1])), -1))
        z = mtp.final_layernorm(super(type(mtp), mtp).forward(z))
        logits = model.lm_head(z)
        want = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 2:].reshape(-1))
        ce = F.cross_entropy(model.lm_head(h).reshape(-1, cfg.vocab_size), y.reshape(-1))
    torch.testing.assert_close(out.mtp_loss, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.ce_loss, ce, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss, out.ce_loss + out.aux_loss + out.z_loss + 0.1 * out.mtp_loss,
                               rtol=0, atol=0)
    out.loss.backward()  # the MTP layer trains, and through it the shared embeddings and head
    mtp = model.layers[cfg.num_hidden_layers]
    assert mtp.eh_proj.weight.grad is not None and float(mtp.eh_proj.weight.grad.abs().sum()) > 0
    assert len(model.moe_layers()) == cfg.num_hidden_layers - cfg.first_k_dense_replace + 1


def test_mtp_loss_under_the_fused_head_equals_full_logits():
    torch.manual_seed(3)
    cfg = ModelConfig(**V2, num_nextn_predict_layers=1)
    model = CausalLM(cfg)
    fused = CausalLM(dataclasses.replace(cfg, loss_chunk=7))
    fused.load_state_dict(model.state_dict())
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    a, b = model(x, x), fused(x, x)
    torch.testing.assert_close(a.mtp_loss, b.mtp_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("field,value", [("score_function", "relu"), ("n_group", 3), ("topk_group", 9),
                                         ("partial_rotary_factor", 0.3), ("routed_scaling_factor", 0.0),
                                         ("num_nextn_predict_layers", -1)])
def test_bad_fields_name_themselves(field, value):
    kw = {"n_group": 4, "topk_group": 2} if field == "topk_group" else {}
    with pytest.raises(ValueError, match=f"model.{field}"):
        ModelConfig(**{**kw, field: value}).validate()


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_ling1_presets_keep_their_exact_path(preset):
    """The Ling 1 presets leave every new field at its default: no new parameter or buffer, the router bit for bit
    Ling 1's softmax top-k, the attention's full RoPE without QK-norm, no MTP layer."""
    from edit_train.model.presets import load_preset

    cfg = load_preset(preset)
    assert not cfg.ling2_router and cfg.num_nextn_predict_layers == 0 and not cfg.use_qk_norm
    assert cfg.rotary_dim == cfg.head_dim
    torch.manual_seed(0)
    model = CausalLM(cfg)
    assert not any(k.endswith(("expert_bias", "layernorm.weight")) and ".attention." in k or k.endswith("expert_bias")
                   for k in model.state_dict())
    assert all(b.step_tokens is None for b in model.moe_blocks())
    block = model.moe_blocks()[0]
    x = torch.randn(64, cfg.hidden_size)
    _, probs, idx, w = block.route(x)
    p = torch.softmax(F.linear(x, block.gate.weight), dim=-1)
    tw, ti = torch.topk(p, cfg.num_experts_per_tok, dim=-1)
    assert torch.equal(probs, p) and torch.equal(idx, ti) and torch.equal(w, tw / tw.sum(-1, keepdim=True))
    out = model(torch.randint(0, cfg.vocab_size, (1, 8)), torch.randint(0, cfg.vocab_size, (1, 8)))
    assert out.mtp_loss is None


def test_grouped_experts_serve_256_experts_like_the_sorted_path():
    """Ling 2.0's 256 experts (top-8 within 4 of 8 groups) through torch._grouped_mm = the sorted reference."""
    kw = dict(V2, hidden_size=32, num_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
              moe_intermediate_size=16)
    torch.manual_seed(4)
    sorted_block = MoEBlock(ModelConfig(**kw, expert_impl="sorted"))
    sorted_block.reset_parameters()
    grouped = MoEBlock(ModelConfig(**kw, expert_impl="grouped"))
    grouped.load_state_dict(sorted_block.state_dict())
    x = torch.randn(300, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    a, b = sorted_block(x), grouped(x2)
    assert grouped.experts.last_impl == "grouped"
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    a.square().sum().backward()
    b.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(sorted_block.experts.gate_proj.grad, grouped.experts.gate_proj.grad, rtol=1e-4,
                               atol=1e-6)
    assert int(sorted_block.last_expert_load.sum()) == 300 * 8
