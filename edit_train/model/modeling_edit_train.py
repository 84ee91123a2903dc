"""A BailingMoe (Ling) causal LM for ``transformers``, shipped inside every ``edit-train-export`` directory.

Stock ``transformers`` has no ``bailing_moe`` model type; ``config.json``'s ``auto_map`` points
``AutoConfig`` / ``AutoModelForCausalLM`` at this file and ``configuration_edit_train.py``, so
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` builds this model and loads the
directory's safetensors into it (one file or shards listed in ``model.safetensors.index.json``).

Written for edit-train from the tensor-name contract in ``edit_train/model/hf.py`` (not copied from Ling's
code); its forward is edit-train's ``CausalLM`` (``edit_train/model/transformer.py`` + ``moe.py``) re-stated
over BailingMoe's per-expert ``nn.Linear`` layout, and ``tests/test_hf_transformers.py`` pins the two to
1e-4 (fp32). Inference only: no router losses, no routing noise. Self-contained: it imports only ``torch``
and ``transformers``; edit-train itself never imports it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_edit_train import BailingMoeConfig


def _check_supported(cfg: BailingMoeConfig) -> None:
    """What this implementation computes; anything else is refused rather than silently ignored."""
    wanted = {"hidden_act": "silu", "use_bias": False, "use_qkv_bias": False}
    for key, want in wanted.items():
        if getattr(cfg, key, want) != want:
            raise ValueError(f"config.json: {key}={getattr(cfg, key)!r} is not supported by this model "
                             f"(modeling_edit_train.py supports {key}={want!r})")
    for key in ("rope_scaling", "rope_parameters"):  # transformers 5 writes {"rope_type": "default", ...} here
        rope = getattr(cfg, key, None) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"config.json: {key}={rope!r} is not supported by this model (plain RoPE only)")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate-half RoPE of ``x [B, heads, T, hd]`` at ``positions [B, T]`` (frequencies in fp32); with
    ``rotary_dim`` < hd only the first ``rotary_dim`` dims turn (``partial_rotary_factor``), the rest pass."""
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        return torch.cat((rotary(x[..., :rotary_dim], positions, theta), x[..., rotary_dim:]), dim=-1)
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, T, hd]
    x1, x2 = x.chunk(2, dim=-1)
    return x * emb.cos().to(x.dtype) + torch.cat((-x2, x1), dim=-1) * emb.sin().to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention; ``query_key_value`` rows are all q heads, then all k heads, then all v heads."""

    def __init__(self, cfg: BailingMoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.nq, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.rotary_dim = int(self.hd * getattr(cfg, "partial_rotary_factor", 1.0))
        self.query_key_value = nn.Linear(cfg.hidden_size, (self.nq + 2 * self.nkv) * self.hd, bias=False)
        if getattr(cfg, "use_qk_norm", False):  # BailingMoeV2: RMSNorm over each head's q / k, before RoPE
            self.query_layernorm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.dense = nn.Linear(self.nq * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                cache: Any | None) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.query_key_value(x).view(b, t, self.nq + 2 * self.nkv, self.hd)
        q, k, v = (s.transpose(1, 2) for s in qkv.split([self.nq, self.nkv, self.nkv], dim=2))
        if hasattr(self, "query_layernorm"):
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = rotary(q, positions, self.theta, self.rotary_dim), rotary(k, positions, self.theta, self.rotary_dim)
        if cache is not None:  # transformers' Cache: append this step's keys/values, get the whole history
            k, v = cache.update(k, v, self.layer_idx)
        if self.nkv != self.nq:
            k = k.repeat_interleave(self.nq // self.nkv, dim=1)
            v = v.repeat_interleave(self.nq // self.nkv, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.dense(out.transpose(1, 2).reshape(b, t, self.nq * self.hd))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.up_proj = nn.Linear(hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Linear):
    """The router's weight and, for BailingMoeV2's aux-loss-free routing, its ``expert_bias`` buffer."""

    def __init__(self, hidden_size: int, num_experts: int, expert_bias: bool) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))


class MoE(nn.Module):
    """Router (fp32 logits) choosing ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts per token, plus the
    shared experts on every token. Dropless. Ling 1: softmax scores, weights renormalised when ``norm_topk_prob``.
    BailingMoeV2: softmax or sigmoid scores; the choice on scores + ``expert_bias`` within each token's
    ``topk_group`` best of ``n_group`` groups (a group scores its best two); the weights the chosen unbiased
    scores, renormalised (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``."""

    def __init__(self, cfg: BailingMoeConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.score_function = getattr(cfg, "score_function", "softmax")
        self.n_group, self.topk_group = getattr(cfg, "n_group", 0) or 0, getattr(cfg, "topk_group", 0) or 0
        self.scaling = getattr(cfg, "routed_scaling_factor", 1.0)
        bias = bool(getattr(cfg, "moe_router_enable_expert_bias", False))
        self.v2 = self.score_function != "softmax" or bias or self.n_group > 0 or self.scaling != 1.0
        self.gate = Gate(cfg.hidden_size, cfg.num_experts, bias)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.num_shared_experts
        self.shared_experts = MLP(cfg.hidden_size, shared * cfg.moe_intermediate_size) if shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        logits = F.linear(x.float(), self.gate.weight.float())
        if self.v2:
            weight, idx = self.route_v2(logits)
        else:
            probs = torch.softmax(logits, dim=-1)
            weight, idx = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob and self.top_k > 1:
                weight = weight / weight.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            token, slot = torch.where(idx == e)
            y.index_add_(0, token, self.experts[e](x[token]) * weight[token, slot].unsqueeze(-1).to(x.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view_as(hidden)


    def route_v2(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(logits) if self.score_function == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores + self.gate.expert_bias if hasattr(self.gate, "expert_bias") else scores
        if self.n_group > 0:
            n, e = choice.shape
            best = choice.view(n, self.n_group, -1).topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros(n, self.n_group, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(e // self.n_group, dim=1), float("-inf"))
        idx = torch.topk(choice, self.top_k, dim=-1).indices
        weight = scores.gather(1, idx)
        if self.norm_topk_prob and self.top_k > 1:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return weight * self.scaling, idx


class DecoderLayer(nn.Module):
    def __init__(self, cfg: BailingMoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = bool(cfg.num_experts) and layer_idx >= cfg.first_k_dense_replace  # 0 / null: dense
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                cache: Any | None) -> torch.Tensor:
        h = h + self.attention(self.input_layernorm(h), positions, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPLayer(DecoderLayer):
    """A BailingMoeV2 multi-token-prediction layer (``model.layers.{num_hidden_layers + j}``): loaded with the
    checkpoint; generation does not run it (the logits are the main model's)."""

    def __init__(self, cfg: BailingMoeConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.mlp = MoE(cfg)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BailingMoePreTrainedModel(PreTrainedModel):
    config_class = BailingMoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _supports_cache_class = True

    def _init_weights(self, module: nn.Module) -> None:  # fresh models only: loaded weights are not touched
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class BailingMoeModel(BailingMoePreTrainedModel):
    """Embeddings, decoder layers, final norm: the hidden states."""

    def __init__(self, config: BailingMoeConfig) -> None:
        super().__init__(config)
        _check_supported(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
        self.layers = nn.ModuleList([*(DecoderLayer(config, i) for i in range(config.num_hidden_layers)),
                                     *(MTPLayer(config, config.num_hidden_layers + j) for j in range(mtp))])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.word_embeddings = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any | None = None) -> torch.Tensor:
        b, t = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        mask = None
        if (attention_mask is not None and not bool(attention_mask.all())) or (past and t > 1):
            total = past + t  # causal over the whole history, and padding (0 in attention_mask) masked out
            causal = torch.ones(t, total, dtype=torch.bool, device=input_ids.device).tril(past)
            keep = attention_mask[:, -total:].bool() if attention_mask is not None else causal.new_ones(b, total)
            mask = (causal.unsqueeze(0) & keep.unsqueeze(1)).unsqueeze(1)  # [B, 1, T, total]
            mask = mask | ~mask.any(-1, keepdim=True)  # a fully padded row attends everywhere (output unused)
        h = self.word_embeddings(input_ids)
        for layer in self.layers[:self.config.num_hidden_layers]:  # the MTP layers after them do not run here
            h = layer(h, position_ids, mask, cache)
        return self.norm(h)


class BailingMoeForCausalLM(BailingMoePreTrainedModel, GenerationMixin):
    """``model`` + ``lm_head``; with ``norm_head`` the head's columns are L2-normalised in every forward (the
    stored weight is left as it is, so a tied embedding is never rewritten)."""

    _tied_weights_keys = {"lm_head.weight": "model.word_embeddings.weight"}

    def __init__(self, config: BailingMoeConfig) -> None:
        super().__init__(config)
        self.model = BailingMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.word_embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, cache: Any | None = None, past_key_values: Any | None = None,
                logits_to_keep: int = 0, **kwargs: Any) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values  # transformers 5.x named it both ways
        if use_cache and cache is None:
            from transformers import DynamicCache

            cache = DynamicCache()
        h = self.model(input_ids, attention_mask, position_ids, cache if use_cache is not False else None)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        head = self.lm_head.weight
        if self.config.norm_head:
            head = head / (head.detach().norm(p=2, dim=0, keepdim=True) + 1e-7)
        logits = F.linear(h, head)
        loss = None
        if labels is not None:  # labels are the inputs (transformers' convention): predict token t+1 at t
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        out = {"loss": loss, "logits": logits}
        fields = CausalLMOutputWithPast.__dataclass_fields__
        out["cache" if "cache" in fields else "past_key_values"] = cache if use_cache is not False else None
        return CausalLMOutputWithPast(**out)


class BailingMoeV2ForCausalLM(BailingMoeForCausalLM):
    """The same model under BailingMoeV2's name (what an export of a Ling 2.0 model names in ``architectures``)."""
