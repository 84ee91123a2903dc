"""Taking back an admitted update the probe then shows harmful (`local_sgd/aggregation/retract.py`), one sync late."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch

from edit_train.cluster.group import RankGroup
from edit_train.federation.inproc import InProcessFederation
from edit_train.local_sgd.sync.outer import OuterConfig, OuterState
from edit_train.local_sgd.aggregation.retract import NONE, Applied, Retraction, marker_of
from toy_federation import H, LR, Outcome, config, toy_model, train_cluster

NAMES = ["c0", "c1", "c2"]  # c2 hurts; the probe needs two other evaluators to agree


def f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _run(mode: str, retract: bool, lr1: float, syncs: int = 2) -> dict[str, Outcome]:
    """3 toy clusters with the usefulness probe (outer SGD lr 1, no momentum, no clipping): c2 trains with
    inner lr `lr1` (far above the others' LR: an update that hurts c0's and c1's probe slices)."""
    hub = InProcessFederation(min_clusters=1, join_timeout_s=30.0, timeout_s=30.0)
    cfg = config(mode, "verified", syncs=syncs, phi=1e9, lr=1.0, momentum=0.0, nesterov=False)
    verified = dataclasses.replace(cfg.rule.verified, retract=retract, probe_tokens=8)
    # scale_bound 0: the harmful update is admitted whole at the first sync (what the retraction takes back)
    cfg = dataclasses.replace(cfg, rule=dataclasses.replace(cfg.rule, verified=verified, scale_bound=0.0))
    outs = {n: Outcome() for n in NAMES}
    threads = [threading.Thread(target=train_cluster, args=(i, hub.transport(n, RankGroup()), cfg),
                                kwargs={"out": outs[n], "probe": True, "lr": (LR, LR, lr1)[i], "snapshot_at": (H - 1,),
                                        "flush_each_step": mode == "overlap"})
               for i, n in enumerate(NAMES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outs


def _syncs(out: Outcome) -> list[dict]:
    return [e for e in out.events if e["event"] == "sync"]


@pytest.mark.parametrize("mode", ["layerwise", "at_end", "overlap"])
def test_a_harmful_update_is_taken_back_exactly(mode: str) -> None:
    """Sync 1 admits c2's update (weight ⅓: nothing is warm yet, the probe has not scored it); at sync 2 the
    probes of c0 and c1 show it raised their loss, c2 weighs 0 and its sync-1 term ⅓·Δ₂ is taken back: with outer
    SGD lr 1 the anchor after sync 2 differs from a run without retraction by exactly ⅓·(θ̄₀ − θ₂), θ₂ = c2's
    replica at sync 1 (up to sync 2 both runs trained the same)."""
    on, off = _run(mode, True, 1.0), _run(mode, False, 1.0)
    for out in on.values():
        syncs = _syncs(out)
        assert [s["sync"] for s in syncs] == [1, 2] and syncs[0]["retracted"] == {}
        assert syncs[1]["retracted"].keys() == {"c2"} and syncs[1]["retracted"]["c2"]["sync"] == 1
        assert syncs[1]["retracted"]["c2"]["probe"] > 0.1
    assert [s["weight"] for s in _syncs(on["c2"])] == [pytest.approx(1 / 3), 0.0]
    assert all(s["retracted"] == {} for out in off.values() for s in _syncs(out))
    init = [p.detach() for p in toy_model().parameters()]
    theta1 = on["c2"].snapshots[H - 1]["params"]  # c2's replica when sync 1 was taken
    flat_on = [a for unit in on["c0"].anchors for a in unit]
    flat_off = [a for unit in off["c0"].anchors for a in unit]
    for a, b, p0, p1 in zip(flat_on, flat_off, init, theta1):
        torch.testing.assert_close(a - b, (p0 - p1) / 3, rtol=0, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(flat_on, [a for u in on["c2"].anchors for a in u]))


def test_each_harmful_update_is_taken_back_once_and_an_honest_run_is_untouched() -> None:
    """Sync 2 already left c2 out, so sync 3 takes nothing back; and when nobody hurts the others' probe, a run
    with retraction is bit-identical to one without."""
    bad = _run("layerwise", True, 1.0, syncs=3)
    assert [s["retracted"].keys() for s in _syncs(bad["c0"])] == [set(), {"c2"}, set()]
    on, off = _run("layerwise", True, LR, syncs=3), _run("layerwise", False, LR, syncs=3)
    assert all(s["retracted"] == {} for out in on.values() for s in _syncs(out))
    for u_on, u_off in zip(on["c0"].anchors, off["c0"].anchors):
        assert all(torch.equal(a, b) for a, b in zip(u_on, u_off))


def _applied() -> Applied:
    a = Applied(4, marker_of("q4"), ["a", "b", "c"])
    parts = [[torch.full((3,), 1.0)], [torch.full((3,), 10.0)], [torch.full((3,), 100.0)]]
    a.add("u", parts, [0.25, 0.25, 0.5])
    a.clipped("u", 0.5)
    a.add("v", parts, [1.0, 0.0, 0.0])
    a.clipped("v", 1.0)
    return a


def test_plan_needs_every_participant_to_name_the_same_round() -> None:
    r = Retraction(0.1)
    assert r.marker == NONE and r.plan(["a", "b"], f64(NONE, NONE), f64(9.0, 9.0)) == {}
    r.committed(_applied())
    m = marker_of("q4")
    assert m == r.marker and m != marker_of("q5") and m >= 0 and m == math.floor(m)
    probe = f64(0.05, 0.5, math.nan)
    assert r.plan(["a", "b", "c"], f64(m, m, m), probe) == {"b": 0.5}
    # one participant recorded another round (it missed this one, restarted or healed): nobody takes back
    assert r.plan(["a", "b", "c"], f64(m, m, marker_of("q3")), probe) == {}
    # a cluster that is no longer in the quorum cannot be judged; one that weighed 0 everywhere has nothing to take
    assert r.plan(["a", "c"], f64(m, m), f64(0.0, 0.9)) == {"c": 0.9}
    assert r.described({"c": 0.9}) == {"c": {"sync": 4, "probe": 0.9}}
    r.committed(_applied())
    r.last.units["u"][1][2] = 0.0  # type: ignore[union-attr]
    assert r.plan(["a", "c"], f64(m, m), f64(0.0, 0.9)) == {}


def test_term_is_what_the_round_added_for_those_clusters() -> None:
    r = Retraction(0.1)
    r.committed(_applied())
    # u: c·Σ w·Δ over b and c = 0.5·(0.25·10 + 0.5·100); v: b and c weighed 0 there
    assert torch.equal(r.term("u", {"b": 1.0, "c": 1.0})[0], torch.full((3,), 0.5 * (2.5 + 50.0)))  # type: ignore[index]
    assert r.term("v", {"b": 1.0, "c": 1.0}) is None and r.term("u", {}) is None
    assert r.term("w", {"b": 1.0}) is None


def test_through_nesterov_momentum_a_retraction_cancels() -> None:
    """g at one step and −g at the next: with Nesterov momentum 0.8 the anchor returns to where it would be
    without either (the parameter moves are linear in the pseudo-gradients) once the momentum has decayed."""
    start = [torch.tensor([1.0, -2.0, 3.0])]
    outer = OuterState({"u": [start[0].clone()]}, OuterConfig(lr=0.7, momentum=0.8, nesterov=True))
    g = torch.tensor([0.3, 0.1, -0.2])
    outer.step("u", [g])
    outer.step("u", [-g])
    for _ in range(80):
        outer.step("u", [torch.zeros(3)])
    torch.testing.assert_close(outer.anchors["u"][0], start[0], rtol=0, atol=1e-6)
