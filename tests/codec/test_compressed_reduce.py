"""compressed_sum over gloo process groups: bit-identical sums, error bounds, byte accounting, feedback."""

from __future__ import annotations

import hashlib
import math
import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from edit_train.codec.dense import CompressionConfig, ErrorFeedback, fp8_supported, roundtrip, wire_bytes
from edit_train.federation.compressed_reduce import (
    BackgroundReducer,
    chunk_bounds,
    compressed_sum,
    handed_bytes,
    plan,
)
from mp_utils import run_ranks

SCHEMES = ["none", "bf16", "int8"] + (["fp8"] if fp8_supported() else [])


class CountingPG:
    """Forwards to a process group and adds up the bytes of every tensor handed to it as input."""

    def __init__(self, pg: Any) -> None:
        self.pg, self.bytes = pg, 0

    def rank(self) -> int:
        return self.pg.rank()

    def size(self) -> int:
        return self.pg.size()

    def _count(self, tensors: list[torch.Tensor]) -> None:
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self._count(tensors)
        return self.pg.allreduce(tensors, opts)

    def allgather(self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor], opts: Any) -> Any:
        self._count(ins)
        return self.pg.allgather(outs, ins, opts)

    def alltoall_base(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                      opts: Any) -> Any:
        self._count([inp])
        return self.pg.alltoall_base(out, inp, out_splits, in_splits, opts)


def _delta(rank: int, n: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(n, generator=g) * torch.logspace(-2, 1, n) * (1 + rank)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha1(t.numpy().tobytes()).hexdigest()


def _blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    nb = math.ceil(t.numel() / block)
    return torch.nn.functional.pad(t.abs(), (0, nb * block - t.numel())).view(nb, block)


def _within_bound(out: torch.Tensor, xs: list[torch.Tensor], cfg: CompressionConfig, two_stage: bool) -> bool:
    """|out − Σx| within the quantization bound (one stage per sender, plus the owner's re-quantization)."""
    ref = torch.stack(xs).double().sum(0)
    err = (out.double() - ref).abs()
    stages = 2.01 if two_stage else 1.0
    if cfg.sparse:  # top-k: exactly the decoded payloads, added in rank order
        total = torch.zeros_like(xs[0])
        for x in xs:
            total += roundtrip(x, cfg)
        return torch.equal(out, total)
    if cfg.scheme == "none":
        return bool((err <= 1e-5 * torch.stack(xs).abs().sum(0)).all())
    if cfg.scheme == "bf16":
        return bool((err <= stages * 2.0 ** -8 * torch.stack(xs).abs().double().sum(0) + 1e-6).all())
    unit = 1 / 254 if cfg.scheme == "int8" else 16 / 448  # fp8: half an ulp (16) at the top of [-448, 448]
    absmax = sum(_blocks(x, cfg.block_size).amax(1) for x in xs) * (1 + 2.0 ** -7)
    per_block = _blocks(err.float(), cfg.block_size).amax(1)
    return bool((per_block <= stages * absmax * unit + 1e-6).all())


CASES_2 = [("int8", "fp32", 1000, "auto"), ("int8", "bf16", 1000, "auto"), ("bf16", "fp32", 1000, "auto"),
           ("none", "fp32", 1000, "auto"), ("int8", "fp32", 1000, "rs_ag"), ("int8", "fp32", 100, "rs_ag")]
CASES_3 = [("int8", "fp32", 3000, "auto"), ("int8", "fp32", 3000, "all_gather"), ("bf16", "fp32", 3000, "auto"),
           ("int8", "bf16", 3000, "auto"), ("int8", "fp32", 100, "auto"), ("int8", "fp32", 100, "rs_ag"),
           ("none", "fp32", 3000, "auto"), ("topk", "bf16", 3000, "auto")]
CASES_2.append(("topk", "fp32", 1000, "auto"))  # sparse payloads are always gathered (never rs_ag)
if fp8_supported():
    CASES_2.append(("fp8", "fp32", 777, "auto"))
    CASES_3.append(("fp8", "fp32", 3000, "auto"))


def _cases_worker(rank: int, world: int, cases: list[list[Any]]) -> list[dict[str, Any]]:
    results = []
    for salt, (scheme, scale_dtype, n, method) in enumerate(cases):
        cfg = CompressionConfig(scheme=scheme, scale_dtype=scale_dtype)
        counting = CountingPG(dist.group.WORLD)
        x = _delta(rank, n, salt)
        out, sent = compressed_sum(x, counting, cfg, feedback=ErrorFeedback(), key=f"case{salt}", method=method)
        p = plan(n, world, cfg, method)
        xs = [_delta(r, n, salt) for r in range(world)]
        results.append({"sha": _sha(out), "sent": sent, "counted": counting.bytes,
                        "formula": handed_bytes(p, rank, cfg), "method": p.method,
                        "bounded": _within_bound(out, xs, cfg, p.method == "rs_ag")})
    # the background reducer gives the same bits as a direct call, from a snapshot of its input
    cfg = CompressionConfig(scheme="int8")
    x = _delta(rank, 3000, 99)
    direct, _ = compressed_sum(x, None, cfg)
    reducer = BackgroundReducer()
    future = reducer.submit(x, None, cfg, feedback=ErrorFeedback(), key="bg")
    x.mul_(2)  # the caller keeps training
    threaded, sent = future.result(timeout=60)
    reducer.shutdown()
    results.append({"background_equal": torch.equal(direct, threaded), "sent": sent})
    return results


def _all_worker(rank: int, world: int, cases: list[list[Any]], torchft: bool) -> dict[str, Any]:
    """Everything one spawn checks (starting processes costs far more than the collectives)."""
    out = {"cases": _cases_worker(rank, world, cases), "feedback": _feedback_worker(rank, world, 100, 1024)}
    if torchft:
        out["torchft"] = _torchft_worker(rank, world)
    return out


def _has_torchft() -> bool:
    try:
        import torchft.process_group  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_all_worker, 2, CASES_2, False)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return run_ranks(_all_worker, 3, CASES_3, _has_torchft())


