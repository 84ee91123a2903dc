"""A Ling 2.0 checkpoint in the public BailingMoeV2ForCausalLM layout: imported, trained, exported back."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from edit_train.model import CausalLM, load_preset
from edit_train.model.config import ModelConfig
from edit_train.model.hf import TRAINED_HEAD_KEY, from_hf_config
from edit_train.model.hf_io import export_hf, load_hf_into, read_hf_weights


@pytest.fixture(autouse=True)
def _one_thread(torch_one_thread):
    """Two shared cores: one torch thread (see conftest)."""


def public_checkpoint(directory: Path, cfg: ModelConfig, seed: int = 0, extras: bool = False) -> dict:
    """Random weights written as Ling 2.0's checkpoints are: per-expert ``nn.Linear`` weights, the router's fp32
    ``expert_bias``, the MTP layer at ``model.layers.{num_hidden_layers}``; a config.json with the public keys
    (model_type bailing_moe, no edit-train key). ``extras``: the MTP layer also carries copies of the shared
    embedding / head, as some public checkpoints do."""
    g = torch.Generator().manual_seed(seed)
    h, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    nq, nkv, e, m = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_experts, cfg.moe_intermediate_size
    t: dict[str, torch.Tensor] = {}

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    t["model.word_embeddings.weight"] = w(v, h)
    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "attention.query_key_value.weight"] = w((nq + 2 * nkv) * hd, h)
        t[p + "attention.query_layernorm.weight"] = norm(hd)
        t[p + "attention.key_layernorm.weight"] = norm(hd)
        t[p + "attention.dense.weight"] = w(h, nq * hd)
        if i < cfg.first_k_dense_replace:
            for name, shape in (("gate_proj", (cfg.intermediate_size, h)), ("up_proj", (cfg.intermediate_size, h)),
                                ("down_proj", (h, cfg.intermediate_size))):
                t[p + f"mlp.{name}.weight"] = w(*shape)
            continue
        t[p + "mlp.gate.weight"] = w(e, h)
        t[p + "mlp.gate.expert_bias"] = 0.02 * torch.randn(e, generator=g)
        for x in range(e):
            t[p + f"mlp.experts.{x}.gate_proj.weight"] = w(m, h)
            t[p + f"mlp.experts.{x}.up_proj.weight"] = w(m, h)
            t[p + f"mlp.experts.{x}.down_proj.weight"] = w(h, m)
        for name, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
            t[p + f"mlp.shared_experts.{name}.weight"] = w(*shape)
        if i >= cfg.num_hidden_layers:
            t[p + "enorm.weight"], t[p + "hnorm.weight"] = norm(h), norm(h)
            t[p + "final_layernorm.weight"] = norm(h)
            t[p + "eh_proj.weight"] = w(h, 2 * h)
            if extras:
                t[p + "shared_head.head.weight"] = w(v, h)
                t[p + "embed_tokens.weight"] = w(v, h)
    t["model.norm.weight"] = norm(h)
    t["lm_head.weight"] = w(v, h)
    raw = {"architectures": ["BailingMoeV2ForCausalLM"], "model_type": "bailing_moe",
           "auto_map": {"AutoConfig": "configuration_bailing_moe_v2.BailingMoeV2Config"},
           "vocab_size": v, "hidden_size": h, "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": nq, "num_key_value_heads": nkv,
           "head_dim": hd, "hidden_act": "silu", "use_qkv_bias": False, "use_bias": False,
           "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": False, "embedding_dropout": 0.0,
           "attention_dropout": 0.0, "output_dropout": 0.0, "initializer_range": 0.02,
           "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
           "use_cache": True, "max_window_layers": cfg.num_hidden_layers, "rope_scaling": None,
           "pad_token_id": 0, "eos_token_id": 1, "num_experts": e, "num_shared_experts": 1,
           "num_experts_per_tok": cfg.num_experts_per_tok, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
           "moe_intermediate_size": m, "moe_shared_expert_intermediate_size": m,
           "first_k_dense_replace": cfg.first_k_dense_replace, "output_router_logits": False,
           "use_qk_norm": True, "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
           "mtp_loss_scaling_factor": 0, "moe_router_enable_expert_bias": True,
           "routed_scaling_factor": cfg.routed_scaling_factor, "partial_rotary_factor": cfg.partial_rotary_factor,
           "score_function": "sigmoid", "norm_topk_prob": True, "router_dtype": "fp32", "torch_dtype": "float32"}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(t, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw))
    return t


def test_public_config_reads_as_the_preset():
    cfg = load_preset("tiny_v2")
    raw = json.loads(json.dumps({"architectures": ["BailingMoeV2ForCausalLM"], "model_type": "bailing_moe",
                                 "vocab_size": 320, "hidden_size": 128, "num_hidden_layers": 4}))
    read = from_hf_config({**raw, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                           "intermediate_size": 384, "moe_intermediate_size": 48, "num_experts": 32})
    # absent V2 keys mean BailingMoeV2Config's defaults: sigmoid, expert bias, 8 groups of which 4, scaling 2.5,
    # QK-norm, half RoPE
    assert (read.score_function, read.moe_router_enable_expert_bias, read.n_group, read.topk_group,
            read.routed_scaling_factor, read.use_qk_norm, read.partial_rotary_factor) == \
        ("sigmoid", True, 8, 4, 2.5, True, 0.5)
    assert cfg.score_function == read.score_function


def test_untrained_import_exports_back_bit_identically(tmp_path):
    cfg = dataclasses.replace(load_preset("tiny_v2"), rms_norm_eps=1e-6)
    src = tmp_path / "public"
    written = public_checkpoint(src, cfg)
    model = CausalLM(cfg)
    load_hf_into(model, src)
    assert model.layers[1].mlp.gate.expert_bias.dtype == torch.float32
    torch.testing.assert_close(model.layers[1].mlp.gate.expert_bias, written["model.layers.1.mlp.gate.expert_bias"],
                               rtol=0, atol=0)
    out = export_hf(model, None, tmp_path / "out")
    back, _ = read_hf_weights(out)
    assert sorted(back) == sorted(written)
    assert [k for k in written if not torch.equal(back[k], written[k])] == []
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["BailingMoeV2ForCausalLM"] and raw["model_type"] == "bailing_moe"
    for key in ("score_function", "moe_router_enable_expert_bias", "n_group", "topk_group", "routed_scaling_factor",
                "use_qk_norm", "partial_rotary_factor", "num_nextn_predict_layers", "rope_scaling", "num_experts",
                "num_shared_experts", "norm_topk_prob", "router_dtype"):
        assert key in raw, key  # an engine reads each without a default
    assert None not in (raw[k] for k in ("num_experts", "num_shared_experts", "n_group", "topk_group",
                                         "routed_scaling_factor", "partial_rotary_factor", "num_nextn_predict_layers"))
    text = (out / "config.json").read_text()
    assert str(tmp_path) not in text and "/home/" not in text and "/work/" not in text  # names no host path
    assert raw[TRAINED_HEAD_KEY] == {"norm_head": False, "tie_word_embeddings": False}
    # and our logits after the round trip are the same
    again = CausalLM(cfg)
    load_hf_into(again, out)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model.eval(), again.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_mtp_copies_of_the_shared_head_are_ignored(tmp_path):
    cfg = load_preset("tiny_v2")
    written = public_checkpoint(tmp_path / "p", cfg, extras=True)
    model = CausalLM(cfg)
    load_hf_into(model, tmp_path / "p")
    assert torch.equal(model.lm_head.weight, written["lm_head.weight"])


def test_import_refuses_a_mismatched_router(tmp_path):
    cfg = load_preset("tiny_v2")
    public_checkpoint(tmp_path / "p", cfg)
    model = CausalLM(dataclasses.replace(cfg, n_group=4, topk_group=2))
    with pytest.raises(ValueError, match="n_group=8 there but model.n_group=4"):
        load_hf_into(model, tmp_path / "p")


@pytest.mark.slow
def test_imported_checkpoint_trains_20_steps_on_two_clusters_and_exports(tmp_path):
    """`edit-train model=tiny_v2 model.init_from=<public checkpoint>`: the default demo (2 clusters, A-EDiT) for 20
    steps, then `edit-train-export` writes a BailingMoeV2 directory whose biases moved (the clusters' mean)."""
    cfg = load_preset("tiny_v2")
    written = public_checkpoint(tmp_path / "public", cfg)
    run = tmp_path / "run"
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "edit_train.cli.train", "model=tiny_v2", f"model.init_from={tmp_path / 'public'}",
           "train.steps=20", f"run.dir={run}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("mtp_loss" in e for e in events if e.get("event") == "moe")
    val = [e["val_loss"] for e in events if e.get("event") == "eval"]
    assert val[-1] < val[0]
    out = tmp_path / "hf"
    exp = subprocess.run([sys.executable, "-m", "edit_train.cli.export", str(run), "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert exp.returncode == 0, exp.stderr[-3000:]
    back, _ = read_hf_weights(out)
    assert sorted(back) == sorted(written)
    bias = back["model.layers.1.mlp.gate.expert_bias"]
    assert not torch.equal(bias, written["model.layers.1.mlp.gate.expert_bias"])  # the bias was updated
