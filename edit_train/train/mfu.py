"""Model FLOPs utilisation (MFU): model FLOPs per token, the device's peak, and their ratio.

FLOPs per trained token (forward + backward, the PaLM / torchtitan convention)::

    6 * N_active  +  12 * L * (n_heads * head_dim) * T

* ``N_active``: parameters a token multiplies through (``active_params``: ``k`` of the ``E`` routed experts,
  shared experts, router, attention, norms, head) minus the input embedding table, which is a lookup, not a
  matmul. 6 = 2 (multiply-add) x 3 (forward, input-grad, weight-grad).
* attention scores and values: ``2 * 2 * T * d_attn`` per token and layer forward (QK^T and AV), x3 for
  backward; ``T`` is ``train.seq_len``. Causal masking is not discounted (the usual convention).

Recomputation (activation checkpointing) is *not* counted: MFU measures useful model work, not hardware
FLOPs. Peak figures are dense (no 2:4 sparsity) bf16 tensor-core FLOP/s per device from vendor data
sheets; ``train.peak_flops`` overrides the table (and is the only way to get an MFU on CPU).
"""

from __future__ import annotations

import torch

from edit_train.model.config import ModelConfig

# (substring of torch.cuda.get_device_name(), dense bf16 FLOP/s); first match wins, so specific names first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H800", 989.4e12),
    ("H20", 148.0e12),
    ("A100", 312.0e12),
    ("A800", 312.0e12),
    ("L40S", 362.05e12),
    ("L40", 181.0e12),
    ("L4", 121.0e12),
    ("RTX 4090", 165.2e12),
    ("MI325X", 1307.4e12),
    ("MI300X", 1307.4e12),
    ("MI300A", 980.6e12),
    ("MI250X", 383.0e12),
    ("MI250", 362.1e12),
)


def flops_per_token(cfg: ModelConfig, seq_len: int, active_params: int) -> float:
    """Training FLOPs per token: ``6 * (active_params - embedding) + 12 * L * d_attn * seq_len``."""
    embedding = cfg.vocab_size * cfg.hidden_size
    if cfg.tie_word_embeddings:
        embedding = 0  # the shared table is also the head, a real matmul
    d_attn = cfg.num_attention_heads * cfg.head_dim
    return 6.0 * (active_params - embedding) + 12.0 * cfg.num_hidden_layers * d_attn * seq_len


def lookup_peak(device_name: str) -> float | None:
    """Dense bf16 FLOP/s of a known device name, else None."""
    for key, peak in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


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
