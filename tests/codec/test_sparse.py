"""Sparse low-bit pseudo-gradients (`sync.compression=topk`, issue 24): the index/value encoding round-trips
exactly, error feedback conserves mass, every cluster decodes the same bytes to the bit-identical anchor after
every sync (gathered and summed, every driver), and a malformed payload from another cluster is refused with
one line. The real multi-process runs are in tests/integration/test_compression_runs.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from edit_train.codec.dense import CompressionConfig, ErrorFeedback, dequantize, quantize, wire_bytes
from edit_train.codec.sparse import HEADER, PayloadError, SparseFormat, decode, encode, pack_bits, unpack_bits
from edit_train.config import Config, ConfigError, validate
from edit_train.federation.seal import TAG
from edit_train.federation import seal as seal_mod
from edit_train.federation.compressed_reduce import compressed_gather, gathered_sum, plan, sent_bytes
from toy_federation import H, config, run_inproc

pytestmark = pytest.mark.usefixtures("both_codecs")  # numba's CPU codec and the eager one

NAMES = ["c0", "c1", "c2", "c3"]


def topk(chunk: int = 16, density: float = 0.25, bits: int = 4, scale: str = "fp32") -> CompressionConfig:
    cfg = CompressionConfig("topk", block_size=chunk, scale_dtype=scale, topk_density=density, bits=bits)
    cfg.validate()
    return cfg


# ------------------------------------------------------------------------------------------ the encoding
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 10])
def test_bit_packing_is_the_documented_lsb_first_stream(bits: int) -> None:
    """Bit j of code t is bit (t·bits + j) mod 8 of byte ⌊(t·bits + j)/8⌋, whichever path packs it."""
    codes = torch.randint(0, 1 << bits, (37,), generator=torch.Generator().manual_seed(bits))
    stream = [(int(c) >> j) & 1 for c in codes for j in range(bits)]
    stream += [0] * (-len(stream) % 8)
    want = [sum(b << i for i, b in enumerate(stream[o:o + 8])) for o in range(0, len(stream), 8)]
    assert pack_bits(codes, bits).tolist() == want


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 7, 8, 10, 12, 16])
def test_bit_packing_round_trips(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    for count in (0, 1, 7, 8, 9, 1001):
        codes = torch.randint(0, 1 << bits, (count,), generator=g)
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(count * bits / 8)
        assert torch.equal(unpack_bits(packed, count, bits), codes)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("scale", ["fp32", "bf16"])
@pytest.mark.parametrize("numel,chunk", [(0, 16), (5, 16), (16, 16), (100, 16), (1000, 100), (4099, 256)])
def test_payload_is_exactly_its_byte_model(bits: int, scale: str, numel: int, chunk: int) -> None:
    """header + one scale per chunk + packed values + packed indices, nothing else."""
    cfg = topk(chunk, 0.25, bits, scale)
    f = cfg.format
    payload = quantize(torch.randn(numel, generator=torch.Generator().manual_seed(numel)), cfg)
    m = math.ceil(numel / chunk)
    kept = (m - 1) * f.k + min(f.k, numel - (m - 1) * chunk) if m else 0
    expected = HEADER + m * (4 if scale == "fp32" else 2) + math.ceil(kept * bits / 8) + \
        math.ceil(kept * (chunk - 1).bit_length() / 8)
    assert payload.numel() == wire_bytes(numel, cfg) == expected


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("scale", ["fp32", "bf16"])
def test_encoding_keeps_the_top_k_of_every_chunk_and_round_trips_exactly(bits: int, scale: str) -> None:
    """The decoded tensor is non-zero exactly at each chunk's k largest magnitudes (min(k, L) in a short last
    chunk), with the sign of x and a level within one step of |x|; re-encoding it gives the same bytes."""
    cfg = topk(100, 0.05, bits, scale)  # k = 5 of 100 (7-bit indices), a last chunk of 37
    x = torch.randn(937, generator=torch.Generator().manual_seed(bits))
    payload = quantize(x, cfg)
    y = dequantize(payload, x.numel(), cfg)
    for c in range(10):
        xs, ys = x[c * 100:(c + 1) * 100], y[c * 100:(c + 1) * 100]
        top = set(xs.abs().topk(min(5, xs.numel())).indices.tolist())
        assert set(ys.nonzero().flatten().tolist()) == top
        s = float(xs.abs().max())
        kept = sorted(top)
        assert torch.equal(torch.sign(ys[kept]), torch.sign(xs[kept]))
        step = s / (1 << (bits - 1))
        assert float((ys[kept] - xs[kept]).abs().max()) <= max(step / 2, s - xs[kept].abs().min()) * 1.01 + 1e-7
    assert torch.equal(quantize(y, cfg), payload)  # the decoded tensor is a fixed point: exact round trip


def test_values_on_the_grid_come_back_exactly() -> None:
    f = SparseFormat.of(8, 0.5, 8, "fp32")  # 4 of 8, 8-bit: levels (c+1)/128 · s
    levels = torch.tensor([128, 3, 77, 1], dtype=torch.float32) / 128 * 0.5
    x = torch.zeros(16)
    x[[0, 2, 5, 7]] = levels * torch.tensor([1, -1, 1, -1])
    x[[9, 10, 11, 15]] = levels * 4
    assert torch.equal(decode(encode(x, f), 16, f), x)


def test_a_non_finite_tensor_arrives_as_nan_never_as_numbers() -> None:
    cfg = topk()
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(100)
        x[57] = bad
        payload = quantize(x, cfg)
        assert payload.numel() == wire_bytes(100, cfg)
        assert torch.isnan(dequantize(payload, 100, cfg)).all()


@pytest.mark.parametrize("kw,key", [
    ({"bits": 3}, "sync.bits"), ({"topk_density": 0.0}, "sync.topk_density"),
    ({"topk_density": 1.5}, "sync.topk_density"), ({"topk_density": 0.001}, "sync.block_size"),
    ({"block_size": 1 << 17}, "sync.block_size"),
    # grouped top-k (sync.topk_group, tests/codec/test_sparse_groups.py)
    ({"topk_group": 3}, "sync.topk_group"), ({"topk_group": 512}, "sync.topk_group"), ({"topk_group": 0}, "sync.topk_group"),
    ({"topk_group": 8, "bits": 1}, "sync.bits"), ({"topk_group": 128, "topk_density": 0.1}, "sync.block_size")])
def test_sparse_config_is_validated(kw: dict[str, Any], key: str) -> None:
    cfg = Config()
    cfg.sync.compression = "topk"
    for k, v in kw.items():
        setattr(cfg.sync, k, v)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_sparse_format_sizes() -> None:
    assert SparseFormat.of(256, 0.01, 2).k == 3 and SparseFormat.of(256, 0.01, 2).index_bits == 8
    assert SparseFormat.of(256, 0.375, 4, group=8).k == 12 and SparseFormat.of(256, 0.375, 4, group=8).index_bits == 5


def test_sparse_bytes_are_what_a_gather_sends() -> None:
    cfg = topk(256, 0.01, 2, "bf16")
    n = 100_000
    assert plan(n, 3, cfg).method == "all_gather"  # a sparse payload is never re-sparsified as a sum
    assert sent_bytes("sum", n, 3, 0, cfg) == sent_bytes("gather", n, 3, 0, cfg) == 2 * wire_bytes(n, cfg)
    assert wire_bytes(n, cfg) < 4 * n / 100  # under 1 % of fp32


# ------------------------------------------------------------------------------------------ error feedback
def _send(fb: ErrorFeedback, x: torch.Tensor, cfg: CompressionConfig) -> torch.Tensor:
    send = fb.compensate("m#0", x)
    sent = dequantize(quantize(send, cfg), x.numel(), cfg)
    fb.update("m#0", sent, send)
    return sent


@pytest.mark.parametrize("bits", [1, 2, 8])
def test_error_feedback_conserves_mass(bits: int) -> None:
    """Σ sent + final residual = Σ inputs: what was dropped or rounded is sent later."""
    cfg = topk(64, 1 / 32, bits)  # 2 of 64
    fb = ErrorFeedback()
    g = torch.Generator().manual_seed(bits)
    inputs, sent = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64)
    for _ in range(40):
        x = torch.randn(1000, generator=g)
        inputs += x.double()
        sent += _send(fb, x, cfg).double()
    residual = fb.residual("m#0")
    assert residual is not None and float(residual.abs().max()) > 0.1  # plenty was held back
    assert torch.allclose(sent + residual.double(), inputs, atol=1e-4, rtol=0)


def test_a_small_value_is_sent_later() -> None:
    """One coordinate far below its chunk's top-k is never selected on its own; its residual grows until it is."""
    cfg = topk(16, 1 / 16, 8)  # 1 of 16
    fb = ErrorFeedback()
    x = torch.zeros(16)
    x[3], x[9] = 1.0, 0.05
    first = next(t for t in range(100) if float(_send(fb, x, cfg)[9]) != 0.0)
    assert first > 0
    assert float(fb.residual("m#0")[9]) < 0.05 * (first + 1)