def _check_cases(results: list[list[dict[str, Any]]], cases: list[Any]) -> None:
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert len({r["sha"] for r in per_rank}) == 1, f"{case}: ranks disagree"
        for r in per_rank:
            assert r["sent"] == r["counted"] == r["formula"], f"{case}: {r}"
            assert r["bounded"], f"{case}: error above the quantization bound"
    for r in results:
        assert r[-1]["background_equal"] and r[-1]["sent"] > 0


def test_two_ranks_bit_identical_bounded_and_accounted(two_ranks: list[dict[str, Any]]) -> None:
    results = [r["cases"] for r in two_ranks]
    _check_cases(results, CASES_2)
    assert [r["method"] for r in results[0][:4]] == ["all_gather", "all_gather", "all_gather", "all_reduce"]
    assert results[0][0]["sent"] == 1000 + 4 * 4  # int8 values + 4 fp32 scales
    assert results[0][1]["sent"] == 1000 + 4 * 2  # bf16 scales
    assert results[0][2]["sent"] == 2000 and results[0][3]["sent"] == 4000


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_three_ranks_bit_identical_bounded_and_accounted(three_ranks: list[dict[str, Any]]) -> None:
    results = [r["cases"] for r in three_ranks]
    _check_cases(results, CASES_3)
    assert [results[0][i]["method"] for i in range(5)] == ["rs_ag", "all_gather", "rs_ag", "rs_ag", "all_gather"]
    # n=3000, 12 blocks of 256 -> chunks of 1024, 1024, 952 values (1040, 1040, 968 bytes with fp32 scales):
    # rank r hands the two chunks it does not own to the all-to-all, then the largest payload to the all-gather
    assert [results[r][0]["sent"] for r in range(3)] == [1040 + 968 + 1040, 1040 + 968 + 1040, 1040 + 1040 + 1040]
    assert [results[r][1]["sent"] for r in range(3)] == [3000 + 12 * 4] * 3


def _feedback_worker(rank: int, world: int, syncs: int, n: int) -> dict[str, float]:
    cfg = CompressionConfig(scheme="int8")
    drift = {}
    for use_fb in (True, False):
        fb = ErrorFeedback() if use_fb else None
        true_sum, got_sum = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        for t in range(syncs):
            weight = 0.5 + 0.5 * math.sin(t)  # the weighted Δ changes scale from sync to sync
            out, _ = compressed_sum(_delta(rank, n, t) * weight, None, cfg, feedback=fb, key="m")
            got_sum += out.double()
            true_sum += sum(_delta(r, n, t).double() * weight for r in range(world))
        drift[str(use_fb)] = float((got_sum - true_sum).abs().max())
    one_send = sum(float(_blocks(_delta(r, n, 0), 256).max()) for r in range(world)) / 254
    return {"ef": drift["True"], "no_ef": drift["False"], "one_send": one_send, "method": plan(n, world, cfg).method}


