"""The aggregation seam at any cluster count, in one process (clusters are threads over `federation.inproc`):

* a rule moves what it needs — a rule that judges nothing a SUM (the exchange, one reduction per unit, the
  vote: no gather), the `verified` rule every contribution up to `sync.gather_max` clusters and above it a SUM
  checked against sketches, a rule that merges by itself every contribution at any count;
* above `gather_max`, each Byzantine kind from 1 and 2 clusters is left out in every sync of its window, no
  honest cluster is ever left out, nothing non-finite reaches an anchor (`sketch_check.py`);
* a coordinate-wise median written in tests/ (`median_rule.py`) runs through the one round unchanged, and so
  does a transport selected by import path (`custom_transport.py`).
"""

from __future__ import annotations

import math

import pytest
import torch

from edit_train.config import Config, ConfigError, validate
from edit_train.federation.seal import TAG
from edit_train.local_sgd.aggregator import Needs
from edit_train.local_sgd.sync.round import EXTRA
from edit_train.local_sgd.aggregation.rules import RuleConfig, make_rule, refuse_mode
from edit_train.sim.byzantine import ByzantineTransport
from edit_train.sim.faults import FaultInjector
from toy_federation import H, config, local_deltas, max_diff, run_inproc, toy_model, units_of

SYNCS = 16
WINDOWS = ((7, 10), (12, 15))  # syncs sent while the fault is on: one faulty cluster, then two


def _faulty(kind: str, index: int, two_only: bool) -> object:
    windows = WINDOWS[1:] if two_only else WINDOWS
    specs = [{"kind": kind, "cluster": index, "start": a * H, "end": (b + 1) * H} for a, b in windows]  # sync s: step (s+1)H-1
    faults = FaultInjector(specs, group=index, vocab_size=2)
    return lambda transport, step: ByzantineTransport(transport, faults, step)


def _syncs(results: dict) -> dict[str, list[dict]]:  # type: ignore[type-arg]
    return {n: [e for e in r.events if e["event"] == "sync"] for n, r in results.items()}


def byzantine_run(n: int, kind: str) -> dict[str, list[dict]]:  # type: ignore[type-arg]
    """`n` clusters, the verified rule (gather_max 4: sketched), c1 faulty in both windows, c2 in the second."""
    names = [f"c{i}" for i in range(n)]
    wraps = {"c1": _faulty(kind, 1, False), "c2": _faulty(kind, 2, True)}
    results = run_inproc(names, config("layerwise", "verified", syncs=SYNCS, warmup=2), wraps=wraps,
                         shared_task=True, lr=0.01)
    for r in results.values():  # NaN never reaches an anchor; every cluster holds the same one
        assert all(math.isfinite(float(t.abs().max())) for unit in r.anchors for t in unit)
        assert max_diff(r.anchors, results["c0"].anchors) == 0.0
    return _syncs(results)


def check_byzantine(events: dict[str, list[dict]]) -> dict[str, float]:  # type: ignore[type-arg]
    """Faulty clusters weigh 0 in >= 90 % of their window's syncs; honest ones are left out of <= 1 % of the
    module decisions. Returns the measured shares."""
    faulty_syncs = zero = honest_checks = honest_out = 0
    for name, evs in events.items():
        for e in evs:
            windows = WINDOWS if name == "c1" else WINDOWS[1:] if name == "c2" else ()
            if any(a <= e["sync"] <= b for a, b in windows):
                faulty_syncs += 1
                zero += e["weight"] == 0.0
            elif name not in ("c1", "c2"):
                honest_checks += 3  # modules per sync
                honest_out += len(e["anomalous_modules"])
    assert faulty_syncs == 12, faulty_syncs  # c1: 4 + 4 syncs, c2: 4
    shares = {"faulty_zero": zero / faulty_syncs, "honest_out": honest_out / honest_checks}
    assert shares["faulty_zero"] >= 0.9 and shares["honest_out"] <= 0.01, shares
    return shares


# two kinds in the default run, all four with -m slow (CI's 20 minutes)
@pytest.mark.parametrize("kind", ["sign_flip", pytest.param("random_direction", marks=pytest.mark.slow),
                                  pytest.param("lie_norm", marks=pytest.mark.slow), "nan_payload"])
