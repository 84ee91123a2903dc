"""A recorded in-process federation, replayed: every way a sync moves and merges contributions (a SUM, gathered
with the probe and a retraction, sketched at 6 clusters with a re-gather, a rule's own `combine`, expert rows
kept) gives the recording's anchors and `sync` events (tests/integration/sync_replay.json; `EDIT_TRAIN_RECORD_REPLAY=1 pytest
tests/integration/test_sync_replay.py` writes it again).

Bit-identical where the float kernels are the recording's: the fixture holds a canary, the digest of a few SGD
steps of the toy model, and a machine that reproduces it must reproduce every anchor's digest and every event
exactly. A CPU whose kernels round differently (another vector width or BLAS path: the first recording, made on
the code before the sync round was split by mode, did not replay bit-for-bit on an AVX-512 box) must agree to
float tolerance on each anchor's summary and on every number of every event, and exactly on every decision
(flags, weights' structure, modes, counts). Re-recorded 2026-11-29 from a code that still replayed the first
recording bit-for-bit on its box (CI at 1abb9e1). Re-recorded 2026-12-02 (issue 65, on the 2-core box) after the
probe judgement began to subtract the quorum's baseline: every decision as before; beyond this box's rounding
(the canary differs) the one changed number is the retracted cluster's probe score, 1.0 → 0.9595. Re-recorded 2026-12-02 again
(issue 65, this box) when the direction test began to judge each cluster against its own history and the probe
each cluster against its own threshold: every anchor and decision of `sum`, `combine`, `experts` and `gathered` as
before (in `gathered` the evidence's `probe` is now the score less the cluster's offset, 0.9595 → 0.4595, beside `probe_raw`, and
`direction_z` is against the cluster's own history); `sketched` flips c1 in its third sync instead of its second
(a cluster is judged on direction once its own history holds two values).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from edit_train.cluster.group import RankGroup
from edit_train.federation.inproc import InProcessFederation
from edit_train.local_sgd.moe.experts import RoutedCounts
from edit_train.sim.byzantine import ByzantineTransport
from edit_train.sim.faults import FaultInjector
from toy_federation import LR, Outcome, batch, config, run_inproc, toy_model, train_cluster

FIXTURE = Path(__file__).with_name("sync_replay.json")
RECORD = os.environ.get("EDIT_TRAIN_RECORD_REPLAY") == "1"
# what a clock or the load decides, not the sync: left out of the comparison
UNTIMED = {"blocked_s", "sync_s", "wall_s", "secs_per_step", "time", "elapsed_s", "t", "duration_s", "wait_s"}


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return f"{t.dtype}:{list(t.shape)}:" + hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _plain(v: Any) -> Any:
    """An event as JSON holds it (floats by their exact repr; NaN/inf as strings)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items() if k not in UNTIMED}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, torch.Tensor):
        return _plain(v.tolist())
    return v


def _summary(t: torch.Tensor) -> list[float]:
    """What a tolerance check compares of an anchor tensor: its sum, its absolute sum and 8 spread elements."""
    flat = t.detach().double().flatten().cpu()
    picks = flat[torch.linspace(0, flat.numel() - 1, 8).round().long()]
    return [float(flat.sum()), float(flat.abs().sum()), *map(float, picks)]


def _record(results: dict[str, Outcome]) -> dict[str, Any]:
    return {n: {"anchors": [[_digest(a) for a in unit] for unit in out.anchors],
                "anchor_summaries": [[_summary(a) for a in unit] for unit in out.anchors],
                "syncs": [_plain(e) for e in out.events if e["event"] == "sync"]}
            for n, out in sorted(results.items())}


