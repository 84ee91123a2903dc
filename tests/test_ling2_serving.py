"""Issue 67: a Ling 2.0 (BailingMoeV2) export is served the same way by SGLang, transformers and Ling-V2's public code.

As ``tests/test_serving.py`` does for Ling 1, each consumer's reading of an export is emulated on CPU in torch from
its model code — the config keys it reads (an attribute read with no default fails as it would there), its weight
mapping, its routing — written for edit-train from reading these revisions (not copied):

* SGLang  sgl-project/sglang ``python/sglang/srt/models/bailing_moe.py`` @ 008d83eb618762df4209eaa4390ea016a705f56e
  (``BailingMoEGate`` with ``expert_bias`` when ``moe_router_enable_expert_bias``, ``TopK`` grouped when ``n_group``
  / ``topk_group`` > 0 with the bias as correction bias, ``renormalize=norm_topk_prob``, ``routed_scaling_factor``;
  QK-norm per head; ``rotary_dim = int(head_dim * partial_rotary_factor)``) and its MTP reading
  ``bailing_moe_nextn.py`` @ d1575d178d746fe4ca53d5d5f9e73689713b4807 (``model.layers.{num_hidden_layers}``:
  ``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_layernorm`` its own, the rest its decoder block; embeddings and
  head the target model's; input the target's final hidden state and the next token's embedding).
* vLLM    vllm-project/vllm  ``vllm/model_executor/models/bailing_moe.py`` @ 3a04cf8f14c971435137c3ec572a7803c663673d
  (grouped top-k whenever ``n_group`` and ``topk_group`` are not None, ``scoring_func=score_function`` with the
  bias as ``e_score_correction_bias``, ``renormalize=norm_topk_prob``, the output times ``routed_scaling_factor``;
  QK-norm an RMSNorm only when ``use_rmsnorm`` says so, else an ``nn.LayerNorm`` with a bias no export holds;
  ``rotary_dim`` from ``partial_rotary_factor``). It has no MTP reading of its own here.
* Ling-V2 inclusionAI/Ling-V2 ``models/modeling_bailing_moe_v2.py`` @ efee9bb7bc1c357f4098b45e06f0a2222389a16d (the
  public reference: renormalises any top-k > 1 whatever ``norm_topk_prob`` says, ``+1e-20``; group score = sum of
  a group's two best biased scores). It builds ``num_hidden_layers`` layers of which the last
  ``num_nextn_predict_layers`` are MTP layers, where SGLang and llama.cpp put the MTP layer *after*
  ``num_hidden_layers`` main layers (``model.layers.{num_hidden_layers}``) — the layout an export follows: the
  reference reads only exports without MTP layers the same way (a test pins the difference).

Our logits = a re-import = transformers through the shipped modeling file (``trust_remote_code``) = SGLang's reading
= vLLM's = (without MTP) the reference's, fp32 within 1e-5 and the same argmax, on every variant; the MTP layer's
t+2 logits equal SGLang's nextn reading.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from edit_train.model import CausalLM, ModelConfig, load_preset  # noqa: E402
from edit_train.model.hf_io import export_hf, load_hf_into, read_hf_weights  # noqa: E402

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")


@pytest.fixture(autouse=True)
def _one_thread(torch_one_thread):
    """Two shared cores: one torch thread (see conftest)."""


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


Route = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def sglang_route(config: Any) -> Route:
    """SGLang's TopK for BailingMoE: grouped (biased_grouped_topk) when n_group / topk_group > 0, sigmoid scores
    with the correction bias, renormalize=norm_topk_prob, times routed_scaling_factor."""
    n_group, topk_group = getattr(config, "n_group", 0), getattr(config, "topk_group", 0)
    score = getattr(config, "score_function", None)
    scale = getattr(config, "routed_scaling_factor", 1.0)
    k = config.num_experts_per_tok

    def route(logits, bias):
        assert (score == "softmax" and bias is None) or (score == "sigmoid" and bias is not None)  # SGLang's assert
        assert n_group > 0 and 0 < topk_group <= n_group  # sigmoid + bias is routed grouped only
        s = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, -1)
        choice = s + bias if bias is not None else s
        n, e = choice.shape
        gs = choice.view(n, n_group, -1).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(keep.repeat_interleave(e // n_group, 1) == 0, float("-inf"))
        idx = choice.topk(k, dim=-1).indices
        w = s.gather(1, idx)
        if config.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w * scale, idx
    return route


def reference_route(config: Any) -> Route:
    """Ling-V2's BailingMoeV2Gate: sigmoid, scores + expert_bias, group_limited_topk, weights renormalised for any
    top-k > 1 (+1e-20), times routed_scaling_factor."""
    k = config.num_experts_per_tok

    def route(logits, bias):
        s = torch.sigmoid(logits)
        choice = s + bias
        n, e = choice.shape
        gs = choice.view(n, config.n_group, -1).topk(2, dim=-1).values.sum(-1)
        mask = torch.zeros_like(gs).scatter_(1, torch.topk(gs, config.topk_group, dim=-1, sorted=False)[1], 1)
        masked = choice.masked_fill(~mask.unsqueeze(-1).expand(n, config.n_group, e // config.n_group)
                                    .reshape(n, -1).bool(), float("-inf"))
        idx = torch.topk(masked, k, dim=-1)[1]
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if k > 1 else w
        return w * config.routed_scaling_factor, idx
    return route


class Reading:
    """One consumer's model built from an export's tensors: the decoder stack ``main`` layers deep."""

    def __init__(self, config: Any, w: Mapping[str, torch.Tensor], route: Route, main: int,
                 shared_width: int) -> None:
        self.c, self.w, self.route, self.main, self.shared_width = config, w, route, main, shared_width
        self.hd = config.head_dim or config.hidden_size // config.num_attention_heads
        self.rd = int(self.hd * getattr(config, "partial_rotary_factor", 1.0))
        tied = config.tie_word_embeddings
        self.head = w["model.word_embeddings.weight"] if tied else w["lm_head.weight"]

    def block(self, pre: str, h: torch.Tensor) -> torch.Tensor:
        c, w, hd, rd = self.c, self.w, self.hd, self.rd
        b, t, _ = h.shape
        nq, nkv = c.num_attention_heads, c.num_key_value_heads
        x = rms(h, w[pre + "input_layernorm.weight"], c.rms_norm_eps)
        qkv = F.linear(x, w[pre + "attention.query_key_value.weight"]).view(b, t, nq + 2 * nkv, hd)
        q, k, v = qkv.split([nq, nkv, nkv], dim=2)
        if getattr(c, "use_qk_norm", False):
            q = rms(q, w[pre + "attention.query_layernorm.weight"], c.rms_norm_eps)
            k = rms(k, w[pre + "attention.key_layernorm.weight"], c.rms_norm_eps)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]

        def rope(z):
            r, rest = z[..., :rd], z[..., rd:]
            r1, r2 = r[..., :rd // 2], r[..., rd // 2:]
            return torch.cat((r * cos + torch.cat((-r2, r1), -1) * sin, rest), -1)

        q, k = rope(q).transpose(1, 2), rope(k).transpose(1, 2)
        v = v.transpose(1, 2)
        k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
        att = torch.softmax(q @ k.transpose(2, 3) / hd ** 0.5 + torch.full((t, t), float("-inf")).triu(1), -1) @ v
        h = h + F.linear(att.transpose(1, 2).reshape(b, t, nq * hd), w[pre + "attention.dense.weight"])
        x = rms(h, w[pre + "post_attention_layernorm.weight"], c.rms_norm_eps).reshape(b * t, -1)
        if pre + "mlp.gate.weight" not in w:
            y = mlp(x, w[pre + "mlp.gate_proj.weight"], w[pre + "mlp.up_proj.weight"], w[pre + "mlp.down_proj.weight"])
        else:
            weight, idx = self.route(F.linear(x, w[pre + "mlp.gate.weight"]), w.get(pre + "mlp.gate.expert_bias"))
            y = torch.zeros_like(x)
            for n in range(x.shape[0]):
                for j in range(idx.shape[1]):
                    e = f"{pre}mlp.experts.{int(idx[n, j])}."
                    y[n] += weight[n, j] * mlp(x[n], w[e + "gate_proj.weight"], w[e + "up_proj.weight"],
                                               w[e + "down_proj.weight"])
            if c.num_shared_experts:
                s = pre + "mlp.shared_experts."
                assert w[s + "gate_proj.weight"].shape[0] == self.shared_width
                y = y + mlp(x, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"])
        return h + y.view(b, t, -1)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.w["model.word_embeddings.weight"][ids]
        for i in range(self.main):
            h = self.block(f"model.layers.{i}.", h)
        return rms(h, self.w["model.norm.weight"], self.c.rms_norm_eps)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hidden(ids) @ self.head.T

    def nextn_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """SGLang's NextN draft step on a prefill: position t takes the target's hidden state at t and the embedding
        of token t+1 (the ids shifted left; the last position's next token is 0, as in the reference's roll)."""
        c, w, pre = self.c, self.w, f"model.layers.{c_layers(self.c)}."
        nxt = torch.cat((ids[:, 1:], torch.zeros_like(ids[:, :1])), dim=1)
        e = rms(w["model.word_embeddings.weight"][nxt], w[pre + "enorm.weight"], c.rms_norm_eps)
        h = rms(self.hidden(ids), w[pre + "hnorm.weight"], c.rms_norm_eps)
        z = self.block(pre, F.linear(torch.cat((e, h), -1), w[pre + "eh_proj.weight"]))
        return rms(z, w[pre + "final_layernorm.weight"], c.rms_norm_eps) @ self.head.T


def c_layers(config: Any) -> int:
    return config.num_hidden_layers


def sglang_read(config: Any, w: Mapping[str, torch.Tensor]) -> Reading:
    shared = getattr(config, "moe_shared_expert_intermediate_size", config.moe_intermediate_size)
    return Reading(config, w, sglang_route(config), config.num_hidden_layers, shared * config.num_shared_experts)


def vllm_read(config: Any, w: Mapping[str, torch.Tensor]) -> Reading:
    n_group, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    assert n_group is not None and topk_group is not None  # else vLLM routes ungrouped: softmax-style fused top-k
    if getattr(config, "use_qk_norm", False):
        assert getattr(config, "use_rmsnorm", False), "vLLM would build nn.LayerNorm QK-norms (with biases)"
    shared = getattr(config, "moe_shared_expert_intermediate_size", config.moe_intermediate_size)
    rotary = getattr(config, "rotary_dim", None)
    assert rotary is None  # vLLM's get_rope(rotary_dim=head_dim, partial_rotary_factor=...): the factor decides
    return Reading(config, w, sglang_route(config), config.num_hidden_layers, shared * config.num_shared_experts)


def reference_read(config: Any, w: Mapping[str, torch.Tensor]) -> Reading:
    main = config.num_hidden_layers - config.num_nextn_predict_layers  # its layer list counts the MTP layers
    return Reading(config, w, reference_route(config), main, config.moe_intermediate_size * config.num_shared_experts)


VARIANTS: dict[str, dict[str, Any]] = {
    "groups_mtp": {},
    "no_groups": {"n_group": 0, "topk_group": 0, "num_nextn_predict_layers": 0},
    "groups_no_mtp": {"num_nextn_predict_layers": 0},
    "tied": {"tie_word_embeddings": True, "num_nextn_predict_layers": 0},
    "full_rope_no_qk_norm": {"partial_rotary_factor": 1.0, "use_qk_norm": False},
    "norm_head_trained": {"norm_head": True},
    "bf16_sharded": {},
}


def _model(variant: str) -> tuple[CausalLM, ModelConfig]:
    cfg = dataclasses.replace(load_preset("tiny_v2"), num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                              num_hidden_layers=3, rope_theta=5e4, **VARIANTS[variant])
    torch.manual_seed(7)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for block in model.moe_blocks():  # a trained bias: it must change some choices
            block.gate.expert_bias.normal_(0, 0.05)
        for n, p in model.named_parameters():
            if n.endswith("layernorm.weight") or n.endswith("norm.weight"):
                p.uniform_(0.7, 1.3)
    return model, cfg


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_reading_gives_our_logits(tmp_path, variant):
    model, cfg = _model(variant)
    bf16 = variant == "bf16_sharded"
    out = export_hf(model, None, tmp_path / "hf", dtype=torch.bfloat16 if bf16 else torch.float32,
                    max_shard_size="200KB" if bf16 else "5GB")
    if bf16:
        assert (out / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    again = CausalLM(cfg).eval()
    load_hf_into(again, out)  # bf16: the stored weights, which every reader below reads too
    with torch.no_grad():
        ours = (again if bf16 else model)(ids).logits
        if not bf16:  # bit for bit, but for a trained norm_head (served normalised, normalised again on load)
            torch.testing.assert_close(again(ids).logits, ours, rtol=0, atol=1e-5 if cfg.norm_head else 0)
    config = transformers.AutoConfig.from_pretrained(str(out), trust_remote_code=True)
    weights = {k: v.to(torch.float32) for k, v in read_hf_weights(out)[0].items()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        readings = {"transformers": hf(ids).logits, "sglang": sglang_read(config, weights).logits(ids),
                    "vllm": vllm_read(config, weights).logits(ids)}
        if cfg.num_nextn_predict_layers == 0:
            readings["reference"] = reference_read(config, weights).logits(ids)
    for who, got in readings.items():
        torch.testing.assert_close(got, ours, rtol=0, atol=1e-5, msg=lambda m, who=who: f"{who}: {m}")
        assert torch.equal(got.argmax(-1), ours.argmax(-1)), who
    if cfg.num_nextn_predict_layers:
        with torch.no_grad():
            mtp = (again if bf16 else model)(ids).mtp_logits[0]
            torch.testing.assert_close(sglang_read(config, weights).nextn_logits(ids), mtp, rtol=0, atol=1e-5)


def test_the_bias_changes_what_is_served(tmp_path):
    """The served bias is the trained one: zeroing it in the file changes SGLang's logits (it chooses experts)."""
    model, cfg = _model("groups_no_mtp")
    out = export_hf(model, None, tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(str(out), trust_remote_code=True)
    weights = read_hf_weights(out)[0]
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    zeroed = {k: (torch.zeros_like(v) if k.endswith("expert_bias") else v) for k, v in weights.items()}
    with torch.no_grad():
        assert not torch.allclose(sglang_read(config, weights).logits(ids), sglang_read(config, zeroed).logits(ids))


def test_the_reference_counts_the_mtp_layer_among_num_hidden_layers(tmp_path):
    """Ling-V2's public modeling code makes the last of num_hidden_layers the MTP layer; the engines (and the export)
    put it after them. On an export with an MTP layer the reference therefore runs one main layer fewer."""
    model, cfg = _model("groups_mtp")
    out = export_hf(model, None, tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(str(out), trust_remote_code=True)
    assert config.num_hidden_layers == cfg.num_hidden_layers  # the main layers, as SGLang and llama.cpp read it
    assert reference_read(config, read_hf_weights(out)[0]).main == cfg.num_hidden_layers - 1
