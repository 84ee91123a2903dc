"""Each way a round moves and merges contributions (`local_sgd/sync/merges.py`) on its own, the one decision of which
one a quorum gets (`local_sgd/moves.py`), and Δ computed once per unit and round."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from edit_train.local_sgd.sync import merges
from edit_train.local_sgd.moves import MODES, aggregation, wire
from edit_train.local_sgd.sync.outer import OuterState
from edit_train.sim.byzantine import ByzantineTransport
from edit_train.sim.faults import FaultInjector
from toy_federation import config, max_diff, reference, run_inproc, toy_model, units_of

UNITS = len(units_of(toy_model()))


def _spy(monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> Counter[str]:
    """Count calls of `cls.method` made on instances of exactly `cls`."""
    calls: Counter[str] = Counter()
    original = getattr(cls, method)

    def spied(self: Any, *args: Any, **kw: Any) -> Any:
        if type(self) is cls:
            calls[method] += 1
        return original(self, *args, **kw)

    monkeypatch.setattr(cls, method, spied)
    return calls


def _syncs(results: dict[str, Any], name: str = "c0") -> list[dict[str, Any]]:
    return [e for e in results[name].events if e["event"] == "sync"]


def test_moves_decides_every_mode() -> None:
    """One function for the round, the planner and the lanes: alone or a SUM rule → sum; contributions, few
    clusters, no sketches or sparse payloads → gathered; else sketched. A sparse SUM is a gather on the wire."""
    assert aggregation("measurements", 1, 4, 256) == "sum"
    assert aggregation("sum", 8, 4, 256, sparse=True) == "sum"
    assert aggregation("contributions", 8, 4, 256) == "gathered"
    assert aggregation("measurements", 4, 4, 256) == "gathered"
    assert aggregation("measurements", 5, 4, 0) == "gathered"
    assert aggregation("measurements", 5, 4, 256, sparse=True) == "gathered"
    assert aggregation("measurements", 5, 4, 256) == "sketched"
    assert {aggregation(n, p, 4, 256) for n in ("sum", "measurements", "contributions") for p in (1, 3, 6)} \
        == set(MODES)
    assert [wire(m, False) for m in MODES] == ["sum", "gather", "sum"]
    assert wire("sum", True) == "gather"


def test_summed_is_the_weighted_sum_of_the_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Summed`: decided on the reports, each unit merged by the SUM (the closed form), never measured."""
    merged = _spy(monkeypatch, merges.Summed, "merged")
    results = run_inproc(["c0", "c1", "c2"], config("at_end", "uniform"))
    assert max_diff(results["c0"].anchors, reference(3, 3, "uniform")) <= 1e-6
    assert merged["merged"] == 3 * 3 * UNITS  # clusters x syncs x units
    assert all(e["aggregation"] == "sum" for e in _syncs(results))


def test_gathered_measures_what_was_sent_and_sums_it_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Gathered`: every contribution lands on every cluster; the weights are on the snapped grid and the clip
    norm comes from the Gram matrix (no reduction for it)."""
    merged = _spy(monkeypatch, merges.Gathered, "merged")
    sq = _spy(monkeypatch, merges.Gathered, "sqnorm")
    results = run_inproc(["c0", "c1", "c2"], config("at_end", "verified"))
    assert merged["merged"] == 3 * 3 * UNITS and sq["sqnorm"] == 3 * 3 * UNITS
    assert max_diff(results["c0"].anchors, reference(3, 3, "uniform")) <= 1e-6  # equal claims: 1/3 each
    assert all(e["aggregation"] == "gathered" for e in _syncs(results))
    for n in ("c1", "c2"):
        assert max_diff(results[n].anchors, results["c0"].anchors) == 0.0


def test_combined_lets_the_rule_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Combined`: a rule with its own `combine` (tests/helpers/median_rule.py) merges; with 3 clusters its median of
    every element differs from the mean."""
    combined = _spy(monkeypatch, merges.Combined, "_merge")
    results = run_inproc(["c0", "c1", "c2"], config("at_end", "median_rule:CoordinateMedian"))
    assert combined["_merge"] == 3 * 3 * UNITS
    assert max_diff(results["c0"].anchors, reference(3, 3, "uniform")) > 1e-4
    assert all(e["aggregation"] == "gathered" for e in _syncs(results))


def test_sketched_checks_the_sum_and_gathers_again_when_it_does_not_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Sketched`: above gather_max a SUM with proofs in the vote; a sign-flipped contribution in sync 2 fails
    the check, and that sync is gathered again (the same anchor on every cluster)."""
    voted = _spy(monkeypatch, merges.Sketched, "voted")
    faults = FaultInjector([{"kind": "sign_flip", "cluster": 1, "start": 4, "end": 8}], group=1, vocab_size=2)
    names = [f"c{i}" for i in range(6)]
    results = run_inproc(names, config("at_end", "verified", syncs=3, warmup=1),
                         wraps={"c1": lambda t, step: ByzantineTransport(t, faults, step)}, shared_task=True, lr=0.01)
    syncs = _syncs(results)
    assert [e["aggregation"] for e in syncs] == ["sketched", "gathered", "sketched"]
    assert syncs[1]["regathered"] and not syncs[0]["regathered"]
    assert voted["voted"] == 6 * 3  # every cluster's verdict of every sync (the re-gathered one's second is not)
    for n in names[1:]:
        assert max_diff(results[n].anchors, results["c0"].anchors) == 0.0


@pytest.mark.parametrize("mode,rule,clusters", [("layerwise", "edit_norm", 3), ("at_end", "verified", 3),
                                                ("overlap", "verified", 3), ("at_end", "verified", 6)])
def test_delta_is_computed_once_per_unit_and_round(monkeypatch: pytest.MonkeyPatch, mode: str, rule: str,
                                                   clusters: int) -> None:
    """Δ = θ̄ − θ is taken once per unit and round (at the exchange) and used for the norm, the payload, and the
    sketched check alike."""
    calls: Counter[str] = Counter()
    original = OuterState.pseudo_grad

    def counted(self: OuterState, name: str) -> list[torch.Tensor]:
        calls[name] += 1
        return original(self, name)

    monkeypatch.setattr(OuterState, "pseudo_grad", counted)
    results = run_inproc([f"c{i}" for i in range(clusters)], config(mode, rule), flush_each_step=mode == "overlap")
    syncs = len(_syncs(results))
    assert syncs == 3 and {e["aggregation"] for e in _syncs(results)} == \
        {"sum" if rule == "edit_norm" else "gathered" if clusters <= 4 else "sketched"}
    assert len(calls) == UNITS and set(calls.values()) == {clusters * syncs}, calls
