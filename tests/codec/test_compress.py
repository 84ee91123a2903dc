"""Pseudo-gradient compression formats and error feedback (pure math, no processes)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edit_train.codec.dense import (
    CompressionConfig,
    ErrorFeedback,
    dequantize,
    fp8_supported,
    quantize,
    roundtrip,
    wire_bytes,
)

needs_fp8 = pytest.mark.skipif(not fp8_supported(), reason="torch build without float8_e4m3fn casts")


def _spread(n: int, seed: int = 0) -> torch.Tensor:
    """Values whose magnitude varies over 6 decades along the tensor (so blocks have different scales)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-3, 3, n)


def _per_block(t: torch.Tensor, block: int) -> torch.Tensor:
    n = t.numel()
    blocks = math.ceil(n / block)
    return torch.nn.functional.pad(t, (0, blocks * block - n)).view(blocks, block).abs().amax(dim=1)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("scheme", "int4", "sync.compression"),
    ("block_size", 0, "sync.block_size"),
    ("block_size", 2.5, "sync.block_size"),
    ("scale_dtype", "fp16", "sync.scale_dtype"),
    ("error_feedback", "yes", "sync.error_feedback"),
    ("unsent", "drop", "sync.unsent must be one of"),
    ("unsent", "keep", "sync.unsent=keep needs sync.compression=topk"),  # int8 has nothing left out to keep
])
def test_validate_names_the_key(field: str, value: object, message: str) -> None:
    cfg = CompressionConfig(scheme="int8")
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=message):
        cfg.validate()
    CompressionConfig(scheme="int8", block_size=7, scale_dtype="bf16").validate()
    CompressionConfig(scheme="topk", topk_density=0.1, unsent="keep").validate()
    with pytest.raises(ValueError, match="error_feedback=true"):
        CompressionConfig(scheme="topk", topk_density=0.1, unsent="keep", error_feedback=False).validate()


