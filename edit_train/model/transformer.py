"""The Ling (BailingMoe) causal language model, pure torch, read top to bottom.

Module names follow the public BailingMoe checkpoint layout (``word_embeddings``, ``layers.{i}.attention.
query_key_value``, ``layers.{i}.mlp.gate``, ``norm``, ``lm_head`` ...) so that weights map one to one.
Every FSDP unit (``word_embeddings``, each ``DecoderLayer``, ``norm``, ``lm_head``) is *called as a module*
from ``CausalLM.forward``, so forward pre-hooks registered on them fire.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edit_train.model.config import ModelConfig
from edit_train.model.lm_loss import IGNORE_INDEX, ChunkedCrossEntropy
from edit_train.model.moe import DenseMLP, MoEBlock, RoutedExperts


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``[..., T, head_dim]`` (rotate-half layout: frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                             dtype=torch.float32) / head_dim))
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, heads, T, hd]``; ``cos/sin [T, hd]`` or ``[B, T, hd]``."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention with a fused QKV projection and RoPE.

    ``query_key_value`` rows are ordered: all q heads, then all k heads, then all v heads.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, qkv_out, bias=False)
        self.dense = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, T, (nq + 2 nkv) * hd]`` -> q ``[B, nq, T, hd]``, k, v ``[B, nkv, T, hd]``."""
        b, t, _ = qkv.shape
        qkv = qkv.view(b, t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.split_qkv(self.query_key_value(x))
        if position_ids is None:
            position_ids = torch.arange(t, device=x.device)
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.dense(out)


class DecoderLayer(nn.Module):
    """Pre-norm block: attention then a dense MLP (first ``first_k_dense_replace`` layers) or an MoE block."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.num_experts > 0 and layer_idx >= cfg.first_k_dense_replace:
            self.mlp: nn.Module = MoEBlock(cfg)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoEBlock)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = hidden_states + self.attention(self.input_layernorm(hidden_states), position_ids)
        return h + self.mlp(self.post_attention_layernorm(h))


class NormHead(nn.Module):
    """LM head whose weight columns are L2-normalised (over the vocab dim) with a *detached* norm.

    ``logits = h @ (W / (||W||_col + 1e-7)).T`` where ``||W||_col`` has shape ``[1, hidden]``. Called with
    ``labels`` it returns the mean cross-entropy instead, never materialising the logits (``lm_loss.py``).
    """

    def __init__(self, hidden_size: int, vocab_size: int, eps: float = 1e-7, loss_chunk: int = 0) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.loss = ChunkedCrossEntropy(loss_chunk)

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)

    def normalized_weight(self) -> torch.Tensor:
        norm = self.weight.detach().norm(p=2, dim=0, keepdim=True)
        return self.weight / (norm + self.eps)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is not None:
            return self.loss(hidden_states, self.normalized_weight(), labels)
        return F.linear(hidden_states, self.normalized_weight())


class LinearHead(nn.Linear):
    """The plain (bias-free) LM head; with ``labels``, the fused cross-entropy like ``NormHead``."""

    def __init__(self, hidden_size: int, vocab_size: int, loss_chunk: int = 0) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        self.loss = ChunkedCrossEntropy(loss_chunk)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is not None:
            return self.loss(hidden_states, self.weight, labels)
        return super().forward(hidden_states)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # None when the loss came from the fused head (model.loss_chunk > 0)
    loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


class CausalLM(nn.Module):
    """Ling-style MoE causal LM.

    ``forward(input_ids, labels=None)``: ``labels`` are already shifted (label ``t`` is the target of
    position ``t``), ``-100`` is ignored. ``loss = ce_loss + aux_loss + z_loss`` (the router losses summed
    over MoE layers, coefficients from the config). With ``labels`` and ``model.loss_chunk > 0`` the head
    computes the cross-entropy itself, ``loss_chunk`` tokens at a time, and ``logits`` is None.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.norm_head:
            self.lm_head: nn.Module = NormHead(cfg.hidden_size, cfg.vocab_size, loss_chunk=cfg.loss_chunk)
        else:
            self.lm_head = LinearHead(cfg.hidden_size, cfg.vocab_size, loss_chunk=cfg.loss_chunk)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.word_embeddings.weight
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, initializer_range) for embeddings, linears, router, experts and head; ones for norms.

        Also resets the non-persistent router statistics, so it is the call to make after ``to_empty``.
        Safe on the meta device; deterministic given the torch seed.
        """
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):  # includes Router
                if module is self.lm_head and self.config.tie_word_embeddings:
                    continue  # shared with word_embeddings: initialise once
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RoutedExperts):
                module.reset_parameters(std)
            elif isinstance(module, NormHead):
                if not self.config.tie_word_embeddings:
                    module.reset_parameters(std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, MoEBlock):
                module.reset_buffers()

    # ------------------------------------------------------------------ MoE helpers
    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def set_step(self, step: int) -> None:
        """Tell every MoE block the current optimizer step (drives the stochastic routing warmup)."""
        for block in self.moe_blocks():
            block.set_step(step)

    def expert_counts(self) -> torch.Tensor:
        """Tokens routed to each expert by the training forwards since the last `reset_expert_counts`:
        ``[MoE layers, E]`` int64 on the model's device (rows in `moe_layers` order); reading it syncs nothing."""
        blocks = self.moe_blocks()
        if not blocks:
            return torch.zeros(0, 0, dtype=torch.int64)
        return torch.stack([b.routed_tokens for b in blocks])

    def reset_expert_counts(self) -> None:
        for b in self.moe_blocks():
            b.routed_tokens.zero_()

    def moe_layers(self) -> list[int]:
        """The decoder-layer index of each MoE block (the rows of `expert_counts`)."""
        return [layer.layer_idx for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def expert_load(self) -> list[torch.Tensor]:
        """Tokens per expert of the last forward, one ``[E]`` LongTensor per MoE layer."""
        return [b.last_expert_load for b in self.moe_blocks() if b.last_expert_load is not None]

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> CausalLMOutput:
        h = self.word_embeddings(input_ids)
        aux_losses, z_losses = [], []
        for layer in self.layers:
            h = layer(h, position_ids)
            if isinstance(layer.mlp, MoEBlock):
                aux_losses.append(layer.mlp.aux_loss)
                z_losses.append(layer.mlp.z_loss)
                if self.training:  # once per forward (a checkpointed layer's recompute never comes back here)
                    layer.mlp.routed_tokens += layer.mlp.last_expert_load  # on the device: no host sync
        h = self.norm(h)
        zero = torch.zeros((), device=h.device, dtype=torch.float32)
        aux = torch.stack(aux_losses).sum() if aux_losses else zero
        zl = torch.stack(z_losses).sum() if z_losses else zero
        if labels is not None and self.config.loss_chunk > 0:
            ce = self.lm_head(h, labels)  # the fused head + loss: no [tokens, vocab] logits
            return CausalLMOutput(logits=None, loss=ce + aux + zl, ce_loss=ce, aux_loss=aux, z_loss=zl)
        logits = self.lm_head(h)
        if labels is None:
            return CausalLMOutput(logits=logits, aux_loss=aux, z_loss=zl)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             ignore_index=IGNORE_INDEX)
        return CausalLMOutput(logits=logits, loss=ce + aux + zl, ce_loss=ce, aux_loss=aux, z_loss=zl)
