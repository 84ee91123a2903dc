"""The Ling-style MoE model: routing, sorted dispatch, losses, warmup, NormHead, attention, presets."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from edit_train.model import CausalLM, ModelConfig, count_params, load_preset
from edit_train.model.moe import MoEBlock, RoutedExperts, balance_loss, z_loss
from edit_train.model.presets import available_presets
from edit_train.model.transformer import Attention, NormHead


def tiny(**overrides) -> ModelConfig:
    return dataclasses.replace(load_preset("tiny"), **overrides)


def small_moe_cfg(**overrides) -> ModelConfig:
    base = dict(hidden_size=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
                num_shared_experts=1, router_aux_loss_coef=0.01, router_z_loss_coef=1e-3)
    base.update(overrides)
    return dataclasses.replace(ModelConfig(), **base)


def naive_experts(experts: RoutedExperts, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-token reference: a python loop over tokens and their k experts."""
    rows = []
    for n in range(x.shape[0]):
        acc = torch.zeros_like(x[n])
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            h = F.silu(experts.gate_proj[e] @ x[n]) * (experts.up_proj[e] @ x[n])
            acc = acc + w[n, j] * (experts.down_proj[e] @ h)
        rows.append(acc)
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------------- routing
def test_topk_weights_sum_to_one_and_every_token_gets_k_experts():
    torch.manual_seed(0)
    cfg = small_moe_cfg(num_experts=8, num_experts_per_tok=3)
    block = MoEBlock(cfg)
    block.reset_parameters(0.5)
    x = torch.randn(4, 10, cfg.hidden_size)
    _, probs, idx, w = block.route(x.reshape(-1, cfg.hidden_size))
    torch.testing.assert_close(w.sum(-1), torch.ones(40))
    torch.testing.assert_close(probs.sum(-1), torch.ones(40))
    assert idx.shape == (40, 3) and all(len(set(r)) == 3 for r in idx.tolist())
    y = block(x)
    assert y.shape == x.shape
    load = block.last_expert_load
    assert load.dtype == torch.long and load.shape == (8,) and not load.requires_grad
    assert int(load.sum()) == 40 * 3


@pytest.mark.parametrize("num_experts,top_k,tokens", [(6, 2, 40), (8, 3, 5), (4, 1, 17)])
def test_sorted_dispatch_matches_naive_reference_forward_and_backward(num_experts, top_k, tokens):
    torch.manual_seed(1)
    experts = RoutedExperts(num_experts, 16, 12).double()
    experts.reset_parameters(0.3)
    x = torch.randn(tokens, 16, dtype=torch.float64, requires_grad=True)
    # route with a skew so that some experts get nothing (tokens=5, E=8) and others many
    idx = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, dtype=torch.float64).requires_grad_()
    dy = torch.randn(tokens, 16, dtype=torch.float64)

    y, counts = experts(x, idx, w)
    assert counts.tolist() == torch.bincount(idx.reshape(-1), minlength=num_experts).tolist()
    if tokens * top_k < num_experts * 2:
        assert (counts == 0).any()  # empty experts are exercised (their weight grads must be zero)
    (y * dy).sum().backward()
    got = [t.grad.clone() for t in (x, w, experts.gate_proj, experts.up_proj, experts.down_proj)]
    for t in (x, w, experts.gate_proj, experts.up_proj, experts.down_proj):
        t.grad = None

    y_ref = naive_experts(experts, x, idx, w)
    (y_ref * dy).sum().backward()
    want = [t.grad for t in (x, w, experts.gate_proj, experts.up_proj, experts.down_proj)]
    torch.testing.assert_close(y, y_ref)
    for name, g, r in zip(("x", "weight", "gate_proj", "up_proj", "down_proj"), got, want):
        torch.testing.assert_close(g, r, msg=lambda m, n=name: f"grad of {n}: {m}")


def test_sorted_dispatch_gradcheck():
    torch.manual_seed(2)
    experts = RoutedExperts(5, 6, 4).double()
    experts.reset_parameters(0.5)
    idx = torch.stack([torch.randperm(5)[:2] for _ in range(7)])
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    w = torch.rand(7, 2, dtype=torch.float64, requires_grad=True)
    params = {n: p.detach().clone().requires_grad_() for n, p in experts.named_parameters()}

    def fn(x, w, gp, up, dp):
        out = torch.func.functional_call(experts, {"gate_proj": gp, "up_proj": up, "down_proj": dp},
                                         (x, idx, w))
        return out[0]

    assert torch.autograd.gradcheck(fn, (x, w, params["gate_proj"], params["up_proj"], params["down_proj"]))