@pytest.mark.parametrize("scheme", ["none", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("scale_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 1000])
def test_payload_is_exactly_wire_bytes(scheme: str, scale_dtype: str, n: int) -> None:
    if scheme == "fp8" and not fp8_supported():
        pytest.skip("no fp8")
    cfg = CompressionConfig(scheme=scheme, block_size=256, scale_dtype=scale_dtype)
    payload = quantize(_spread(n), cfg)
    assert payload.dtype == torch.uint8
    assert payload.numel() == wire_bytes(n, cfg)
    value = {"none": 4, "bf16": 2, "int8": 1, "fp8": 1}[scheme]
    scales = math.ceil(n / 256) * (4 if scale_dtype == "fp32" else 2) if scheme in ("int8", "fp8") else 0
    assert wire_bytes(n, cfg) == n * value + scales


@pytest.mark.parametrize("scale_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("block", [1, 64, 256])
def test_int8_error_bound_per_block(scale_dtype: str, block: int) -> None:
    x = _spread(3000, seed=block)
    cfg = CompressionConfig(scheme="int8", block_size=block, scale_dtype=scale_dtype)
    err = _per_block(x - roundtrip(x, cfg), block)
    # fp32 scales: absmax/254 (up to fp32 rounding); bf16 scales are rounded up by at most 2^-7 relative
    slack = 1.0 + (2.0 ** -7 if scale_dtype == "bf16" else 1e-6)
    assert bool((err <= _per_block(x, block) / 254 * slack).all())
    assert float(err.max()) > 0  # it is lossy: the bound is not vacuous


def test_bf16_relative_bound() -> None:
    x = _spread(5000)
    y = roundtrip(x, CompressionConfig(scheme="bf16"))
    assert bool(((x - y).abs() <= x.abs() * 2.0 ** -8).all())
    assert y.dtype == torch.float32 and not torch.equal(x, y)


@needs_fp8
@pytest.mark.parametrize("scale_dtype", ["fp32", "bf16"])
def test_fp8_error_bound_per_block(scale_dtype: str) -> None:
    x = _spread(3000, seed=3)
    cfg = CompressionConfig(scheme="fp8", block_size=128, scale_dtype=scale_dtype)
    y = roundtrip(x, cfg)
    scale = torch.repeat_interleave(_per_block(x, 128) / 448, 128)[: x.numel()] * (1 + 2.0 ** -7)
    # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals are spaced 2^-9 (in units of the scale)
    assert bool(((x - y).abs() <= x.abs() * 2.0 ** -4 + scale * 2.0 ** -10).all())


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_zero_and_non_finite_blocks(scheme: str) -> None:
    if scheme == "fp8" and not fp8_supported():
        pytest.skip("no fp8")
    cfg = CompressionConfig(scheme=scheme, block_size=4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, float("nan"), 2.0, 3.0, 1.0, float("inf"), 0.0, 0.0, 4.0, -4.0])
    y = roundtrip(x, cfg)
    assert torch.equal(y[:4], torch.zeros(4))
    assert bool(y[4:12].isnan().all())  # a non-finite value poisons its whole block, never silently finite
    assert torch.equal(y[12:], torch.tensor([4.0, -4.0]))


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_dequantize_is_deterministic_and_checks_size(scheme: str) -> None:
    cfg = CompressionConfig(scheme=scheme, block_size=32)
    x = _spread(500)
    payload = quantize(x, cfg)
    a, b = dequantize(payload, 500, cfg), dequantize(payload.clone(), 500, cfg)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="does not hold 499"):
        dequantize(payload, 499, cfg)


def _drift(feedback: bool, syncs: int, scheme: str = "int8", n: int = 4096) -> tuple[float, float]:
    """|Σ sent − Σ true| after `syncs` sends of fresh weighted Δs; also the one-send error bound."""
    cfg = CompressionConfig(scheme=scheme, block_size=256)
    fb = ErrorFeedback()
    g = torch.Generator().manual_seed(7)
    true_sum = torch.zeros(n)
    sent_sum = torch.zeros(n)
    bound = 0.0
    for _ in range(syncs):
        delta = torch.randn(n, generator=g) * float(torch.rand(1, generator=g)) * 0.1  # weight varies per sync
        send = fb.compensate("layer0", delta) if feedback else delta
        sent = roundtrip(send, cfg)
        if feedback:
            fb.update("layer0", sent, send)
        true_sum += delta
        sent_sum += sent
        bound = max(bound, float(_per_block(send, 256).max()) / 254)
    return float((sent_sum - true_sum).abs().max()), bound


def test_error_feedback_keeps_running_sum_on_track() -> None:
    drift_ef, bound = _drift(True, 100)
    # telescoping: Σ sent = Σ true − last residual, so the drift never exceeds one send's quantization error
    assert drift_ef <= bound * 1.0001
    no_ef_10, _ = _drift(False, 10)
    no_ef_100, _ = _drift(False, 100)
    assert no_ef_100 > 1.8 * no_ef_10  # without feedback the errors random-walk (≈ √10 ×)
    assert no_ef_100 > 3 * drift_ef


def test_error_feedback_bf16_tracks_too() -> None:
    drift_ef, _ = _drift(True, 100, scheme="bf16")
    drift_none, _ = _drift(False, 100, scheme="bf16")
    assert drift_ef * 3 < drift_none


def test_error_feedback_state_roundtrip_clear_and_shape_check() -> None:
    fb = ErrorFeedback()
    cfg = CompressionConfig(scheme="int8", block_size=16)
    for key in ("a", "b"):
        x = _spread(100, seed=len(key))
        fb.update(key, roundtrip(x, cfg), x)
    fb.set_residual("a" + ErrorFeedback.AGG_SUFFIX, torch.ones(100))
    blob = st_save(fb.state_dict())  # plain tensors: safetensors, no pickle
    other = ErrorFeedback()
    other.load_state_dict(st_load(blob))
    assert other.keys() == fb.keys() == ["a", "a::agg", "b"]
    probe = torch.zeros(100)
    assert torch.equal(other.compensate("a", probe), fb.compensate("a", probe))
    assert not torch.equal(fb.compensate("a", probe), probe)
    other.clear("a")  # a cluster re-bases: its residuals (sender and chunk-owner) go
    assert other.keys() == ["b"]
    assert other.compensate("a", probe) is probe
    other.clear()
    assert other.keys() == []
    with pytest.raises(ValueError, match="clear the residuals"):
        fb.compensate("b", torch.zeros(99))
    with pytest.raises(ValueError, match="floating-point"):
        other.load_state_dict({"a": torch.zeros(3, dtype=torch.int64)})


def test_error_feedback_drops_non_finite_residual() -> None:
    fb = ErrorFeedback()
    x = torch.tensor([1.0, float("nan"), 3.0])
    fb.update("k", torch.zeros(3), x)
    assert torch.equal(fb.residual("k"), torch.zeros(3))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_a_payload_at_an_odd_offset_of_a_received_buffer_dequantizes(scheme: str) -> None:
    """rs_ag slices each peer's chunk out of one receive buffer: a chunk of 19 values (23 or 27 bytes) puts the
    next one at an offset that is not a multiple of the scales' 4 bytes."""
    if scheme == "fp8" and not fp8_supported():
        pytest.skip("no float8 on this torch build")
    cfg = CompressionConfig(scheme, block_size=8)
    payload = quantize(torch.randn(19), cfg)
    buf = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])
    assert torch.equal(dequantize(buf[3:], 19, cfg), dequantize(payload, 19, cfg))
