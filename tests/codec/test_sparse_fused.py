"""The one-pass CPU codec (`codec/sparse_fused.py`, numba) against the eager torch path it stands in for:
the same bytes format, bit-identical decoded values whichever decoder reads a payload, the same refusals,
the non-finite payload, and the kernel compiled for a format's numbers (large tensors)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from edit_train.codec import sparse, sparse_bits, sparse_elements, sparse_fused, sparse_select
from edit_train.codec.sparse import HEADER, PayloadError, SparseFormat, decode, encode_own

pytestmark = pytest.mark.skipif(not sparse_fused.AVAILABLE, reason="numba is not installed")


def codec(fused: bool, fn, *args):  # type: ignore[no-untyped-def]
    old = sparse.FUSED
    sparse.FUSED = fused
    try:
        return fn(*args)
    finally:
        sparse.FUSED = old


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def sample(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3 * 1e-2
    if n > 40:
        x[3] = 0.0
        x[16:32] = 0.0  # whole zero groups and chunks' zero tails
    return x


FORMATS = [  # chunk, density, bits, scale dtype, group
    (64, 0.25, 2, "bf16", 8), (256, 0.25, 2, "bf16", 8), (256, 0.375, 4, "fp32", 8), (96, 0.5, 4, "bf16", 4),
    (256, 0.05, 2, "fp32", 1), (64, 0.25, 1, "bf16", 1), (256, 0.1, 8, "bf16", 1), (512, 0.25, 8, "fp32", 16),
    (64, 1.0, 2, "bf16", 2), (128, 0.25, 4, "bf16", 32), (1024, 0.02, 4, "bf16", 1)]  # last: G > the network


@pytest.mark.parametrize("chunk,density,bits,scale,group", FORMATS)
@pytest.mark.parametrize("n", [1, 7, 300, 4096, 5003])
def test_both_decoders_read_every_payload_to_the_same_bits(chunk, density, bits, scale, group, n):
    f = SparseFormat.of(chunk, density, bits, scale, group)
    x = sample(n, n)
    fused_pay, fused_own = codec(True, encode_own, x, f)
    eager_pay, _ = codec(False, encode_own, x, f)
    assert fused_pay.numel() == eager_pay.numel() == sparse.sparse_bytes(n, f)
    for pay in (fused_pay, eager_pay):
        a, b = codec(True, decode, pay, n, f), codec(False, decode, pay, n, f)
        assert torch.equal(bits_of(a), bits_of(b))
    assert torch.equal(bits_of(fused_own), bits_of(codec(False, decode, fused_pay, n, f)))


@pytest.mark.parametrize("n", [sparse_fused.SPECIALIZE_MIN, 3 * sparse_fused.SPECIALIZE_MIN + 77])
def test_the_kernel_compiled_for_a_format_matches_the_eager_path(n):
    f = SparseFormat.of(256, 0.25, 2, "bf16", 8)  # the README's recommended format
    # well separated group norms: the k largest are unambiguous, so even the selection is the eager one's
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
    x *= torch.rand(n // 8 + 1, generator=torch.Generator().manual_seed(2)).repeat_interleave(8)[:n] * 10
    fused_pay, fused_own = codec(True, encode_own, x, f)
    eager_pay, eager_own = codec(False, encode_own, x, f)
    assert torch.equal(fused_pay, eager_pay)
    assert torch.equal(bits_of(fused_own), bits_of(eager_own))
    assert torch.equal(bits_of(codec(True, decode, eager_pay, n, f)), bits_of(eager_own))


def element_chunks(seed: int) -> torch.Tensor:
    """256-value chunks that defeat a guess carried from chunk to chunk: scales jumping by up to 10^±30, the
    k-th value tied (few distinct values), mostly zeros with a -0.0, subnormals, a plain short last chunk."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for i in range(60):
        c = torch.randn(256, generator=g)
        kind = i % 5
        if kind == 0:
            c *= 10.0 ** float(torch.randint(-30, 31, (1,), generator=g))
        elif kind == 1:
            c = torch.randint(-2, 3, (256,), generator=g).float()
        elif kind == 2:
            c[torch.rand(256, generator=g) < 0.95] = 0.0
            c[5] = -0.0
        elif kind == 3:
            c *= 1e-40
        else:
            c *= 1e-3
        parts.append(c)
    return torch.cat(parts + [torch.randn(77, generator=g)])