def test_moe_block_matches_naive_reference_including_router_grads():
    torch.manual_seed(3)
    cfg = small_moe_cfg()
    block = MoEBlock(cfg).double()
    block.reset_parameters(0.3)
    x = torch.randn(3, 7, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    y = block(x)
    (y.square().sum() + block.aux_loss + block.z_loss).backward()
    got = {n: p.grad.clone() for n, p in block.named_parameters()}
    gx = x.grad.clone()
    block.zero_grad()
    x.grad = None

    flat = x.reshape(-1, cfg.hidden_size)
    logits = flat @ block.gate.weight.T
    probs = logits.softmax(-1)
    w, idx = probs.topk(cfg.num_experts_per_tok, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    y_ref = naive_experts(block.experts, flat, idx, w) + block.shared_experts(flat)
    counts = torch.bincount(idx.reshape(-1), minlength=cfg.num_experts).double()
    aux = cfg.router_aux_loss_coef * cfg.num_experts * (counts / counts.sum() * probs.mean(0)).sum()
    zl = cfg.router_z_loss_coef * torch.logsumexp(logits, -1).square().mean()
    (y_ref.square().sum() + aux + zl).backward()
    torch.testing.assert_close(y, y_ref.reshape(y.shape))
    torch.testing.assert_close(gx, x.grad)
    for n, p in block.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=lambda m, n=n: f"grad of {n}: {m}")


def test_moe_block_runs_under_bf16_autocast():
    torch.manual_seed(4)
    cfg = small_moe_cfg()
    block = MoEBlock(cfg)
    block.reset_parameters(0.3)
    x = torch.randn(2, 9, cfg.hidden_size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    assert block.aux_loss.dtype == torch.float32 and block.z_loss.dtype == torch.float32
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in block.parameters())


# ---------------------------------------------------------------------------------------------- losses
def test_balance_loss_is_alpha_under_uniform_router_probabilities():
    torch.manual_seed(5)
    cfg = small_moe_cfg(num_experts=8, router_aux_loss_coef=0.37)
    block = MoEBlock(cfg)
    block.reset_parameters(0.3)
    torch.nn.init.zeros_(block.gate.weight)  # all logits 0 -> every P_i = 1/E
    block(torch.randn(64, cfg.hidden_size))
    # alpha * E * sum_i f_i * (1/E) = alpha for any assignment fractions f (they sum to 1)
    torch.testing.assert_close(block.aux_loss, torch.tensor(0.37))
    # and with f uniform by construction too: alpha * E * E * (1/E) * (1/E) = alpha
    e, k, n = 8, 2, 16
    counts = torch.full((e,), n * k // e)
    torch.testing.assert_close(balance_loss(torch.full((n, e), 1 / e), counts, k, 0.37), torch.tensor(0.37))


def test_balance_loss_non_uniform_matches_formula():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]])
    counts = torch.tensor([2, 1, 1])  # 2 tokens x k=2
    f = [0.5, 0.25, 0.25]
    p = [0.6, 0.25, 0.15]
    want = 0.1 * 3 * sum(a * b for a, b in zip(f, p))
    torch.testing.assert_close(balance_loss(probs, counts, 2, 0.1), torch.tensor(want))


def test_z_loss_matches_independent_computation():
    torch.manual_seed(6)
    cfg = small_moe_cfg(router_z_loss_coef=0.5)
    block = MoEBlock(cfg)
    block.reset_parameters(1.0)
    x = torch.randn(30, cfg.hidden_size)
    block(x)
    logits = x.double() @ block.gate.weight.double().T
    lse = torch.log(torch.exp(logits).sum(-1))
    want = 0.5 * (lse**2).mean()
    torch.testing.assert_close(block.z_loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z_loss(logits, 0.5), want)


# ---------------------------------------------------------------------------------------------- routing warmup
def _skewed_block(warmup: int) -> MoEBlock:
    torch.manual_seed(7)
    block = MoEBlock(small_moe_cfg(num_experts=8, num_experts_per_tok=2, routing_warmup_steps=warmup))
    block.reset_parameters(0.3)
    with torch.no_grad():
        block.gate.weight[0] += 5.0  # without noise, expert 0 would win almost every token
    return block


def test_routing_warmup_at_step_zero_gives_near_uniform_load():
    block = _skewed_block(warmup=100).train()
    block.set_step(0)
    x = torch.randn(4096, block.gate.in_features).abs()
    block(x)
    load = block.last_expert_load.double()
    mean = load.mean()
    assert ((load - mean).abs() / mean).max() < 0.15, load.tolist()
    # the same weights without warmup are badly skewed
    skewed = _skewed_block(warmup=0).train()
    skewed(x)
    assert skewed.last_expert_load[0] == 4096