@pytest.mark.parametrize("world", [2, 3])
def test_error_feedback_tracks_true_sum_over_100_syncs(world: int, request: pytest.FixtureRequest) -> None:
    results = [r["feedback"] for r in request.getfixturevalue("two_ranks" if world == 2 else "three_ranks")]
    r = results[0]
    assert r["method"] == ("all_gather" if world == 2 else "rs_ag")
    assert all(x == r for x in results)  # every rank saw the identical sums
    # with feedback the drift stays within about one send's error (senders' and owners' residuals) ...
    assert r["ef"] <= 3 * r["one_send"]
    # ... without it the errors accumulate
    assert r["no_ef"] > 3 * r["ef"]


def _torchft_worker(rank: int, world: int) -> dict[str, Any]:
    from torchft.process_group import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{os.environ['MASTER_PORT']}/lane0/quorum1", f"cluster{rank}", rank, world)
    out = {}
    for scheme in SCHEMES:
        cfg = CompressionConfig(scheme=scheme)
        x = _delta(rank, 3000)
        got, sent = compressed_sum(x, pg, cfg, feedback=ErrorFeedback(), key="k")
        ref, _ = compressed_sum(x, dist.group.WORLD, cfg, feedback=ErrorFeedback(), key="k")
        out[scheme] = {"sha": _sha(got), "same_as_default_group": torch.equal(got, ref),
                       "sent": sent, "formula": handed_bytes(plan(3000, world, cfg), rank, cfg)}
    pg.shutdown()
    return out


def test_torchft_process_group_gloo(three_ranks: list[dict[str, Any]]) -> None:
    """The reconfigurable torchft gloo group (its rank() is always 0) gives the default group's bits."""
    if not _has_torchft():
        pytest.skip("torchft not installed")
    results = [r["torchft"] for r in three_ranks]
    for scheme in SCHEMES:
        assert len({r[scheme]["sha"] for r in results}) == 1
        for r in results:
            assert r[scheme]["same_as_default_group"] and r[scheme]["sent"] == r[scheme]["formula"]


def test_plan_choice_and_formulas() -> None:
    int8 = CompressionConfig(scheme="int8")
    for n in (1, 255, 256, 1000, 10_000, 1 << 20):
        assert plan(n, 2, int8).method == "all_gather"  # P=2: rs_ag never moves fewer bytes
        assert plan(n, 2, CompressionConfig()).method == "all_reduce"
        assert plan(n, 1, int8).method == "local"
    assert plan(3000, 3, int8).method == "rs_ag"
    assert plan(100, 3, int8).method == "all_gather"  # one block: nothing to scatter
    p8 = plan(1 << 20, 8, int8)
    assert p8.method == "rs_ag"
    assert p8.wire_total < plan(1 << 20, 8, int8, "all_gather").wire_total / 3
    b = wire_bytes(1 << 20, int8)
    assert plan(1 << 20, 8, int8, "all_gather").wire_total == 8 * 7 * b
    assert p8.wire_total == 7 * b + 8 * 7 * b // 8  # chunks of exactly n/8 values: ΣB(n_j) = B(n)
    with pytest.raises(ValueError, match="method"):
        plan(10, 2, int8, "ring")


@pytest.mark.parametrize(("n", "world", "block"), [(3000, 3, 256), (100, 3, 256), (10, 4, 1), (1 << 16, 7, 64)])
def test_chunk_bounds_cover_and_align(n: int, world: int, block: int) -> None:
    bounds = chunk_bounds(n, world, block)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(s % block == 0 and (e % block == 0 or e == n) for s, e in bounds)


def test_single_participant_flushes_residual_and_sends_nothing() -> None:
    assert not dist.is_initialized()
    cfg = CompressionConfig(scheme="int8", block_size=8)
    fb = ErrorFeedback()
    x = torch.linspace(-1, 1, 40)
    fb.update("k", roundtrip(x, cfg), x)
    residual = fb.residual("k").clone()
    out, sent = compressed_sum(torch.ones(40), None, cfg, feedback=fb, key="k")
    assert sent == 0 and torch.equal(out, torch.ones(40) + residual) and fb.keys() == []
    with pytest.raises(ValueError, match="flat"):
        compressed_sum(torch.ones(2, 2), None, cfg)