@pytest.mark.parametrize("density,bits", [(1 / 256, 2), (0.01, 1), (0.05, 4), (0.25, 4), (0.5, 8), (1.0, 2)])
def test_element_top_k_keeps_exactly_the_k_largest_earlier_first(density, bits):
    """g = 1 selects with a bracket from the last chunk's k-th value (sparse_elements): whatever the chunks,
    the kept indices are a stable sort's — the k largest |x|, of equal ones the earlier — and what the
    sender keeps as its own is what receivers decode."""
    f = SparseFormat.of(256, density, bits, "bf16", 1)
    for seed in range(3):
        x = element_chunks(seed)
        n = x.numel()
        pay, own = codec(True, encode_own, x, f)
        want = []
        for c0 in range(0, n, 256):
            part = x[c0:c0 + 256].abs()
            order = sorted(range(part.numel()), key=lambda j: (-float(part[j]), j))  # noqa: B023
            want += sorted(order[:min(f.k, part.numel())])
        assert pay[-len(want):].tolist() == want  # the index section: a byte each, last in the payload
        assert torch.equal(bits_of(own), bits_of(codec(False, decode, pay, n, f)))


def test_ties_go_to_the_earlier_group():
    f = SparseFormat.of(64, 0.25, 4, "fp32", 8)  # 2 of 8 groups
    x = torch.zeros(64)
    x[8:16] = 1.0
    x[40:48] = 1.0
    x[56:64] = 1.0  # three groups of equal norm: the first two are kept
    own = codec(True, encode_own, x, f)[1]
    assert torch.equal(own.nonzero().flatten(), torch.cat([torch.arange(8, 16), torch.arange(40, 48)]))


@pytest.mark.parametrize("where", [0, 100, 4095])  # a kept position and positions top-k would not keep
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_anywhere_makes_the_non_finite_payload(where, bad):
    f = SparseFormat.of(256, 0.05, 2, "bf16", 8)
    x = sample(4096)
    x[where] = bad
    pay, own = codec(True, encode_own, x, f)
    assert pay[4] == sparse.NONFINITE and not pay[HEADER:].any()
    assert torch.isnan(own).all() and torch.isnan(codec(True, decode, pay, 4096, f)).all()


def corrupt(kind: str, f: SparseFormat, n: int) -> torch.Tensor:
    pay, _ = codec(False, encode_own, sample(n), f)
    head = HEADER
    m, kept, _ = f.kept(n)
    sb = 2 if f.scale_dtype == "bf16" else 4
    values_at = HEADER + m * sb
    index_at = values_at + (kept * f.group * f.bits + 7) // 8
    pay = pay.clone()
    if kind == "scale":
        pay[head + sb * 2: head + sb * 3] = 0xFF  # chunk 2's scale: NaN
    elif kind == "code":
        pay[values_at + 5] = 0xFF  # all-ones codes: above 2Q
    elif kind == "index_order":
        pay[index_at] = 0  # the first chunk's first indices: equal, so not ascending
    elif kind == "index_range":
        pay[index_at] = 0xFF  # 15 where a chunk has 12 groups
    assert pay.numel() == sparse.sparse_bytes(n, f)
    return pay


@pytest.mark.parametrize("kind", ["scale", "code", "index_order", "index_range"])
def test_the_fused_decoder_refuses_with_the_eager_line(kind):
    f = SparseFormat.of(96 if kind == "index_range" else 64, 0.25, 2, "bf16", 8)
    pay = corrupt(kind, f, 1000)
    with pytest.raises(PayloadError) as eager:
        codec(False, decode, pay, 1000, f)
    with pytest.raises(PayloadError) as fused:
        codec(True, decode, pay, 1000, f)
    assert str(fused.value) == str(eager.value)


def test_the_cpu_takes_the_fused_path_and_a_gpu_tensor_would_not(monkeypatch):
    assert sparse._fused(torch.zeros(1))
    assert not sparse._fused(torch.zeros(1, device="meta"))
    monkeypatch.setattr(sparse, "FUSED", False)
    assert not sparse._fused(torch.zeros(1))


def test_the_kernel_cache_is_stamped_with_the_modules_it_inlines():
    """numba's disk cache only sees sparse_fused.py's timestamp: editing an inlined module must edit it too."""
    sources = b"".join(Path(m.__file__).read_bytes() for m in (sparse_bits, sparse_select, sparse_elements))
    digest = hashlib.sha256(sources).hexdigest()[:16]
    assert sparse_fused.INLINED_SOURCES == digest, f"set sparse_fused.INLINED_SOURCES = {digest!r}"