@functools.cache
def _canary() -> str:
    """The digest of a cluster's first 8 SGD steps on the toy model and its own batches, with the norms and
    means a sync takes of them: the kernels (addmm, tanh, MSE and their backward, the reductions) the recording
    ran, so it is equal exactly where this machine rounds as the recording's did."""
    model = toy_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(8):
        x, y = batch(0, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    params = [p.detach().flatten() for p in model.parameters()]
    stats = [torch.stack([torch.linalg.vector_norm(p), p.mean(), (p * p).sum()]) for p in params]
    return _digest(torch.cat([*params, *stats]))


# Where two CPUs differ only in rounding. The sketched run's direction statistics (`direction_z`, `agreement`)
# are z-scores against a spread of near-equal sketches: an ulp in the inputs moves them by up to 30 % between
# CPUs, while every decision taken from them (which module is flagged, the weights, the re-gather) is still
# compared exactly.
RTOL, ATOL = 1e-5, 1e-7
ILL_CONDITIONED = {"direction_z", "agreement"}


def _close(got: Any, want: Any, path: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for k in want:
            if k not in ILL_CONDITIONED:
                _close(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
        assert got == pytest.approx(want, rel=RTOL, abs=ATOL), path
    else:
        assert got == want, path


def _threads(names: list[str], cfg: Any, per: list[dict[str, Any]]) -> dict[str, Outcome]:
    hub = InProcessFederation(min_clusters=1, join_timeout_s=30.0, timeout_s=30.0)
    outs = {n: Outcome() for n in names}
    threads = [threading.Thread(target=train_cluster, args=(i, hub.transport(n, RankGroup()), cfg),
                                kwargs={"out": outs[n], **per[i]}, daemon=True) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(not t.is_alive() for t in threads)
    return outs


def sum_run() -> dict[str, Outcome]:
    """edit_norm moves a SUM; overlap: nothing is applied before the vote."""
    return run_inproc(["c0", "c1", "c2"], config("overlap", "edit_norm"), flush_each_step=True)


def gathered_run() -> dict[str, Outcome]:
    """verified at 3 clusters gathers; c2's harmful update is admitted at sync 1 and taken back at sync 2."""
    cfg = config("layerwise", "verified", syncs=3, phi=0.5)
    verified = dataclasses.replace(cfg.rule.verified, probe_tokens=8)
    cfg = dataclasses.replace(cfg, rule=dataclasses.replace(cfg.rule, verified=verified, scale_bound=0.0))
    return _threads(["c0", "c1", "c2"], cfg, [{"probe": True, "lr": lr} for lr in (LR, LR, 1.0)])


def sketched_run() -> dict[str, Outcome]:
    """verified at 6 clusters (gather_max 4): a checked SUM; c1 flips its sign in its third sync (its own direction
    history holds two values then: judged): the sketches show it and the sync is gathered again."""
    faults = FaultInjector([{"kind": "sign_flip", "cluster": 1, "start": 8, "end": 12}], group=1, vocab_size=2)
    wrap = lambda transport, step: ByzantineTransport(transport, faults, step)  # noqa: E731
    return run_inproc([f"c{i}" for i in range(6)], config("at_end", "verified", syncs=4, warmup=1),
                      wraps={"c1": wrap}, shared_task=True, lr=0.01)


def combine_run() -> dict[str, Outcome]:
    """A rule outside the package that merges the contributions itself (tests/helpers/median_rule.py)."""
    return run_inproc(["c0", "c1", "c2"], config("layerwise", "median_rule:CoordinateMedian"))


E, ROWS = 4, 6  # unit "2" (Linear 24x24): expert e owns rows 6e..6e+5 of its weight and bias
COUNTS = torch.tensor([[12, 4, 0, 0], [0, 8, 8, 0], [8, 8, 16, 0]], dtype=torch.int64)


def _routed(index: int) -> RoutedCounts:
    pieces = lambda name, _m, _p: (0, [[(0, slice(ROWS * e, ROWS * (e + 1))),  # noqa: E731
                                        (1, slice(ROWS * e, ROWS * (e + 1)))] for e in range(E)]) \
        if name == "2" else None
    return RoutedCounts(lambda: COUNTS[index][None].clone(), pieces)


def experts_run() -> dict[str, Outcome]:
    """Expert weights by routed tokens; a cluster keeps the rows of experts it did not send."""
    cfg = config("at_end", "verified", syncs=2, phi=1e9)
    cfg.rule.verified.expert_weights, cfg.rule.verified.expert_min_tokens = "tokens", 1
    return run_inproc(["c0", "c1", "c2"], cfg, routed=_routed)


RUNS = {"sum": sum_run, "gathered": gathered_run, "sketched": sketched_run, "combine": combine_run,
        "experts": experts_run}


def _modes(rec: dict[str, Any]) -> list[str]:
    return [e["aggregation"] for e in rec["c0"]["syncs"]]


@pytest.mark.skipif(not RECORD, reason="records the fixture (EDIT_TRAIN_RECORD_REPLAY=1)")
def test_record() -> None:
    FIXTURE.write_text(json.dumps({"canary": _canary(), **{k: _record(run()) for k, run in RUNS.items()}},
                                  indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("run", list(RUNS))
def test_a_replayed_federation_is_bit_identical(run: str) -> None:
    """Bit-identical on a machine that rounds as the recording's did; else equal to float tolerance."""
    fixture = json.loads(FIXTURE.read_text())
    expected = fixture[run]
    got = json.loads(json.dumps(_record(RUNS[run]()), sort_keys=True))
    assert got.keys() == expected.keys()
    exact = _canary() == fixture["canary"]
    for name in expected:
        if exact:
            assert got[name] == expected[name], (run, name)
        else:
            _close(got[name]["anchor_summaries"], expected[name]["anchor_summaries"], f"{run}/{name}/anchors")
            _close(got[name]["syncs"], expected[name]["syncs"], f"{run}/{name}/syncs")


def test_the_tolerance_check_passes_rounding_and_catches_a_change() -> None:
    """What a machine with other rounding is held to: an ulp-level difference passes, a real one does not."""
    want = {"weights": [0.5, 0.25], "flagged": ["2"], "anomaly_details": {"2": {"direction_z": 52.8, "cosine": 0.1}}}
    _close({"weights": [0.5 * (1 + 1e-8), 0.25], "flagged": ["2"],
            "anomaly_details": {"2": {"direction_z": 39.7, "cosine": 0.1 + 1e-9}}}, want, "ok")
    for bad in ({**want, "weights": [0.5 * (1 + 1e-3), 0.25]}, {**want, "flagged": []},
                {**want, "anomaly_details": {"2": {"direction_z": 52.8, "cosine": 0.2}}}):
        with pytest.raises(AssertionError):
            _close(bad, want, "bad")


def test_the_recording_covers_every_mode() -> None:
    """The fixture holds what the replay must cover: each mode, a re-gather, a retraction, kept expert rows."""
    rec = json.loads(FIXTURE.read_text())
    assert set(_modes(rec["sum"])) == {"sum"} and set(_modes(rec["combine"])) == {"gathered"}
    assert set(_modes(rec["gathered"])) == {"gathered"}
    assert any(e["retracted"] for e in rec["gathered"]["c0"]["syncs"])
    assert "sketched" in _modes(rec["sketched"]) and any(e["regathered"] for e in rec["sketched"]["c0"]["syncs"])
    assert any(e["unsent_params"] for e in rec["experts"]["c0"]["syncs"])