def test_eight_clusters_leave_every_byzantine_kind_out(kind: str) -> None:
    events = byzantine_run(8, kind)
    check_byzantine(events)
    modes = {e["aggregation"] for e in events["c0"]}
    assert "sketched" in modes  # above gather_max the clean syncs are a checked SUM
    clean = [e for e in events["c0"] if not any(a - 1 <= e["sync"] <= b + 1 for a, b in WINDOWS)]
    assert clean and all(e["aggregation"] == "sketched" for e in clean)
    # docs/sync_math.md's formula: the ring all-reduce, the exchange, and the vote carrying two sketches per unit
    units = [sum(p.numel() for p in u.parameters()) for u in units_of(toy_model())]
    p, dim = 8, 256  # toy_federation's sketch_dim
    ring = sum(2 * (p - 1) * 4 * n // p for n in units)
    exchange = (p - 1) * (8 * (len(units) + 1 + len(EXTRA) + p) + TAG)
    vote = (p - 1) * (8 * (1 + 2 * len(units) * dim) + TAG)
    assert all(e["bytes"] == ring + exchange + vote for e in clean), [e["bytes"] for e in clean]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sign_flip", "random_direction", "lie_norm", "nan_payload"])
def test_sixteen_clusters_leave_every_byzantine_kind_out(kind: str) -> None:
    check_byzantine(byzantine_run(16, kind))


def test_a_cluster_that_sketches_what_it_sends_is_judged_on_it() -> None:
    """A liar whose sketch, reported norm and SUM part all agree (its pseudo-gradient itself is turned around:
    gradient ascent in its window) passes the sum check; the rule, deciding again on the proven sketches, leaves
    it out, so the sync gathers and leaves it out exactly."""
    names = [f"c{i}" for i in range(8)]
    results = run_inproc(names, config("at_end", "verified", syncs=12, warmup=2), shared_task=True, lr=0.01,
                         ascent={"c3": (8 * H, 11 * H)})
    events = _syncs(results)
    window = [e for e in events["c3"] if 9 <= e["sync"] <= 11]
    assert window and all(e["weight"] == 0.0 for e in window), window
    assert any(e["aggregation"] == "gathered" for e in window)  # the second decision disagreed: gathered
    honest = [e for n in names if n != "c3" for e in events[n]]
    assert sum(len(e["anomalous_modules"]) for e in honest) <= 0.01 * 3 * len(honest)


def test_rules_that_judge_nothing_move_only_a_sum() -> None:
    """diloco's `uniform` rule at 4 clusters, over a transport selected by import path: per sync 2 all-gathers
    per sync one all-gather (the exchange) and one SUM per unit, never a gather; the bytes are a ring
    all-reduce's."""
    import custom_transport

    custom_transport.CALLS.clear()
    names = [f"c{i}" for i in range(4)]
    results = run_inproc(names, config("at_end", "uniform", syncs=3), transport="custom_transport:counting")
    calls = custom_transport.CALLS
    assert calls["gather"] == 0 and calls["reduce"] == 4 * 3 * 3 and calls["all_gather"] == 4 * 3, calls
    units = [sum(p.numel() for p in u.parameters()) for u in units_of(toy_model())]
    ring = sum(2 * (4 - 1) * 4 * n // 4 for n in units)  # a ring all-reduce of each unit, fp32
    # the exchange (norms, the round marker, EXTRA, a probe score per cluster) and the vote, each tagged
    small = 3 * (8 * (len(units) + 1 + len(EXTRA) + 4) + TAG) + 3 * (8 + TAG)
    for e in _syncs(results)["c0"]:
        assert e["aggregation"] == "sum" and e["bytes"] == ring + small, (e["bytes"], ring, small)


def test_a_median_written_outside_the_package_merges_eight_clusters() -> None:
    """`median_rule:CoordinateMedian` (tests/) at 8 clusters: every contribution is gathered, the rule's own
    combine merges them, and with outer SGD lr 1 (no momentum, no clip) the anchor moves by exactly the
    coordinate-wise median of the eight pseudo-gradients."""
    import median_rule

    names = [f"c{i}" for i in range(8)]
    cfg = config("at_end", "median_rule:CoordinateMedian", syncs=1, phi=1e9, lr=1.0, momentum=0.0, nesterov=False)
    results = run_inproc(names, cfg, shared_task=True)
    model = toy_model()
    anchor = [[p.detach().clone() for p in u.parameters()] for u in units_of(model)]
    deltas = local_deltas(anchor, 8, 0, shared=True)
    expect = []
    for j, unit in enumerate(anchor):
        merged = []
        for k, a in enumerate(unit):
            s = torch.stack([deltas[i][j][k] for i in range(8)]).sort(dim=0).values
            merged.append(a - (s[3] + s[4]) / 2)
        expect.append(merged)
    for n in names:
        assert max_diff(results[n].anchors, expect) <= 1e-6, n
        algo = results[n].algo
        assert algo is not None and isinstance(algo.rule, median_rule.CoordinateMedian) and algo.rule.calls == 3
    assert all(e["aggregation"] == "gathered" for e in _syncs(results)["c0"])


def test_a_rule_that_cannot_serve_the_federation_is_refused_at_start() -> None:
    median = make_rule(RuleConfig(name="median_rule:CoordinateMedian"))
    assert refuse_mode(median, "median", 8, 4, False).startswith("'median' needs every cluster's contribution")
    assert refuse_mode(median, "median", 4, 4, True).startswith("'median' merges the contributions itself")
    assert refuse_mode(median, "median", 8, 8, False) == ""
    assert refuse_mode(make_rule(RuleConfig(name="uniform")), "uniform", 64, 0, True) == ""
    cfg = Config()
    cfg.algo.local_sgd, cfg.algo.rule.name = True, "median_rule:CoordinateMedian"
    cfg.cluster.count = 6
    with pytest.raises(ConfigError, match="algo.rule.name: 'median_rule:CoordinateMedian' needs every"):
        validate(cfg)


def test_what_each_built_in_rule_needs() -> None:
    assert make_rule(RuleConfig(name="verified")).needs is Needs.MEASUREMENTS
    assert make_rule(RuleConfig(name="edit_norm")).needs is Needs.SUM
    assert make_rule(RuleConfig(name="uniform")).needs is Needs.SUM