def test_routing_warmup_alpha_reaches_one_at_step_w_and_eval_has_no_noise():
    x = torch.randn(64, 16)
    plain = _skewed_block(warmup=0).train()
    y_plain = plain(x)
    warm = _skewed_block(warmup=10).train()
    warm.load_state_dict(plain.state_dict())
    warm.set_step(10)
    assert warm.warmup_alpha() == 1.0
    torch.testing.assert_close(warm(x), y_plain)
    warm.set_step(5)
    assert warm.warmup_alpha() == 0.5
    assert not torch.allclose(warm(x), y_plain)  # noise in train mode before W
    warm.eval()
    torch.testing.assert_close(warm(x), plain.eval()(x))  # no noise in eval mode


def test_routing_warmup_running_stats_fold_in_at_set_step():
    block = _skewed_block(warmup=10).train()
    x = torch.randn(256, 16)
    block(x)
    assert block.logit_mean.item() == 0.0 and block.logit_std.item() == 1.0  # not during forward
    logits = block.gate(x)
    block.set_step(1)
    torch.testing.assert_close(block.logit_mean, 0.01 * logits.mean().detach())
    torch.testing.assert_close(block.logit_std, 0.99 + 0.01 * logits.std().detach())
    block.set_step(2)  # nothing new to fold
    torch.testing.assert_close(block.logit_mean, 0.01 * logits.mean().detach())


def test_set_step_propagates_to_every_moe_block():
    model = CausalLM(tiny(routing_warmup_steps=4))
    model.set_step(3)
    blocks = model.moe_blocks()
    assert len(blocks) == 3 and all(b.step == 3 and b.warmup_alpha() == 0.75 for b in blocks)


# ---------------------------------------------------------------------------------------------- NormHead
def test_norm_head_unit_columns_and_no_gradient_through_norm():
    torch.manual_seed(8)
    head = NormHead(hidden_size=6, vocab_size=11)
    head.reset_parameters(0.5)
    wn = head.normalized_weight()
    torch.testing.assert_close(wn.norm(dim=0), torch.ones(6))
    h = torch.randn(5, 6)
    g = torch.randn(5, 11)
    (head(h) * g).sum().backward()
    norm = head.weight.detach().norm(dim=0, keepdim=True) + head.eps  # treated as a constant
    analytic = (g.T @ h) / norm
    torch.testing.assert_close(head.weight.grad, analytic)


