"""The planner's bytes (`edit_train/plan/traffic.py`, torch-free) against the wire format's: payloads made by the
real codec (`codec/dense.py`, `codec/sparse.py`), what `federation/compressed_reduce.py` says a
participant sends, and the `bytes` of real syncs over the in-process federation — for every compression mode
the product runs (top-k at several densities, bits, groups, scale types and `sync.unsent`)."""

from __future__ import annotations

import pytest
import torch

from edit_train.codec.dense import CompressionConfig, quantize
from edit_train.federation.compressed_reduce import sent_bytes
from edit_train.federation.seal import TAG
from edit_train.plan import traffic
from edit_train.plan.traffic import Codec
from toy_federation import config, run_inproc, toy_model, units_of

CODECS = [Codec("none"), Codec("bf16"), Codec("int8"), Codec("fp8"), Codec("int8", 64, "bf16"),
          Codec("fp8", 128, "bf16"), Codec("topk"), Codec("topk", density=0.02, bits=4),
          Codec("topk", density=0.1875, bits=2, group=8, unsent="keep"), Codec("topk", 128, "bf16", 0.25, 8, 4),
          Codec("topk", 64, "fp32", 0.5, 1), Codec("topk", 256, "bf16", 0.05, 4, 4, "keep")]


def cfg_of(c: Codec) -> CompressionConfig:
    cfg = CompressionConfig(c.scheme, c.block_size, c.scale_dtype, True, c.density, c.bits, c.unsent, c.group)
    cfg.validate()
    return cfg


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.label}-{c.block_size}-{c.scale_dtype}")
def test_a_payload_is_the_real_codecs_bytes(codec: Codec) -> None:
    cfg = cfg_of(codec)
    for n in (1, 7, 255, 256, 257, 1000, 4099, 65_535):  # below SPECIALIZE_MIN: no kernel compiled per format
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        assert quantize(x, cfg).numel() == codec.payload(n), (codec, n)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.label}-{c.block_size}-{c.scale_dtype}")
@pytest.mark.parametrize("world", [2, 3, 5, 6])
@pytest.mark.parametrize("needs", ["sum", "measurements"])
def test_a_sync_sends_what_the_federation_sends(codec: Codec, world: int, needs: str) -> None:
    """Per unit and lane piece: a gather (a rule that needs measurements, <= gather_max participants) or a
    sparse payload carries its tag to each peer; a SUM sends what `compressed_reduce.sent_bytes` says (ring,
    all-gather or rs_ag); a sketched SUM adds its proofs, two float64 sketches per unit to each peer."""
    cfg = cfg_of(codec)
    units = [128, 40_960, 196_864, 5]
    for ranks, paired in ((1, True), (2, True), (3, False)):
        want = 0
        for n in units:
            for piece in traffic.unit_pieces(n, ranks, paired, 4):
                gathered = (needs != "sum" and world <= 4) or codec.sparse
                want += sent_bytes("gather" if gathered else "sum", piece, world, 0, cfg if codec.lossy else
                                   CompressionConfig()) + ((world - 1) * TAG if gathered else 0)
            if needs != "sum" and world > 4 and not codec.sparse:
                want += (world - 1) * 16 * traffic.SKETCH_DIM
        got = traffic.sync_bytes(units, world, codec, ranks=ranks, paired=paired, needs=needs)
        assert got == want, (ranks, paired)


def test_sync_events_count_the_modelled_bytes(monkeypatch: pytest.MonkeyPatch, torch_one_thread: None) -> None:
    """Real syncs (the in-process federation, at_end, the uniform rule's SUM at 3 and 5 clusters): what a sync's `bytes`
    grows by over an fp32 sync of the same exchanges is what the traffic model's bytes grow by. (The eager
    top-k codec: the same bytes as the fused one, test_sparse_fused.py, without compiling a kernel per format.)"""
    from edit_train.codec import sparse

    monkeypatch.setattr(sparse, "FUSED", False)
    sizes = [sum(p.numel() for p in u.parameters()) for u in units_of(toy_model())]
    cfg = config("at_end", "uniform", syncs=2)
    cases = ((["c0", "c1", "c2"], [Codec("bf16"), Codec("int8", 16), Codec("fp8", 16, "bf16"),
                                   Codec("topk", 16, "fp32", 0.25, 2), Codec("topk", 16, "bf16", 0.5, 4, 4, "keep")]),
             (["c0", "c1", "c2", "c3", "c4"], [Codec("int8", 16), Codec("topk", 16, "fp32", 0.25, 4)]))
    for names, codecs in cases:
        def per_sync(codec: Codec | None) -> list[int]:
            kw = {"compression": cfg_of(codec)} if codec is not None else {}
            events = run_inproc(names, cfg, **kw)["c0"].events
            return [e["bytes"] for e in events if e["event"] == "sync"]

        dense, base = per_sync(None), traffic.sync_bytes(sizes, len(names), Codec("none"), needs="sum")
        for codec in codecs:
            grew = [a - b for a, b in zip(per_sync(codec), dense)]
            assert grew == [traffic.sync_bytes(sizes, len(names), codec, needs="sum") - base] * 2, (len(names), codec)


def test_the_codec_is_timed_per_call_and_value_and_charged_by_what_a_sync_codes() -> None:
    from edit_train.cli.codec_cost import time_codecs
    from edit_train.plan.profile import Profile

    timed = time_codecs([Codec("none"), Codec("int8"), Codec("int8")])
    assert set(timed) == {"int8"} and all(len(timed["int8"][k]) == 2 and min(timed["int8"][k]) >= 0
                                          for k in ("encode", "decode"))
    cost = {"encode": [1e-4, 1e-8], "decode": [0.0, 2e-8]}
    prof = Profile(codec={"int8": cost, "topk(0.01,2b,g1)": {"encode": [0.0, 3e-9], "decode": [0.0, 1e-9]},
                          "topk(0.1875,2b,g8,keep)": {"encode": [0.0, 9e-9], "decode": [0.0, 1e-9]}})
    assert prof.codec_s(Codec("int8"), (2, 1000), (3, 2000)) == pytest.approx(2e-4 + 1e-5 + 4e-5)
    assert prof.codec_s(Codec("none"), (2, 1000), (3, 2000)) == 0.0
    # an untimed top-k setting costs what the nearest timed one did (density, bits, groups)
    assert prof.codec_s(Codec("topk", density=0.02), (0, 1e6), (0, 0)) == pytest.approx(3e-3)
    assert prof.codec_s(Codec("topk", density=0.25, group=8), (0, 1e6), (0, 0)) == pytest.approx(9e-3)
    # a gather of P participants encodes its own contribution once and decodes the P - 1 others'
    assert traffic.codec_values([1000, 24], 3, Codec("int8")) == (1024, 2048)
    assert traffic.codec_values([1000], 3, Codec("none")) == (0.0, 0.0)
