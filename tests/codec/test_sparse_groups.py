"""Grouped top-k (`sync.topk_group = g > 1`, issue 24): whole groups of g consecutive values are selected by
their L2 norm, one index per group, values on a symmetric grid with a zero. The byte model, the selection,
the round trip, the sender's own tensor (bit-identical to what receivers decode), refusals (config errors:
tests/codec/test_sparse.py), and a whole in-process sync where every cluster ends on the bit-identical anchor."""

from __future__ import annotations

import math

import pytest
import torch

from edit_train.codec.dense import CompressionConfig, dequantize, quantize, quantize_own, wire_bytes
from edit_train.codec.sparse import HEADER, PayloadError, decode, encode_own, pack_bits
from toy_federation import H, config, run_inproc

pytestmark = pytest.mark.usefixtures("both_codecs")  # numba's CPU codec and the eager one


def grouped(chunk: int = 64, density: float = 0.25, bits: int = 4, group: int = 8,
            scale: str = "fp32") -> CompressionConfig:
    cfg = CompressionConfig("topk", block_size=chunk, scale_dtype=scale, topk_density=density, bits=bits,
                            topk_group=group)
    cfg.validate()
    return cfg


@pytest.mark.parametrize("group", [2, 4, 16])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("numel", [0, 3, 64, 100, 1000, 4099])
def test_payload_is_exactly_its_byte_model(group: int, bits: int, numel: int) -> None:
    """header + a scale per chunk + g codes per kept group + one index per kept group (⌈log₂ G⌉ bits)."""
    cfg = grouped(64, 0.25, bits, group)
    G = 64 // group
    k = max(1, round(0.25 * G))
    m = math.ceil(numel / 64)
    kept = (m - 1) * k + min(k, math.ceil((numel - (m - 1) * 64) / group)) if m else 0
    want = HEADER + 4 * m + math.ceil(kept * group * bits / 8) + math.ceil(kept * max(1, (G - 1).bit_length()) / 8)
    assert quantize(torch.randn(numel), cfg).numel() == wire_bytes(numel, cfg) == want


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_groups_of_largest_norm_are_kept_and_round_to_the_nearest_level(bits: int) -> None:
    cfg = grouped(64, 0.25, bits, 8)  # 2 of 8 groups per chunk, a last chunk of 39 values (5 groups)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(bits)) * torch.linspace(0.1, 2.0, 1000)
    y = dequantize(quantize(x, cfg), 1000, cfg)
    q = (1 << (bits - 1)) - 1
    for c in range(16):
        xs, ys = x[c * 64:(c + 1) * 64], y[c * 64:(c + 1) * 64]
        groups = torch.nn.functional.pad(xs, (0, -xs.numel() % 8)).view(-1, 8)
        top = sorted(groups.square().sum(1).topk(min(2, groups.shape[0])).indices.tolist())
        mask = torch.zeros(groups.shape[0], 8, dtype=torch.bool)
        mask[top] = True
        mask = mask.view(-1)[:xs.numel()]
        assert torch.equal(ys[~mask], torch.zeros(int((~mask).sum())))  # nothing outside the kept groups
        s = float(xs[mask].abs().max())
        assert float((ys[mask] - xs[mask]).abs().max()) <= s / q / 2 * (1 + 1e-5) + 1e-7
        assert float(ys[mask].abs().max()) == pytest.approx(s, rel=1e-6)  # the largest sits on the top level


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("scale", ["fp32", "bf16"])
def test_the_senders_own_tensor_is_what_receivers_decode(group: int, scale: str) -> None:
    """encode_own skips decoding the sender's own bytes; its tensor is bit-identical to decode(payload),
    for finite input, zero chunks, a short tail and non-finite input (all NaN)."""
    cfg = grouped(128, 0.2, 4, group, scale)
    f = cfg.format
    for seed, n in enumerate((1, 127, 128, 1000, 5003)):
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        x[: min(n, 128)] = 0.0 if n > 200 else x[: min(n, 128)]
        payload, own = encode_own(x, f)
        assert torch.equal(decode(payload, n, f), own)
        assert torch.equal(quantize_own(x, cfg)[0], payload)
    x = torch.randn(500)
    x[321] = float("inf")
    payload, own = encode_own(x, f)
    assert torch.isnan(own).all() and torch.isnan(decode(payload, 500, f)).all()


def test_a_group_code_above_the_top_level_or_a_wrong_group_is_refused() -> None:
    cfg = grouped(64, 0.25, 2, 8)  # 2-bit codes: 0, 1, 2 are -s, 0, +s; 3 is no level
    f = cfg.format
    n = 200
    payload = quantize(torch.randn(n), cfg)
    m, kept, _ = f.kept(n)
    at = HEADER + 4 * m
    bad = payload.clone()
    bad[at:at + math.ceil(kept * 8 * 2 / 8)] = pack_bits(torch.full((kept * 8,), 3), 2)
    with pytest.raises(PayloadError, match=r"^sparse payload refused: a value code above 2"):
        decode(bad, n, f)
    other = payload.clone()
    other[5] = 2  # a sender with groups of 4
    with pytest.raises(PayloadError, match=r"sync\.topk_group=8\)$"):
        decode(other, n, f)


@pytest.mark.parametrize("mode", ["layerwise", "overlap"])
def test_every_cluster_holds_the_bit_identical_anchor_with_groups(mode: str) -> None:
    cfg = config(mode, "uniform", syncs=3)
    names = ["c0", "c1", "c2"]
    steps = tuple(k * H + 1 for k in (1, 2))
    results = run_inproc(names, cfg, compression=grouped(16, 0.5, 4, 4), flush_each_step=mode == "overlap",
                         snapshot_at=steps)
    ref = results["c0"]
    for step in steps:
        anchors = {k: v for k, v in ref.snapshots[step]["outer"].items() if "/anchor/" in k}
        assert anchors
        for n in names[1:]:
            assert all(torch.equal(results[n].snapshots[step]["outer"][k], v) for k, v in anchors.items())
    assert [e["sync"] for e in ref.events if e["event"] == "sync"] == [1, 2, 3]
