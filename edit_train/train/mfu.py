"""Model FLOPs utilisation (MFU): model FLOPs per token, the device's peak, and their ratio.

FLOPs per trained token (forward + backward, the PaLM / torchtitan convention)::

    6 * N_active  +  6 * M * V * H  +  12 * (L + M) * (n_heads * head_dim) * T

* ``N_active``: parameters a token multiplies through (``active_params``: ``k`` of the ``E`` routed experts,
  shared experts, router, attention, norms, head) minus the input embedding table, which is a lookup, not a
  matmul. 6 = 2 (multiply-add) x 3 (forward, input-grad, weight-grad).
* attention scores and values: ``2 * 2 * T * d_attn`` per token and layer forward (QK^T and AV), x3 for
  backward; ``T`` is ``train.seq_len``. Causal masking is not discounted (the usual convention).
* the ``M = num_nextn_predict_layers`` MTP layers (Ling 2.0): their parameters are in ``N_active`` (a decoder
  layer with its MoE block, ``eh_proj`` and norms), their attention is counted as a layer's, and each runs the
  shared ``V x H`` head once more on every token (counted once in ``N_active``, multiplied twice); the
  embedding of the token ahead is a lookup.

Recomputation (activation checkpointing) is *not* counted: MFU measures useful model work, not hardware
FLOPs. Peak figures are dense (no 2:4 sparsity) bf16 tensor-core FLOP/s per device from vendor data
sheets; ``train.peak_flops`` overrides the table (and is the only way to get an MFU on CPU).
"""

from __future__ import annotations

import torch

from edit_train.model.config import ModelConfig
from edit_train.peaks import PEAK_BF16_FLOPS, lookup_peak  # noqa: F401 - the table lives in peaks.py


def flops_per_token(cfg: ModelConfig, seq_len: int, active_params: int) -> float:
    """Training FLOPs per token: ``6 * (active_params - embedding) + 6 * M * V * H + 12 * (L + M) * d_attn *
    seq_len`` with ``M`` MTP layers (``active_params`` counts theirs, `model.count_params`)."""
    head = cfg.vocab_size * cfg.hidden_size
    embedding = 0 if cfg.tie_word_embeddings else head  # a tied table is also the head, a real matmul
    d_attn = cfg.num_attention_heads * cfg.head_dim
    mtp = cfg.num_nextn_predict_layers
    return (6.0 * (active_params - embedding) + 6.0 * mtp * head
            + 12.0 * (cfg.num_hidden_layers + mtp) * d_attn * seq_len)


def device_peak_flops(device: torch.device, override: float = 0.0) -> float | None:
    """Per-device peak: ``override`` when > 0, else the table entry of a known CUDA/ROCm device, else None
    (CPU, unknown GPU)."""
    if override > 0:
        return float(override)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return lookup_peak(torch.cuda.get_device_name(device))


def mfu(tokens_per_s: float, flops_per_tok: float, peak_per_device: float | None, devices: int) -> float | None:
    """Achieved model FLOP/s over the peak of the ``devices`` that produced ``tokens_per_s``."""
    if not peak_per_device or devices <= 0:
        return None
    return tokens_per_s * flops_per_tok / (peak_per_device * devices)