# ---------------------------------------------------------------------------------------------- attention
def _rope_reference(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Independent rotate-half RoPE: pair (i, i + d/2) rotated by pos * theta^(-2i/d)."""
    b, nh, t, d = x.shape
    out = torch.empty_like(x)
    for i in range(d // 2):
        ang = torch.arange(t, dtype=torch.float64) * theta ** (-2 * i / d)
        c, s = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
        x1, x2 = x[..., i], x[..., i + d // 2]
        out[..., i] = x1 * c - x2 * s
        out[..., i + d // 2] = x2 * c + x1 * s
    return out


def test_gqa_fused_qkv_row_order_rope_and_causality():
    torch.manual_seed(9)
    cfg = tiny(hidden_size=24, num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    attn = Attention(cfg).double()
    torch.nn.init.normal_(attn.query_key_value.weight, std=0.3)
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    nq, nkv, hd = 6, 2, 8
    wqkv = attn.query_key_value.weight
    wq, wk, wv = wqkv[: nq * hd], wqkv[nq * hd:(nq + nkv) * hd], wqkv[(nq + nkv) * hd:]
    assert wv.shape[0] == nkv * hd
    q = (x @ wq.T).view(2, 5, nq, hd).transpose(1, 2)
    k = (x @ wk.T).view(2, 5, nkv, hd).transpose(1, 2)
    v = (x @ wv.T).view(2, 5, nkv, hd).transpose(1, 2)
    q, k = _rope_reference(q, cfg.rope_theta), _rope_reference(k, cfg.rope_theta)
    group = nq // nkv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # q head h uses kv h // group
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, nq * hd)
    torch.testing.assert_close(attn(x), out @ attn.dense.weight.T)


# ---------------------------------------------------------------------------------------------- model
def test_causal_lm_forward_backward_tiny():
    torch.manual_seed(10)
    cfg = tiny()
    model = CausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    out = model(ids, labels)
    assert out.logits.shape == (2, 32, cfg.vocab_size)
    assert torch.isfinite(out.loss)
    assert abs(out.ce_loss.item() - math.log(cfg.vocab_size)) < 0.5
    torch.testing.assert_close(out.loss, out.ce_loss + out.aux_loss + out.z_loss)
    assert out.aux_loss > 0 and out.z_loss > 0
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing
    loads = model.expert_load()
    assert len(loads) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert all(int(ld.sum()) == 2 * 32 * cfg.num_experts_per_tok for ld in loads)
    assert model(ids).loss is None


def test_causal_lm_module_layout_and_hooks_fire():
    model = CausalLM(tiny())
    names = {n for n, _ in model.named_parameters()}
    for n in ("word_embeddings.weight", "layers.0.attention.query_key_value.weight",
              "layers.0.attention.dense.weight", "layers.0.mlp.gate_proj.weight",
              "layers.1.mlp.gate.weight", "layers.1.mlp.experts.gate_proj",
              "layers.1.mlp.shared_experts.up_proj.weight", "layers.1.input_layernorm.weight",
              "layers.1.post_attention_layernorm.weight", "norm.weight", "lm_head.weight"):
        assert n in names, n
    assert model.layers[1].mlp.experts.down_proj.shape == (8, 128, 128)
    fired = []
    units = [model.word_embeddings, *model.layers, model.norm, model.lm_head]
    for i, m in enumerate(units):
        m.register_forward_pre_hook(lambda mod, args, i=i: fired.append(i))
    model(torch.randint(0, 320, (1, 8)))
    assert fired == list(range(len(units)))


def test_dense_only_model_has_zero_router_losses():
    model = CausalLM(tiny(num_experts=0, norm_head=False))
    ids = torch.randint(0, 320, (2, 8))
    out = model(ids, ids)
    assert out.aux_loss.item() == 0.0 and out.z_loss.item() == 0.0
    assert model.expert_load() == []
    assert isinstance(model.lm_head, torch.nn.Linear)


def test_tied_embeddings_share_one_tensor_and_count_once():
    cfg = tiny(tie_word_embeddings=True)
    model = CausalLM(cfg)
    assert model.lm_head.weight is model.word_embeddings.weight
    untied = count_params(tiny())["total_params"]
    assert count_params(cfg)["total_params"] == untied - cfg.vocab_size * cfg.hidden_size


def test_reset_parameters_deterministic_and_meta_safe():
    torch.manual_seed(11)
    a = CausalLM(tiny())
    torch.manual_seed(11)
    b = CausalLM(tiny())
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n
    assert torch.all(a.norm.weight == 1)
    std = a.layers[1].mlp.experts.gate_proj.std().item()
    assert abs(std - 0.02) < 0.002
    with torch.device("meta"):
        m = CausalLM(tiny(routing_warmup_steps=5))
    m.to_empty(device="cpu")
    m.reset_parameters()
    blk = m.moe_blocks()[0]
    assert blk.logit_mean.item() == 0.0 and blk.logit_std.item() == 1.0
    assert torch.all(m.layers[0].input_layernorm.weight == 1)
    assert torch.isfinite(m(torch.randint(0, 320, (1, 4))).logits).all()


def test_causal_lm_bf16_autocast():
    torch.manual_seed(12)
    model = CausalLM(tiny())
    ids = torch.randint(0, 320, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, ids)
    assert out.ce_loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()


# ---------------------------------------------------------------------------------------------- presets
def test_every_preset_builds_on_meta_and_counts():
    names = available_presets()
    assert {"tiny", "small", "ling_lite", "ling_plus"} <= set(names)
    for name in names:
        cfg = load_preset(name)
        with torch.device("meta"):
            model = CausalLM(cfg)
        assert all(p.is_meta for p in model.parameters())
        counts = count_params(cfg)
        assert 0 < counts["active_params"] < counts["total_params"], name


def test_count_params_tiny_matches_real_model():
    cfg = load_preset("tiny")
    counts = count_params(cfg)
    real = CausalLM(cfg)
    assert counts["total_params"] == sum(p.numel() for p in real.parameters())
    assert 1_000_000 <= counts["total_params"] <= 3_000_000
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    inactive = moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    assert counts["active_params"] == counts["total_params"] - inactive


def test_ling_presets_match_published_sizes():
    lite = count_params(load_preset("ling_lite"))
    assert abs(lite["total_params"] / 1e9 - 16.8) < 0.1 and abs(lite["active_params"] / 1e9 - 2.75) < 0.05
    plus = count_params(load_preset("ling_plus"))
    assert abs(plus["total_params"] / 1e9 - 290) < 3 and abs(plus["active_params"] / 1e9 - 28.8) < 0.5


def test_unknown_preset_lists_available():
    with pytest.raises(ValueError, match="tiny"):
        load_preset("nope")


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(13)
    model = CausalLM(tiny(num_hidden_layers=2, routing_warmup_steps=3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 320, (4, 16))
    losses = []
    for step in range(12):
        model.set_step(step)
        out = model(ids, ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.ce_loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    model.eval()
    with torch.inference_mode():
        assert torch.isfinite(model(ids).logits).all()