# ------------------------------------------------------------------------------------------ the collective
class _FakeGroup:
    """A gather where every other rank's piece is given: `allgather` fills them in."""

    def __init__(self, me: int, pieces: dict[int, torch.Tensor]) -> None:
        self.me, self.pieces = me, pieces

    def rank(self) -> int:
        return self.me

    def size(self) -> int:
        return len(self.pieces) + 1

    def allgather(self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor], _opts: Any) -> Any:
        for i, out in enumerate(outs[0]):
            out.copy_(ins[0] if i == self.me else self.pieces[i])
        return self

    def wait(self) -> None:
        pass


def _malformed(cfg: CompressionConfig, n: int) -> dict[str, torch.Tensor]:
    """A valid payload of n values, altered each way a receiver must refuse."""
    f = cfg.format
    good = quantize(torch.randn(n, generator=torch.Generator().manual_seed(1)), cfg)
    head, scales, values, _ = f.sections(n)
    idx_at = head + scales + values
    out = {"length": torch.cat([good, torch.zeros(1, dtype=torch.uint8)]), "short": good[:-1].clone()}
    nan = good.clone()
    nan[head:head + 4] = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)
    out["nan scale"] = nan
    inf = good.clone()
    inf[head + 4:head + 8] = torch.tensor([float("inf")], dtype=torch.float32).view(torch.uint8)
    out["inf scale"] = inf
    neg = good.clone()
    neg[head:head + 4] = torch.tensor([-1.0], dtype=torch.float32).view(torch.uint8)
    out["negative scale"] = neg
    high = good.clone()  # chunk 100 values, 7-bit indices: 127 is out of range (0b1111111 LSB first)
    high[idx_at] = 0x7F
    out["index out of range"] = high
    dup = good.clone()
    codes = unpack_bits(good[idx_at:], f.kept(n)[1], f.index_bits)
    codes[1] = codes[0]
    dup[idx_at:] = pack_bits(codes, f.index_bits)
    out["repeated index"] = dup
    hdr = good.clone()
    hdr[2] = 8
    out["header"] = hdr
    return out


