"""Issue 53: every export is served the same way by vLLM, SGLang, transformers and Ling's public code.

Each consumer's reading of an export is emulated here on CPU, in torch, from its model code: the config fields it
reads and their defaults (an attribute read with no default fails as it would there), the weight-name mapping its
loader applies (and what it skips), the head (normalised or not, tied or not), the routing (router dtype, softmax,
top-k, renormalisation incl. top-1, scaling), shared experts and dense layers. Written for edit-train from reading
these revisions (not copied):

* vLLM    vllm-project/vllm  ``vllm/model_executor/models/bailing_moe.py`` @ 3a04cf8f14c971435137c3ec572a7803c663673d
* SGLang  sgl-project/sglang ``python/sglang/srt/models/bailing_moe.py``  @ 008d83eb618762df4209eaa4390ea016a705f56e
* Ling    inclusionAI/Ling   ``models/modeling_bailing_moe.py``            @ 69823a612234167c8e2df7cc1439839da226667d
  (the public reference; its config defaults are ``edit_train.model.hf.BAILING_DEFAULTS``)

Every preset variant is exported and read by each: our logits = the transformers route (the shipped modeling file,
``trust_remote_code``) = the reference = each engine's reading, within 1e-5 (fp32) and the same argmax everywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from edit_train.model import CausalLM, ModelConfig, load_preset  # noqa: E402
from edit_train.model.hf import BAILING_DEFAULTS, CONFIG_NAME, TRAINED_HEAD_KEY  # noqa: E402
from edit_train.model.hf_io import export_hf, load_hf_into, read_hf_weights  # noqa: E402

VLLM_REV = "3a04cf8f14c971435137c3ec572a7803c663673d"
SGLANG_REV = "008d83eb618762df4209eaa4390ea016a705f56e"
LING_REV = "69823a612234167c8e2df7cc1439839da226667d"


@pytest.fixture(autouse=True)
def _one_thread(torch_one_thread):
    """Two shared cores: one torch thread (see conftest)."""


# ------------------------------------------------------------------------------------------ what is served
@dataclass
class Mlp:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)


@dataclass
class Moe:
    router: torch.Tensor
    experts: list[Mlp]
    shared: Mlp | None  # None: the consumer adds no shared-expert output
    route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # router logits -> (weights, experts)


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    dense: torch.Tensor
    post_norm: torch.Tensor
    mlp: Mlp | Moe


@dataclass
class Served:
    """A model as one consumer built it from an export directory."""
    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    head: Callable[[], torch.Tensor]  # called once per forward (Ling's head changes itself on its first call)
    nq: int
    nkv: int
    hd: int
    eps: float
    theta: float


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def served_logits(m: Served, ids: torch.Tensor) -> torch.Tensor:
    """The forward every consumer shares (fp32): neox RoPE, causal GQA, SwiGLU, the consumer's own MoE routing."""
    b, t = ids.shape
    inv = 1.0 / (m.theta ** (torch.arange(0, m.hd, 2, dtype=torch.float32) / m.hd))
    emb = torch.cat([torch.outer(torch.arange(t, dtype=torch.float32), inv)] * 2, dim=-1)

    def rope(x):
        x1, x2 = x[..., : m.hd // 2], x[..., m.hd // 2:]
        return x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()

    mask = torch.full((t, t), float("-inf")).triu(1)
    h = m.embed[ids]
    for layer in m.layers:
        x = rms(h, layer.input_norm, m.eps)
        qkv = F.linear(x, layer.qkv).view(b, t, m.nq + 2 * m.nkv, m.hd)
        q, k, v = (s.transpose(1, 2) for s in qkv.split([m.nq, m.nkv, m.nkv], dim=2))
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(m.nq // m.nkv, dim=1), v.repeat_interleave(m.nq // m.nkv, dim=1)
        att = torch.softmax(q @ k.transpose(2, 3) / m.hd ** 0.5 + mask, dim=-1) @ v
        h = h + F.linear(att.transpose(1, 2).reshape(b, t, m.nq * m.hd), layer.dense)
        x = rms(h, layer.post_norm, m.eps).reshape(b * t, -1)
        if isinstance(layer.mlp, Moe):
            weight, idx = layer.mlp.route(F.linear(x.to(layer.mlp.router.dtype), layer.mlp.router).to(x.dtype))
            y = torch.zeros_like(x)
            for n in range(x.shape[0]):
                for j in range(idx.shape[1]):
                    y[n] += weight[n, j].to(x.dtype) * layer.mlp.experts[int(idx[n, j])](x[n])
            if layer.mlp.shared is not None:
                y = y + layer.mlp.shared(x)
        else:
            y = layer.mlp(x)
        h = h + y.view(b, t, -1)
    return rms(h, m.norm, m.eps) @ m.head().T


class Params:
    """The parameters a consumer allocated, filled by its loader: anything never loaded stays NaN (serving
    engines allocate with torch.empty), so a weight the loader misses shows in the logits."""

    def __init__(self) -> None:
        self.p: dict[str, torch.Tensor] = {}

    def alloc(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> None:
        self.p[name] = torch.full(shape, float("nan"), dtype=dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.p[name]

    def __contains__(self, name: str) -> bool:
        return name in self.p


def fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


def fused_load(p: Params, name: str, t: torch.Tensor, num_experts: int, moe_intermediate_size: int) -> None:
    """The loader both engines share: ``gate_proj`` / ``up_proj`` of dense and shared MLPs stacked into
    ``gate_up_proj`` (shards 0 / 1; expert names are left to the expert mapping), then
    ``make_expert_params_mapping(num_experts)`` (``experts.{e}.{gate,up}_proj.`` -> ``experts.w13_`` halves,
    ``down_proj.`` -> ``experts.w2_``), else the parameter of that name; names the model lacks are skipped."""
    for proj, shard in (("gate_proj", 0), ("up_proj", 1)):
        if proj not in name or "mlp.experts" in name:
            continue
        target = name.replace(proj, "gate_up_proj")
        if target in p:
            half = p[target].shape[0] // 2
            p[target][shard * half:(shard + 1) * half] = t
        return
    for e in range(num_experts):  # range(None) raises TypeError, as in both engines
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"experts.{e}.{proj}."
            if key not in name:
                continue
            target = name.replace(key, "experts.w2_" if proj == "down_proj" else "experts.w13_")
            if target in p:
                mi = moe_intermediate_size
                rows = {"gate_proj": slice(0, mi), "up_proj": slice(mi, 2 * mi), "down_proj": slice(None)}[proj]
                p[target][e][rows] = t.to(p[target].dtype)
            return
    if name in p:
        p[name].copy_(t.to(p[name].dtype))


# ---------------------------------------------------------------------------------------------------- vLLM
def softmax_topk(top_k: int, renormalize: bool, scale: float = 1.0):
    """vLLM's FusedMoE / SGLang's TopK: softmax in fp32, top-k, renormalise when asked (for any k), scale."""
    def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, i = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
        return w * scale, i
    return route


def router_dtype(config: Any) -> torch.dtype:
    """vLLM's and SGLang's BailingMoE: router_dtype fp32 -> fp32 router, else bf16; absent -> the model dtype."""
    r = getattr(config, "router_dtype", None)
    return torch.float32 if r in (None, "fp32") else torch.bfloat16  # (None: the model dtype, fp32 in this test)


def vllm_read(config: Any, weights: Mapping[str, torch.Tensor]) -> Served:
    """vLLM's BailingMoeForCausalLM: every layer index < first_k_dense_replace is a dense BailingMLP of
    intermediate_size, the others BailingMoE (a SharedFusedMoE with renormalize=norm_topk_prob and shared experts
    when num_shared_experts > 0); the head is the embeddings when tied (lm_head.* skipped), else a ParallelLMHead
    loaded as stored: the norm_head normalisation sits in BailingMoeModel.load_weights, which never sees
    lm_head.weight."""
    h = config.hidden_size
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    hd = config.head_dim or h // nq
    assert not (config.use_bias or config.use_qkv_bias)  # (an export never has biases)
    rope = config.rope_parameters  # vLLM reads rope_parameters (transformers 5; vLLM patches it in for 4.x)
    assert rope.get("rope_type", "default") == "default", rope
    tied = getattr(config, "tie_word_embeddings", False)
    p = Params()
    p.alloc("model.word_embeddings.weight", config.vocab_size, h)
    p.alloc("model.norm.weight", h)
    if not tied:
        p.alloc("lm_head.weight", config.vocab_size, h)
    moe_layers = []
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        p.alloc(pre + "input_layernorm.weight", h)
        p.alloc(pre + "post_attention_layernorm.weight", h)
        p.alloc(pre + "attention.query_key_value.weight", (nq + 2 * nkv) * hd, h)
        p.alloc(pre + "attention.dense.weight", h, nq * hd)
        if i < config.first_k_dense_replace:
            p.alloc(pre + "mlp.gate_up_proj.weight", 2 * config.intermediate_size, h)
            p.alloc(pre + "mlp.down_proj.weight", h, config.intermediate_size)
            continue
        moe_layers.append(i)
        e, mi = config.num_experts, config.moe_intermediate_size
        p.alloc(pre + "mlp.gate.weight", e, h, dtype=router_dtype(config))
        p.alloc(pre + "mlp.experts.w13_weight", e, 2 * mi, h)
        p.alloc(pre + "mlp.experts.w2_weight", e, h, mi)
        if config.num_shared_experts > 0:  # None raises TypeError here, as in vLLM
            w = mi * config.num_shared_experts
            p.alloc(pre + "mlp.shared_experts.gate_up_proj.weight", 2 * w, h)
            p.alloc(pre + "mlp.shared_experts.down_proj.weight", h, w)
    for name, t in weights.items():
        if tied and name.startswith("lm_head."):  # AutoWeightsLoader(skip_prefixes=["lm_head."])
            continue
        if not (name.startswith("model.") or name.startswith("lm_head.")):
            raise ValueError(f"vLLM: There is no module or parameter named {name!r}")
        fused_load(p, name, fp32(t), config.num_experts, config.moe_intermediate_size)
    return _assemble(config, p, nq, nkv, hd, moe_layers,
                     route=softmax_topk(config.num_experts_per_tok, config.norm_topk_prob,
                                        getattr(config, "routed_scaling_factor", 1.0)),
                     shared=lambda: config.num_shared_experts > 0,
                     head=(lambda: p["model.word_embeddings.weight"]) if tied else (lambda: p["lm_head.weight"]),
                     theta=rope.get("rope_theta", config.rope_theta))


def _assemble(config: Any, p: Params, nq: int, nkv: int, hd: int, moe_layers: list[int], *, route,
              shared: Callable[[], bool], head: Callable[[], torch.Tensor], theta: float) -> Served:
    """Served from an engine's fused parameters (gate_up stacked, experts w13/w2)."""
    def split(pre: str) -> Mlp:
        gu = p[pre + "gate_up_proj.weight"]
        half = gu.shape[0] // 2
        return Mlp(gu[:half], gu[half:], p[pre + "down_proj.weight"])

    layers = []
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        if i in moe_layers:
            w13, w2 = p[pre + "mlp.experts.w13_weight"], p[pre + "mlp.experts.w2_weight"]
            mi = w2.shape[-1]
            experts = [Mlp(w13[e, :mi], w13[e, mi:], w2[e]) for e in range(w13.shape[0])]
            mlp: Mlp | Moe = Moe(p[pre + "mlp.gate.weight"], experts,
                                 split(pre + "mlp.shared_experts.") if shared() else None, route)
        else:
            mlp = split(pre + "mlp.")
        layers.append(Layer(p[pre + "input_layernorm.weight"], p[pre + "attention.query_key_value.weight"],
                            p[pre + "attention.dense.weight"], p[pre + "post_attention_layernorm.weight"], mlp))
    return Served(p["model.word_embeddings.weight"], layers, p["model.norm.weight"], head, nq, nkv, hd,
                  config.rms_norm_eps, theta)


# -------------------------------------------------------------------------------------------------- SGLang
def sglang_read(config: Any, weights: Mapping[str, torch.Tensor]) -> Served:
    """SGLang's BailingMoEForCausalLM: a layer is sparse when num_experts is not None and its index >=
    first_k_dense_replace; shared experts are built when num_shared_experts is not None and added when > 0;
    TopK(renormalize=norm_topk_prob), routed_scaling_factor (default 1); rope_scaling read with no default; the
    loader skips lm_head when tied and F.normalize's lm_head.weight (dim 0, eps 1e-7) when norm_head."""
    h = config.hidden_size
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    hd = config.head_dim or h // nq
    rope_scaling = config.rope_scaling  # no default in SGLang: a config without the attribute cannot be built
    assert rope_scaling is None or rope_scaling.get("rope_type", rope_scaling.get("type")) == "default", rope_scaling
    assert config.hidden_act == "silu"
    tied = config.tie_word_embeddings
    p = Params()
    p.alloc("model.word_embeddings.weight", config.vocab_size, h)
    p.alloc("model.norm.weight", h)
    if not tied:
        p.alloc("lm_head.weight", config.vocab_size, h)
    moe_layers = []
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        p.alloc(pre + "input_layernorm.weight", h)
        p.alloc(pre + "post_attention_layernorm.weight", h)
        p.alloc(pre + "attention.query_key_value.weight", (nq + 2 * nkv) * hd, h)
        p.alloc(pre + "attention.dense.weight", h, nq * hd)
        if not (config.num_experts is not None and i >= config.first_k_dense_replace):
            p.alloc(pre + "mlp.gate_up_proj.weight", 2 * config.intermediate_size, h)
            p.alloc(pre + "mlp.down_proj.weight", h, config.intermediate_size)
            continue
        moe_layers.append(i)
        e, mi = config.num_experts, config.moe_intermediate_size
        p.alloc(pre + "mlp.gate.weight", e, h, dtype=router_dtype(config))
        p.alloc(pre + "mlp.experts.w13_weight", e, 2 * mi, h)
        p.alloc(pre + "mlp.experts.w2_weight", e, h, mi)
        if config.num_shared_experts is not None:
            w = getattr(config, "moe_shared_expert_intermediate_size", mi) * config.num_shared_experts
            p.alloc(pre + "mlp.shared_experts.gate_up_proj.weight", 2 * w, h)
            p.alloc(pre + "mlp.shared_experts.down_proj.weight", h, w)
    for name, t in weights.items():
        t = fp32(t)
        if tied and "lm_head" in name:
            continue
        if getattr(config, "norm_head", False) and "lm_head.weight" in name:
            t = F.normalize(t, dim=0, p=2, eps=1e-7)
        fused_load(p, name, t, config.num_experts, config.moe_intermediate_size)
    assert getattr(config, "n_group", 0) == 0 and getattr(config, "topk_group", 0) == 0  # no grouped top-k
    return _assemble(config, p, nq, nkv, hd, moe_layers,
                     route=softmax_topk(config.num_experts_per_tok, config.norm_topk_prob,
                                        getattr(config, "routed_scaling_factor", 1.0)),
                     shared=lambda: config.num_shared_experts > 0,
                     head=(lambda: p["model.word_embeddings.weight"]) if tied else (lambda: p["lm_head.weight"]),
                     theta=config.rope_theta)


# --------------------------------------------------------------------------------------------- reference
def reference_read(raw: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> Served:
    """Ling's modeling_bailing_moe.py through transformers (eval mode): its config class's defaults for absent
    keys; MoE layers when num_experts is not None and index >= first_k_dense_replace; shared experts when
    num_shared_experts is not None; the gate in the hidden dtype, softmax in fp32, top-k, renormalised only when
    k > 1 and norm_topk_prob; a tied lm_head is the embedding Parameter itself; with norm_head the first eval
    forward overwrites lm_head.weight with its normalised copy (rewriting tied embeddings too) and turns it off."""
    c = types.SimpleNamespace(**{**BAILING_DEFAULTS, **raw})
    nq, nkv = c.num_attention_heads, c.num_key_value_heads
    hd = c.head_dim or c.hidden_size // nq
    assert c.rope_scaling is None
    w = {k: v.to(torch.float32, copy=True) for k, v in weights.items()}  # its own Parameters (rewritten below)
    embed = w["model.word_embeddings.weight"]
    state = {"head": embed if c.tie_word_embeddings else w["lm_head.weight"], "norm_head": c.norm_head}

    def head() -> torch.Tensor:
        if state["norm_head"]:  # compute_logit in eval: in place, then never again
            hw = state["head"]
            hw.copy_(hw.float() / (torch.norm(hw.float(), p=2, dim=0, keepdim=True) + 1e-7))
            state["norm_head"] = False
        return state["head"]

    def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tw, ti = torch.topk(logits.softmax(dim=-1, dtype=torch.float32), k=c.num_experts_per_tok, dim=-1)
        if c.num_experts_per_tok > 1 and c.norm_topk_prob:
            tw = tw / tw.sum(dim=-1, keepdim=True)
        return tw, ti

    def mlp(pre: str) -> Mlp:
        return Mlp(w[pre + "gate_proj.weight"], w[pre + "up_proj.weight"], w[pre + "down_proj.weight"])

    def shared_mlp(pre: str) -> Mlp:  # absent tensors of a zero-width MLP: transformers leaves them empty
        width = c.moe_intermediate_size * c.num_shared_experts
        if width == 0:
            return Mlp(torch.zeros(0, c.hidden_size), torch.zeros(0, c.hidden_size), torch.zeros(c.hidden_size, 0))
        return mlp(pre)

    layers = []
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        if c.num_experts is not None and i >= c.first_k_dense_replace:
            block: Mlp | Moe = Moe(w[pre + "mlp.gate.weight"],
                                   [mlp(f"{pre}mlp.experts.{e}.") for e in range(c.num_experts)],
                                   shared_mlp(pre + "mlp.shared_experts.") if c.num_shared_experts is not None
                                   else None, route)
        else:
            block = mlp(pre + "mlp.")
        layers.append(Layer(w[pre + "input_layernorm.weight"], w[pre + "attention.query_key_value.weight"],
                            w[pre + "attention.dense.weight"], w[pre + "post_attention_layernorm.weight"], block))
    return Served(embed, layers, w["model.norm.weight"], head, nq, nkv, hd, c.rms_norm_eps, c.rope_theta)


# ------------------------------------------------------------------------------------------------ variants
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # (model overrides, export options)
    "untied": ({}, {}),  # tiny: norm_head on, untied
    "tied": ({"tie_word_embeddings": True, "norm_head": False}, {}),
    "tied_norm_head": ({"tie_word_embeddings": True}, {}),
    "no_shared_experts": ({"num_shared_experts": 0}, {}),
    "top1": ({"num_experts_per_tok": 1, "norm_topk_prob": True}, {}),
    "dense_layers": ({"num_experts": 0}, {}),
    "grouped_experts": ({"expert_impl": "grouped", "first_k_dense_replace": 0}, {}),
    "bf16_export": ({"norm_head": False}, {"dtype": "bfloat16"}),
    "bf16_export_norm_head": ({}, {"dtype": "bfloat16"}),
    "sharded_export": ({}, {"max_shard_size": 150_000}),
}


def variant_model(overrides: dict[str, Any], seed: int = 5) -> CausalLM:
    cfg: ModelConfig = dataclasses.replace(load_preset("tiny"), **{"rope_theta": 5e4, **overrides})
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():  # RMSNorm weights start at 1; the head's columns get different norms
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        if cfg.norm_head:
            head = model.word_embeddings.weight if cfg.tie_word_embeddings else model.lm_head.weight
            head.mul_(torch.linspace(0.5, 3.0, cfg.hidden_size))
    return model.eval()


def our_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def engine_config(directory: Path) -> Any:
    """The config object vLLM and SGLang get: transformers' AutoConfig with trust_remote_code (the shipped
    configuration_edit_train.BailingMoeConfig; transformers has no bailing_moe type)."""
    import transformers

    return transformers.AutoConfig.from_pretrained(str(directory), trust_remote_code=True)


def agree(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    assert torch.isfinite(got).all(), f"{name}: a weight was never loaded (NaN logits)"
    err = (got - want).abs().max().item()
    same = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert err <= tol and same == 1.0, f"{name}: max |logit diff| {err:.3g}, argmax agreement {same:.1%}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_consumer_serves_our_logits(tmp_path, variant):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the dev extra)")
    overrides, options = VARIANTS[variant]
    src = variant_model(overrides)
    out = export_hf(src, None, tmp_path / "hf", eos_token_id=256, **options)
    if "max_shard_size" in options:
        assert (out / "model.safetensors.index.json").is_file()
    ours, tol = src, 1e-5
    if "dtype" in options:  # a bf16 export serves the bf16-rounded weights: ours is our model holding them,
        ours = CausalLM(src.config).eval()  # imported from the export, computing in fp32
        load_hf_into(ours, out)
        if src.config.norm_head:  # our NormHead normalises the bf16-rounded normalised head once more: 1e-3 off
            tol = 1e-3
    raw = json.loads((out / CONFIG_NAME).read_text())
    weights, _ = read_hf_weights(out)
    ids = torch.randint(0, src.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    want = our_logits(ours, ids)

    if ours is src:  # model.init_from reads the export back into the same architecture (norm_topk_prob at k=1,
        back = CausalLM(src.config).eval()  # a dense model's first_k_dense_replace, a tied norm_head head)
        load_hf_into(back, out)
        agree("ours, imported again (model.init_from)", our_logits(back, ids), want)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        served = hf.eval()(ids).logits
    agree("transformers (shipped modeling_edit_train.py)", served, want, tol)
    reference = reference_read(raw, weights)
    config = engine_config(out)
    for name, got in (("Ling reference, first call", served_logits(reference, ids)),
                      ("Ling reference, second call", served_logits(reference, ids)),
                      (f"vLLM @ {VLLM_REV[:10]}", served_logits(vllm_read(config, weights), ids)),
                      (f"SGLang @ {SGLANG_REV[:10]}", served_logits(sglang_read(config, weights), ids))):
        agree(name, got, want, tol)
        agree(f"{name} vs transformers", got, served)  # the consumers among themselves: always 1e-5


# ------------------------------------------------------------------------------- the shipped config class
def test_shipped_config_always_has_rope_scaling(tmp_path, monkeypatch):
    """SGLang reads ``config.rope_scaling`` with no default: the shipped configuration class sets it even when
    config.json says null — under transformers 5 (an alias of its standardised rope_parameters) and under a
    4.x-style PretrainedConfig (plain attributes, as SGLang's pinned transformers 4.57 keeps them)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the dev extra)")
    out = export_hf(variant_model({}), None, tmp_path / "hf")
    assert json.loads((out / CONFIG_NAME).read_text())["rope_scaling"] is None
    config = transformers.AutoConfig.from_pretrained(str(out), trust_remote_code=True)
    assert config.rope_scaling["rope_type"] == "default" and config.rope_scaling["rope_theta"] == 5e4

    class PretrainedConfig4:  # transformers 4.x: known keys consumed, the rest become attributes
        def __init__(self, tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                     **kwargs):
            self.tie_word_embeddings = tie_word_embeddings
            for key, value in kwargs.items():
                setattr(self, key, value)

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(PretrainedConfig=PretrainedConfig4))
    namespace: dict[str, Any] = {"__name__": "configuration_edit_train"}
    exec(compile((out / "configuration_edit_train.py").read_text(), "configuration_edit_train.py", "exec"), namespace)
    raw = json.loads((out / CONFIG_NAME).read_text())
    old = namespace["BailingMoeConfig"](**{k: v for k, v in raw.items() if k not in ("architectures", "auto_map")})
    assert old.rope_scaling is None and old.num_shared_experts == 1 and old.norm_head is False


# ------------------------------------------------------------------------------------- no host path (acc. 2)
def test_export_names_no_host_path(tmp_path, tmp_path_factory, small_corpus):
    """Acceptance 2: nothing an export writes (safetensors metadata, JSON, code, tokenizer) holds the training
    host's run directory; the checkpoint it came from is named from the run's checkpoints/ on."""
    from safetensors import safe_open
    from test_export_report import tiny_sweep

    from edit_train.cli.export import main

    sweep = tiny_sweep(tmp_path_factory, small_corpus)  # the session's 2-cluster sweep, shared with other tests
    run = sweep / "0"
    cases = {"anchor": ([str(run)], "checkpoints/{c0,c1}/step_00000008"),
             "replica": ([str(run / "checkpoints" / "c1"), "--max-shard-size", "1MB"], "checkpoints/c1/step_00000008")}
    for what, (args, named) in cases.items():
        out = tmp_path / what
        main([*args, "--out", str(out)])
        for path in {str(run), str(run.resolve()), str(sweep.parent), str(sweep.parent.resolve())}:
            found = subprocess.run(["grep", "-rlF", path, str(out)], capture_output=True, text=True)
            assert found.returncode == 1 and found.stdout == "", (what, path, found.stdout)
        for f in out.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as st:
                assert st.metadata()["edit_train_checkpoint"] == named, (what, st.metadata())


# ------------------------------------------------------------------------ a public checkpoint, back (acc. 3)
#: Ling-lite's config.json (inclusionAI/Ling-lite), its keys and values, with the sizes scaled down.
LING_LITE_SHAPED: dict[str, Any] = {
    "architectures": ["BailingMoeForCausalLM"], "model_type": "bailing_moe",
    "auto_map": {"AutoConfig": "configuration_bailing_moe.BailingMoeConfig",
                 "AutoModel": "modeling_bailing_moe.BailingMoeModel",
                 "AutoModelForCausalLM": "modeling_bailing_moe.BailingMoeForCausalLM"},
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "use_qkv_bias": False, "use_bias": False, "rms_norm_eps": 1e-6, "norm_head": True, "tie_word_embeddings": False,
    "embedding_dropout": 0.0, "attention_dropout": 0.0, "output_dropout": 0.0, "initializer_range": 0.006,
    "max_position_embeddings": 16384, "rope_theta": 600000, "use_cache": True, "use_sliding_window": False,
    "sliding_window": 4096, "max_window_layers": 3, "rope_scaling": None, "pad_token_id": 126081,
    "eos_token_id": 126081, "num_experts": 8, "num_shared_experts": 2, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "output_router_logits": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.36.0",
}
PUBLIC_VARIANTS = {"ling_lite_shaped": {}, "plain_head": {"norm_head": False},
                   "null_shared_experts": {"num_shared_experts": None, "norm_head": False}}


def public_checkpoint(directory: Path, c: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A BailingMoe directory in the public layout, from its documented names (one nn.Linear per expert, fused
    query_key_value, lm_head beside the embeddings), random bf16 weights in two shards with the index."""
    from safetensors.torch import save_file

    h, v, hd = c["hidden_size"], c["vocab_size"], c["head_dim"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    shapes = {"model.word_embeddings.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "attention.query_key_value.weight": (qkv, h),
                   p + "attention.dense.weight": (h, c["num_attention_heads"] * hd)}
        mlps = []
        if i < c["first_k_dense_replace"]:
            mlps.append((p + "mlp.", c["intermediate_size"]))
        else:
            shapes[p + "mlp.gate.weight"] = (c["num_experts"], h)
            mlps += [(f"{p}mlp.experts.{e}.", c["moe_intermediate_size"]) for e in range(c["num_experts"])]
            if c["num_shared_experts"]:
                mlps.append((p + "mlp.shared_experts.", c["moe_intermediate_size"] * c["num_shared_experts"]))
        for prefix, width in mlps:
            shapes |= {prefix + "gate_proj.weight": (width, h), prefix + "up_proj.weight": (width, h),
                       prefix + "down_proj.weight": (h, width)}
    gen = torch.Generator().manual_seed(11)
    tensors = {name: ((1 + 0.1 * torch.randn(shape, generator=gen)) if len(shape) == 1
                      else torch.randn(shape, generator=gen) * (0.05 if name != "lm_head.weight" else 0.3))
               .to(torch.bfloat16) for name, shape in shapes.items()}
    directory.mkdir()
    names = list(tensors)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, str(directory / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * 2 for t in tensors.values())},
             "weight_map": {n: f for f, part in files.items() for n in part}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / CONFIG_NAME).write_text(json.dumps(c))
    return tensors


@pytest.mark.parametrize("variant", PUBLIC_VARIANTS)
def test_public_checkpoint_imports_and_exports_back(tmp_path, variant):
    """Acceptance 3: a BailingMoe checkpoint in the public layout imports (what model.init_from runs:
    load_hf_into) and exports back bit-identically: every tensor, and with norm_head the head as Ling's own
    eval-mode compute_logit makes it (the served encoding, bit for bit), so every consumer then serves what the
    reference serves from the public files."""
    from edit_train.model.hf import read_hf_config

    public = {**LING_LITE_SHAPED, **PUBLIC_VARIANTS[variant]}
    tensors = public_checkpoint(tmp_path / "ling", public)
    cfg, _ = read_hf_config(tmp_path / "ling")
    model = CausalLM(cfg).eval()
    load_hf_into(model, tmp_path / "ling")
    out = export_hf(model, None, tmp_path / "back", dtype="bfloat16", max_shard_size=60_000)

    back, _ = read_hf_weights(out)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        if name == "lm_head.weight" and public["norm_head"]:  # Ling: W.float() / (||W.float()||_col + 1e-7)
            t = (t.float() / (torch.norm(t.float(), p=2, dim=0, keepdim=True) + 1e-7)).to(t.dtype)
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    written = json.loads((out / CONFIG_NAME).read_text())
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "use_qkv_bias", "use_bias", "rms_norm_eps",
            "rope_theta", "rope_scaling", "num_experts", "num_experts_per_tok", "norm_topk_prob",
            "moe_intermediate_size", "first_k_dense_replace", "torch_dtype", "tie_word_embeddings")
    assert {k: written[k] for k in same} == {k: public[k] for k in same}
    assert written["num_shared_experts"] == (public["num_shared_experts"] or 0)
    assert written["norm_head"] is False and written[TRAINED_HEAD_KEY]["norm_head"] is public["norm_head"]

    # served in fp32 (the reference loaded with dtype=float32: its normalised head is not rounded to bf16), every
    # consumer reading our fp32 export serves what the reference serves from the public files
    out32 = export_hf(model, None, tmp_path / "back32", dtype="float32")
    written32, back32 = json.loads((out32 / CONFIG_NAME).read_text()), read_hf_weights(out32)[0]
    ids = torch.randint(0, public["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(3))
    want = served_logits(reference_read(public, tensors), ids)
    with torch.no_grad():
        agree("our model, imported", model(ids).logits, want)
    agree("Ling reference on the export", served_logits(reference_read(written32, back32), ids), want)
    if importlib.util.find_spec("transformers") is not None:
        config = engine_config(out32)
        agree("vLLM on the export", served_logits(vllm_read(config, back32), ids), want)
        agree("SGLang on the export", served_logits(sglang_read(config, back32), ids), want)

    again = CausalLM(read_hf_config(out32)[0]).eval()  # and our export imports into the same architecture again
    load_hf_into(again, out32)
    with torch.no_grad():
        agree("our model, re-imported", again(ids).logits, want)
