"""The Ling (BailingMoe) causal language model, pure torch, read top to bottom.

Module names follow the public BailingMoe checkpoint layout (``word_embeddings``, ``layers.{i}.attention.
query_key_value``, ``layers.{i}.mlp.gate``, ``norm``, ``lm_head`` ...) so that weights map one to one.
Every FSDP unit (``word_embeddings``, each ``DecoderLayer``, ``norm``, ``lm_head``) is *called as a module*
from ``CausalLM.forward``, so forward pre-hooks registered on them fire.
"""

from __future__ import annotations

from collections.abc import Callable
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


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head (rotate-half over those dims), the rest passed
    through: BailingMoeV2's ``partial_rotary_factor`` (0.5: half RoPE)."""
    rd = cos.shape[-1]
    return torch.cat((apply_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)


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
        self.rotary_dim = cfg.rotary_dim
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, qkv_out, bias=False)
        if cfg.use_qk_norm:  # BailingMoeV2: RMSNorm over each head's query / key, before RoPE
            self.query_layernorm: RMSNorm | None = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.key_layernorm: RMSNorm | None = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.query_layernorm = self.key_layernorm = None
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
        if self.query_layernorm is not None and self.key_layernorm is not None:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        if self.rotary_dim == self.head_dim:
            cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # frequencies over the rotary dims only (BailingMoeV2 / transformers' partial_rotary_factor)
            cos, sin = rope_cos_sin(position_ids, self.rotary_dim, self.rope_theta)
            q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
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
        if cfg.num_experts > 0 and layer_idx >= cfg.first_k_dense_replace:  # (an MTP layer's index is past them)
            self.mlp: nn.Module = MoEBlock(cfg)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoEBlock)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = hidden_states + self.attention(self.input_layernorm(hidden_states), position_ids)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPLayer(DecoderLayer):
    """A multi-token-prediction layer (BailingMoeV2 / DeepSeek-V3 MTP, ``model.layers.{L + j}`` in a checkpoint).

    Given the previous hidden state ``h`` (for the first MTP layer: the main model's output after its final
    ``norm``) and the embedding ``e`` of the token one further ahead, it computes
    ``final_layernorm(block(eh_proj([enorm(e); hnorm(h)])))`` with ``block`` a decoder layer (attention + MoE).
    The embeddings and the LM head are the main model's (shared)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None,  # type: ignore[override]
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        assert embeds is not None, "an MTP layer needs the next tokens' embeddings"
        h = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden_states)), dim=-1))
        return self.final_layernorm(super().forward(h, position_ids))


def shift_left(t: torch.Tensor, fill: int) -> torch.Tensor:
    """``t [B, T]`` moved one position to the left along T, the last column ``fill``."""
    return torch.cat((t[:, 1:], t.new_full((t.shape[0], 1), fill)), dim=1)


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
    mtp_loss: torch.Tensor | None = None  # the MTP layers' mean cross-entropy (unscaled); None without MTP
    mtp_logits: list[torch.Tensor] | None = None  # each MTP layer's logits, when labels is None


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
        # the MTP layers follow the main ones (BailingMoeV2's checkpoint names them model.layers.{L + j}): each is an
        # FSDP / sync unit like any decoder layer; forward runs them after the final norm
        self.layers = nn.ModuleList([*(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
                                     *(MTPLayer(cfg, cfg.num_hidden_layers + j)
                                       for j in range(cfg.num_nextn_predict_layers))])
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

    @torch.no_grad()
    def update_expert_bias(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Once per optimizer step: move every MoE block's expert bias (``model.moe_router_enable_expert_bias``)
        by that step's expert load (``moe.bias_update``). ``reduce`` (e.g. a sum over the cluster's ranks) turns
        this rank's ``[MoE layers, E]`` load into the one every rank of the cluster applies. No-op without bias."""
        blocks = [b for b in self.moe_blocks() if b.step_tokens is not None]
        if not blocks:
            return
        load = torch.stack([b.step_tokens for b in blocks])
        if reduce is not None:
            load = reduce(load)
        for block, row in zip(blocks, load):
            block.update_expert_bias(row)

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
    def _router_losses(self, layer: nn.Module, aux_losses: list[torch.Tensor], z_losses: list[torch.Tensor]) -> None:
        if isinstance(layer.mlp, MoEBlock):
            aux_losses.append(layer.mlp.aux_loss)
            z_losses.append(layer.mlp.z_loss)
            if self.training:  # once per forward (a checkpointed layer's recompute never comes back here)
                layer.mlp.routed_tokens += layer.mlp.last_expert_load  # on the device: no host sync
                if layer.mlp.step_tokens is not None:
                    layer.mlp.step_tokens += layer.mlp.last_expert_load

    def _ce(self, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean cross-entropy, logits or None) of hidden states ``h`` through the head against ``labels``."""
        if self.config.loss_chunk > 0:
            return self.lm_head(h, labels), None  # the fused head + loss: no [tokens, vocab] logits
        logits = self.lm_head(h)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX), logits

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> CausalLMOutput:
        if self.config.num_nextn_predict_layers > 0:
            return self._forward_mtp(input_ids, labels, position_ids)
        h = self.word_embeddings(input_ids)
        aux_losses: list[torch.Tensor] = []
        z_losses: list[torch.Tensor] = []
        for layer in self.layers:
            h = layer(h, position_ids)
            self._router_losses(layer, aux_losses, z_losses)
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

    def _forward_mtp(self, input_ids: torch.Tensor, labels: torch.Tensor | None,
                     position_ids: torch.Tensor | None) -> CausalLMOutput:
        """The forward with MTP layers: the main model as without them, then MTP layer ``j`` takes the previous
        hidden state and the embeddings of the inputs shifted ``j + 1`` to the left (token id 0 past the end,
        as the reference) and predicts ``labels`` shifted ``j + 1`` to the left (``-100`` past the end), i.e.
        token ``t + 2 + j`` at position ``t``. ``loss = ce + aux + z + mtp_loss_scaling_factor * mtp_loss`` with
        ``mtp_loss`` the MTP layers' mean cross-entropy."""
        cfg = self.config
        main, mtp = self.layers[:cfg.num_hidden_layers], self.layers[cfg.num_hidden_layers:]
        h = self.word_embeddings(input_ids)
        aux_losses: list[torch.Tensor] = []
        z_losses: list[torch.Tensor] = []
        for layer in main:
            h = layer(h, position_ids)
            self._router_losses(layer, aux_losses, z_losses)
        h = self.norm(h)
        mtp_hidden = []
        ids, mh = input_ids, h
        for layer in mtp:
            ids = shift_left(ids, 0)
            mh = layer(mh, position_ids, self.word_embeddings(ids))
            self._router_losses(layer, aux_losses, z_losses)
            mtp_hidden.append(mh)
        aux = torch.stack(aux_losses).sum()
        zl = torch.stack(z_losses).sum()
        if labels is None:
            return CausalLMOutput(logits=self.lm_head(h), aux_loss=aux, z_loss=zl,
                                  mtp_logits=[self.lm_head(m) for m in mtp_hidden])
        ce, logits = self._ce(h, labels)
        mtp_losses = []
        shifted = labels
        for m in mtp_hidden:
            shifted = shift_left(shifted, IGNORE_INDEX)
            mtp_losses.append(self._ce(m, shifted)[0])
        mtp_loss = torch.stack(mtp_losses).mean()
        loss = ce + aux + zl + cfg.mtp_loss_scaling_factor * mtp_loss
        return CausalLMOutput(logits=logits, loss=loss, ce_loss=ce, aux_loss=aux, z_loss=zl, mtp_loss=mtp_loss)
