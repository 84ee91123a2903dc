"""The Ling 2.0 presets hold the public configs' values, and their counts are the model cards'."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edit_train.model.presets import count_params, load_preset

# BailingMoeV2 config.json values (inclusionAI/Ling-mini-2.0, Ling-flash-2.0, Ling-1T) and Ling-V2's Megatron
# pretraining flags for Ling-mini-2.0 (expert-bias update rate 1e-3 with a zero-mean update, z-loss 3.5e-6, one MTP
# layer with loss scale 0.1). Written out here so that a preset edit must change this file too.
COMMON = dict(vocab_size=157184, head_dim=128, num_experts=256, num_shared_experts=1, num_experts_per_tok=8,
              norm_topk_prob=True, rope_theta=600000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
              tie_word_embeddings=False, score_function="sigmoid", moe_router_enable_expert_bias=True,
              moe_router_bias_update_rate=1e-3, moe_router_bias_update_zero_mean=True, n_group=8, topk_group=4,
              routed_scaling_factor=2.5, use_qk_norm=True, partial_rotary_factor=0.5, num_nextn_predict_layers=1,
              mtp_loss_scaling_factor=0.1, router_z_loss_coef=3.5e-6, norm_head=False)
PUBLISHED = {
    "ling_mini_2": dict(COMMON, hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4,
                        moe_intermediate_size=512, intermediate_size=5120, first_k_dense_replace=1),
    "ling_flash_2": dict(COMMON, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=4, moe_intermediate_size=1024, intermediate_size=9216,
                         first_k_dense_replace=1),
    "ling_1t": dict(COMMON, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                    moe_intermediate_size=2048, intermediate_size=18432, first_k_dense_replace=4),
}
# model cards: (total, active, non-embedding active, tolerance); the counts leave the MTP layer out, as the cards do.
# Ling-flash-2.0's card rounds its total to "100B": the published checkpoint holds 102,889,697,280 bf16 parameters
# (the Hugging Face hub's safetensors metadata for inclusionAI/Ling-flash-2.0, which also lists 7,936 fp32 values:
# the expert bias of 31 MoE layers × 256 experts), held to the unit below, so the card's rounded total is held to
# 3 %; Ling-1T's "about 50B" active is 51.05B with the embeddings, 48.5B without.
PUBLISHED_CHECKPOINT = {"ling_flash_2": (102_889_697_280, 7_936)}  # (bf16 parameters, fp32 expert-bias values)
CARDS = {
    "ling_mini_2": ((16.26e9, 0.02), (1.43e9, 0.02), (789e6, 0.02)),
    "ling_flash_2": ((100e9, 0.03), (6.1e9, 0.02), (4.8e9, 0.02)),
    "ling_1t": ((1e12, 0.02), (50e9, 0.025), None),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_published_field(name):
    cfg = load_preset(name)
    for field, value in PUBLISHED[name].items():
        assert getattr(cfg, field) == value, f"{name}.{field}"


@pytest.mark.parametrize("name", sorted(CARDS))
def test_counts_match_the_model_cards(name):
    c = count_params(load_preset(name))
    got = (c["total_params"] - c["mtp_params"], c["active_params"] - c["mtp_active_params"],
           c["non_embedding_active_params"] - c["mtp_active_params"])
    for value, card in zip(got, CARDS[name]):
        if card is not None:
            want, tol = card
            assert abs(value / want - 1) <= tol, (name, value, want)


@pytest.mark.parametrize("name", sorted(PUBLISHED_CHECKPOINT))
def test_counts_equal_the_published_checkpoint(name):
    """The published checkpoint has no MTP layer: its parameters are the model's without it, to the unit, and its
    fp32 values are one expert bias per MoE layer — which only the published widths give."""
    cfg = load_preset(name)
    c = count_params(cfg)
    params, bias = PUBLISHED_CHECKPOINT[name]
    assert c["total_params"] - c["mtp_params"] == params
    assert (cfg.num_hidden_layers - cfg.first_k_dense_replace) * cfg.num_experts == bias


def test_mini_counts_to_the_last_digit():
    """Ling-mini-2.0 by hand: embeddings + head, 20 attention blocks, 1 dense FFN, 19 MoE layers (+ 1 MTP layer)."""
    c = count_params(load_preset("ling_mini_2"))
    h, v = 2048, 157184
    attn = (16 + 8) * 128 * h + 16 * 128 * h + 2 * 128 + 2 * h  # qkv, dense, qk-norms, the layer's two norms
    moe_all = 256 * 3 * h * 512 + 3 * h * 512 + 256 * h
    moe_active = 8 * 3 * h * 512 + 3 * h * 512 + 256 * h
    mtp_extra = 2 * h * h + 3 * h  # eh_proj, enorm, hnorm, final_layernorm
    total = 2 * v * h + 20 * attn + 3 * h * 5120 + 19 * moe_all + h + (attn + moe_all + mtp_extra)
    assert c["total_params"] == total
    assert c["mtp_params"] == attn + moe_all + mtp_extra
    assert c["active_params"] == total - 20 * (moe_all - moe_active)
    assert c["non_embedding_active_params"] == c["active_params"] - 2 * v * h


@pytest.mark.parametrize("v2,v1", [("tiny_v2", "tiny"), ("small_v2", "small")])
def test_cpu_presets_are_ling2_at_ling1_widths(v2, v1):
    a, b = load_preset(v2), load_preset(v1)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "first_k_dense_replace"):
        assert getattr(a, field) == getattr(b, field), field
    for field in ("score_function", "moe_router_enable_expert_bias", "routed_scaling_factor", "use_qk_norm",
                  "partial_rotary_factor", "num_nextn_predict_layers"):
        assert getattr(a, field) == COMMON[field], field
    ca, cb = count_params(a), count_params(b)
    main_active = ca["active_params"] - ca["mtp_active_params"]
    assert abs(main_active / cb["active_params"] - 1) <= 0.10


def test_info_prints_the_counts():
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "edit_train.cli.info", "model=ling_mini_2", "cluster.ranks=8"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["without_mtp"]["total_params"] == 16255638528
    assert info["without_mtp"]["non_embedding_active_params"] == 789142528
    assert info["mtp_params"] > 0 and info["memory_plan"]