def test_a_malformed_payload_is_refused_with_one_line() -> None:
    cfg = topk(100, 0.05, 4)
    n = 250
    for what, bad in _malformed(cfg, n).items():
        with pytest.raises(PayloadError) as info:
            dequantize(bad, n, cfg)
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("sparse payload refused"), (what, msg)
        if bad.numel() != wire_bytes(n, cfg):
            continue  # an all-gather moves equal sizes: a payload of another length never arrives whole
        pg = _FakeGroup(0, {1: bad})
        with pytest.raises(PayloadError, match=r"\(from b, module m, lane 0\)$"):
            compressed_gather(torch.randn(n), pg, cfg, key="m#0", names=["a", "b"])


def test_gathered_sum_adds_decoded_payloads_in_rank_order() -> None:
    cfg = topk(32, 0.25, 2, "bf16")
    xs = [torch.randn(300, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    payloads = {i: quantize(x, cfg) for i, x in enumerate(xs)}
    fb = ErrorFeedback()
    total, nbytes = gathered_sum(xs[1], _FakeGroup(1, {0: payloads[0], 2: payloads[2]}), cfg, feedback=fb, key="k")
    assert total is not None and nbytes == wire_bytes(300, cfg)
    ref = torch.zeros(300)
    for i in range(3):
        ref += dequantize(payloads[i], 300, cfg)
    assert torch.equal(total, ref)
    assert torch.equal(fb.residual("k"), xs[1] - dequantize(payloads[1], 300, cfg))


# ------------------------------------------------------------------------------------------ whole syncs
def _anchors_after_each_sync(mode: str, gather_max: int, names: list[str]) -> dict[str, Any]:
    cfg = config(mode, "verified" if gather_max else "uniform", syncs=3)  # verified gathers, uniform sums
    cfg.gather_max = gather_max
    steps = tuple(k * H + 1 for k in (1, 2))  # the sync of interval k has landed by then in every driver
    return run_inproc(names, cfg, compression=topk(16, 0.25, 2, "bf16"), flush_each_step=mode == "overlap",
                      snapshot_at=steps)


@pytest.mark.parametrize("mode", ["layerwise", "at_end", "overlap"])
@pytest.mark.parametrize("gather_max", [4, 0], ids=["gathered", "summed"])
def test_every_cluster_holds_the_bit_identical_anchor_after_every_sync(mode: str, gather_max: int) -> None:
    names = NAMES if gather_max else NAMES[:3]  # 4 clusters gathered, 3 summed
    results = _anchors_after_each_sync(mode, gather_max, names)
    ref = results["c0"]
    for step in (H + 1, 2 * H + 1):
        anchors = {k: v for k, v in ref.snapshots[step]["outer"].items() if "/anchor/" in k}
        assert anchors
        for n in names[1:]:
            theirs = results[n].snapshots[step]["outer"]
            assert all(torch.equal(theirs[k], v) for k, v in anchors.items()), (n, step)
    for n in names[1:]:
        assert all(torch.equal(a, b) for ua, ub in zip(results[n].anchors, ref.anchors) for a, b in zip(ua, ub))
    syncs = [e for e in ref.events if e["event"] == "sync"]
    assert [e["sync"] for e in syncs] == [1, 2, 3]


def test_sync_bytes_are_the_sparse_payloads_and_their_tags() -> None:
    """Against an fp32 run with the same exchanges (the uniform rule: a SUM, a ring all-reduce of 2(P−1)/P·4n
    per unit): the sparse SUM is a gather of tagged payloads, so the difference per sync is exactly Σ_units
    (P − 1)·(wire_bytes(topk) + tag) − 2(P−1)·4n/P — indices, values, scales and headers counted, nothing else."""
    cfg = config("at_end", "uniform", syncs=2)
    comp = topk(16, 0.25, 2, "bf16")
    sparse = run_inproc(NAMES[:3], cfg, compression=comp)["c0"]
    dense = run_inproc(NAMES[:3], cfg)["c0"]
    sizes = [sum(p.numel() for p in u.params) for u in sparse.algo.replica.units]
    per = [e["bytes"] for e in sparse.events if e["event"] == "sync"]
    ref = [e["bytes"] for e in dense.events if e["event"] == "sync"]
    expected = sum((3 - 1) * (wire_bytes(n, comp) + TAG) - 2 * (3 - 1) * 4 * n // 3 for n in sizes)
    assert len(per) == 2 and [a - b for a, b in zip(per, ref)] == [expected] * 2


def test_a_cluster_sending_a_malformed_payload_fails_the_sync_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """c1 signs a payload whose index is out of range: every cluster refuses the sync (rolled back, the reason
    named in one line) and training goes on."""
    wrap = seal_mod.Seal.wrap

    def forge(self: seal_mod.Seal, t: torch.Tensor, context: str, sender: int) -> torch.Tensor:
        if sender == 1 and t.dtype == torch.uint8 and "/module/" in context:
            t = t.clone()
            t[-1] = 0xFF  # the last two 4-bit indices: 15, beyond the short last chunk of every unit
        return wrap(self, t, context, sender)

    monkeypatch.setattr(seal_mod.Seal, "wrap", forge)
    cfg = config("at_end", "uniform", syncs=2)
    results = run_inproc(NAMES[:2], cfg, compression=topk(16, 0.25, 2))
    for n in NAMES[:2]:
        aborted = [e for e in results[n].events if e["event"] == "sync_aborted"]
        assert aborted and not [e for e in results[n].events if e["event"] == "sync"], n
    reasons = [e["reason"] for e in results["c0"].events if e["event"] == "sync_aborted"]
    assert all("\n" not in r for r in reasons)
    assert any("sparse payload refused: index" in r and "(from c1" in r for r in reasons), reasons
    for n in NAMES[:2]:  # every sync rolled back: nothing it sent was applied, so no residual is owed
        algo = results[n].algo
        assert algo is not None and algo.state.t.feedback.keys() == [], n


def test_a_rolled_back_sync_leaves_the_residuals_as_they_were() -> None:
    """mark() when a sync starts, restore() when it rolls back: the debt is what it was before that sync."""
    cfg = topk(16, 1 / 16, 8)
    fb = ErrorFeedback()
    _send(fb, torch.randn(64), cfg)
    before = fb.residual("m#0").clone()
    fb.mark()
    _send(fb, torch.randn(64), cfg)
    assert not torch.equal(fb.residual("m#0"), before)
    fb.restore()
    assert torch.equal(fb.residual("m#0"), before)
    # a send of the rolled-back sync still running on a background thread writes through its pinned view:
    # dropped, so it cannot bring back what the rollback undid; a view taken after the rollback writes
    fb.mark()
    late = fb.pinned()
    fb.restore()
    late.update("m#0", torch.zeros(64), torch.ones(64))
    assert torch.equal(fb.residual("m#0"), before)
    fb.pinned().update("m#0", torch.zeros(64), torch.ones(64))
    assert torch.equal(fb.residual("m#0"), torch.ones(64))
    fb.clear()
    fb.restore()
    assert fb.residual("m#0") is None
