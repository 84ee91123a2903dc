"""The `verified` rule judges what each cluster sent, in whole sync rounds of 3 clusters in one process: a
cluster whose transport corrupts its contribution (sign flip, random direction, ×10 with the true norm
reported, NaN) gets weight 0 at every sync of the fault, for the reason the event names, and one sync of
probation after it; the honest clusters share the update by tokens; nothing non-finite reaches an anchor."""

from __future__ import annotations

import math

import pytest
import torch

from edit_train.local_sgd.aggregator import Decision, Evidence
from edit_train.local_sgd.evidence import probe_judgement
from edit_train.local_sgd.aggregation.rules import RuleConfig, make_rule
from edit_train.local_sgd.aggregation.verified import VerifiedConfig, token_weights
from edit_train.sim.byzantine import ByzantineTransport, corrupt
from edit_train.sim.faults import FaultInjector
from toy_federation import H, config, max_diff, run_inproc

NAMES = ["c0", "c1", "c2"]
SYNCS = 20
START, END = 12 * H, 16 * H  # steps whose sends are corrupted: the syncs that start at steps 48..60
EXPECT = {"sign_flip": "direction", "random_direction": "direction", "lie_norm": "misreported",
          "nan_payload": "non_finite"}


def _byzantine(kind: str):  # type: ignore[no-untyped-def]
    faults = FaultInjector([{"kind": kind, "cluster": 1, "start": START, "end": END}], group=1, vocab_size=2)
    return lambda transport, step: ByzantineTransport(transport, faults, step)


@pytest.mark.parametrize("kind", sorted(EXPECT))
def test_a_corrupted_contribution_gets_weight_0_for_what_it_was(kind: str) -> None:
    results = run_inproc(NAMES, config("layerwise", "verified", syncs=SYNCS, warmup=2),
                         wraps={"c1": _byzantine(kind)}, shared_task=True, lr=0.01)  # still learning: a direction
    events = {n: [e for e in r.events if e["event"] == "sync"] for n, r in results.items()}
    faulty = [e for e in events["c1"] if START <= e["step"] < END]  # the syncs sent while the fault was on
    assert len(faulty) == 4, events["c1"]
    for e in faulty:
        assert e["weight"] == 0.0 and e["anomalous"], e
        reasons = {r for detail in e["anomaly_details"].values() for r in detail["reasons"]}
        assert EXPECT[kind] in reasons, (kind, e["anomaly_details"])
    for n in ("c0", "c2"):  # the honest clusters weigh by their token share (equal here): 1/3 each, and c1's
        for e in events[n]:  # third is a zero update (`left_out=zero`): the step is backed by 2/3 of the tokens
            if START <= e["step"] < END:
                assert e["weight"] == pytest.approx(1 / 3, rel=1e-6) and not e["anomalous"], e
    # after the fault, one sync of probation (its last update was corrupt and, without a probe here, did not
    # demonstrably help): c1 alone, for that reason alone; then it is back
    after = [e for e in events["c1"] if e["step"] >= END]
    assert after[0]["weight"] == 0.0
    assert {r for d in after[0]["anomaly_details"].values() for r in d["reasons"]} == {"probation"}
    assert after[1]["weight"] > 0.3 and not after[1]["anomalous"]
    clean = [e for n in NAMES for e in events[n] if not START <= e["step"] < END and e is not after[0]]
    assert not [e for e in clean if e["anomalous"]], "a false flag outside the fault"
    for n in NAMES:
        assert all(math.isfinite(float(t.abs().max())) for unit in results[n].anchors for t in unit)
        assert max_diff(results[n].anchors, results["c0"].anchors) == 0.0


def test_the_rule_on_crafted_contributions() -> None:
    """Exact flags and weights: a liar whose reported norm is not what it sent, a NaN sender, and tokens."""
    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, warmup_syncs=10)))
    norms = torch.tensor([1.0, 2.0, math.nan, 1.5], dtype=torch.float64)
    ev = Evidence("m", ("a", "b", "c", "d"), norms, torch.full((4,), 4.0, dtype=torch.float64), (True,) * 4,
                  {"finite": torch.tensor([True, True, False, True]), "exact": torch.tensor(True),
                   "reported": torch.tensor([1.0, 0.2, 1.0, 1.5], dtype=torch.float64),
                   "tokens": torch.tensor([100.0, 100.0, 100.0, 300.0], dtype=torch.float64)})
    d = rule.decide(ev)
    assert d.left_out == [False, True, True, False]
    # the left-out claims count at most the median accepted claim (100): 100 + 300 of 600 judged tokens
    assert d.weights == pytest.approx([1 / 6, 0.0, 0.0, 1 / 2])
    assert d.evidence[1]["reasons"] == ["misreported"] and d.evidence[2]["reasons"] == ["non_finite"]


def test_a_left_out_share_is_a_zero_update_or_goes_to_the_others() -> None:
    """`left_out=zero` (default): the accepted weights sum to the accepted share of the judged tokens;
    `others`: to 1 (EDiT's renormalisation). Either way a left-out cluster's weight is 0, and an exaggerated
    claim of a left-out cluster counts as the median accepted claim (it cannot shrink the others' step)."""
    tokens = torch.tensor([100.0, 100.0, 1e9, 200.0], dtype=torch.float64)
    accepted = torch.tensor([True, True, False, True])
    zero = token_weights(tokens, accepted, 8.0)
    assert zero.tolist() == pytest.approx([0.2, 0.2, 0.0, 0.4])  # 400 accepted of 400 + min(1e9, 100)
    assert token_weights(tokens, accepted, 8.0, "others").tolist() == pytest.approx([0.25, 0.25, 0.0, 0.5])
    everyone = torch.ones(4, dtype=torch.bool)
    assert token_weights(tokens, everyone, 8.0).tolist() == token_weights(tokens, everyone, 8.0, "others").tolist()
    assert token_weights(tokens, torch.zeros(4, dtype=torch.bool), 8.0).tolist() == [0.0] * 4
    assert token_weights(torch.zeros(3), torch.tensor([True, False, True]), 8.0).tolist() == \
        pytest.approx([1 / 3, 0.0, 1 / 3])  # no claims: one each
    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, left_out="others")))
    ev = Evidence("m", ("a", "b"), torch.ones(2, dtype=torch.float64), torch.full((2,), 4.0, dtype=torch.float64),
                  (True,) * 2, {"probe": torch.tensor([-0.05, 0.2], dtype=torch.float64)})
    assert rule.decide(ev).weights == [1.0, 0.0]
    with pytest.raises(ValueError, match="left_out"):
        VerifiedConfig(left_out="spread").validate()


def test_tokens_claims_are_capped() -> None:
    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, max_token_ratio=2.0)))
    ev = Evidence("m", ("a", "b", "c"), torch.ones(3, dtype=torch.float64), torch.full((3,), 4.0, dtype=torch.float64),
                  (True,) * 3, {"tokens": torch.tensor([100.0, 100.0, 1e9], dtype=torch.float64)})
    assert rule.decide(ev).weights == [0.25, 0.25, 0.5]  # 1e9 counts as 2 x the median (100)


def test_uniform_weighting_gives_every_accepted_cluster_the_same_share_whatever_it_claims() -> None:
    """`weighting=uniform` (sites whose data is their own): the accepted clusters weigh alike, a claim of 1e9 tokens
    buys nothing, a left-out cluster's share is still a zero update (`left_out=zero`) or the others' (`others`);
    a weighting the rule does not know is one line."""
    tokens = torch.tensor([100.0, 10.0, 1e9, 300.0], dtype=torch.float64)

    def weights(left_out: str, probe: list[float]) -> list[float]:
        rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, weighting="uniform",
                                                                             left_out=left_out)))
        ev = Evidence("m", ("a", "b", "c", "d"), torch.ones(4, dtype=torch.float64),
                      torch.full((4,), 4.0, dtype=torch.float64), (True,) * 4,
                      {"tokens": tokens, "probe": torch.tensor(probe, dtype=torch.float64)})
        return rule.decide(ev).weights

    assert weights("zero", [0.0] * 4) == [0.25] * 4
    assert weights("zero", [0.0, 0.0, 0.0, 0.5]) == [0.25, 0.25, 0.25, 0.0]  # d left out: its quarter is no update
    assert weights("others", [0.0, 0.0, 0.0, 0.5]) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    with pytest.raises(ValueError, match=r"weighting must be one of \('tokens', 'uniform'\), got 'speed'"):
        VerifiedConfig(weighting="speed").validate()


def test_a_cluster_corrupt_in_most_units_judged_so_far_is_held_in_the_rest_of_the_sync() -> None:
    """Within a sync: once most of the units judged so far (at least two) left a cluster out as corrupt (here: it
    misreported its norm), the rest of the sync holds it (`probation`) even where its unit looks clean; one corrupt
    unit holds nothing; the next sync starts on probation (half of the last one's units)."""
    norms = torch.ones(3, dtype=torch.float64)

    def unit(rule, name: str, sync: int, lie: bool):  # type: ignore[no-untyped-def]
        reported = torch.tensor([1.0, 0.2 if lie else 1.0, 1.0], dtype=torch.float64)
        ev = Evidence(name, ("a", "b", "c"), norms, torch.full((3,), 4.0, dtype=torch.float64), (True,) * 3,
                      {"finite": torch.ones(3, dtype=torch.bool), "exact": torch.tensor(True), "reported": reported,
                       "sync": torch.tensor(sync)})
        return rule.decide(ev)

    once = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, warmup_syncs=10)))
    assert unit(once, "u0", 1, True).left_out == [False, True, False]
    assert [unit(once, u, 1, False).left_out for u in ("u1", "u2", "u3")] == [[False] * 3] * 3
    twice = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, warmup_syncs=10)))
    assert unit(twice, "u0", 1, True).left_out == unit(twice, "u1", 1, True).left_out == [False, True, False]
    for u in ("u2", "u3", "u4", "u5", "u2"):  # clean units: held, "probation" — to the sync's end, and a unit
        d = unit(twice, u, 1, False)  # decided twice (a sketched SUM's provisional and final decision) counts once
        assert d.left_out == [False, True, False] and d.evidence[1]["reasons"] == ["probation"], d.evidence
    held = unit(twice, "u0", 2, False)
    assert held.left_out == [False, True, False] and held.evidence[1]["reasons"] == ["probation"]


def test_probe_medians_exclude_the_judged_cluster() -> None:
    scores = torch.tensor([[-9.0, 0.3, -0.1], [-0.2, 9.0, math.nan], [-0.4, 0.5, 9.0]], dtype=torch.float64)
    m, suspects = probe_judgement(scores, 1.0)  # rows: evaluators; columns: judged; the diagonal never counts
    # the lower median of the two other evaluators; one evaluator alone (column 2: row 1 measured nothing) is none
    assert m[0].item() == -0.4 and m[1].item() == 0.3 and math.isnan(m[2].item()) and suspects == {}


def test_an_update_that_hurt_the_others_probe_is_left_out() -> None:
    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0)))
    ev = Evidence("m", ("a", "b"), torch.ones(2, dtype=torch.float64), torch.full((2,), 4.0, dtype=torch.float64),
                  (True,) * 2, {"probe": torch.tensor([-0.05, 0.2], dtype=torch.float64)})
    d = rule.decide(ev)
    assert d.weights == [0.5, 0.0] and d.evidence[1]["reasons"] == ["useless"]


def test_corruptions_keep_or_break_what_they_should() -> None:
    gen = torch.Generator().manual_seed(0)
    t = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    norm = float(torch.sqrt(sum(x.pow(2).sum() for x in t)))
    r = corrupt("random_direction", t, gen)
    assert float(torch.sqrt(sum(x.pow(2).sum() for x in r))) == pytest.approx(norm, rel=1e-5)
    assert all(torch.equal(a, -b) for a, b in zip(corrupt("sign_flip", t, gen), t))
    assert all(torch.isnan(x).all() for x in corrupt("nan_payload", t, gen))


def _ev(module: str, sync: int, finite: list[bool], probe: list[float]) -> Evidence:
    n = len(finite)
    return Evidence(module, tuple(f"c{i}" for i in range(n)), torch.ones(n, dtype=torch.float64),
                    torch.full((n,), 4.0, dtype=torch.float64), (True,) * n,
                    {"finite": torch.tensor(finite), "sync": torch.tensor(sync),
                     "probe": torch.tensor(probe, dtype=torch.float64)})


def test_probation_follows_a_mostly_corrupt_sync_unless_the_update_helped() -> None:
    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0)))
    nan = math.nan
    # sync 5: c1 corrupt in 2 of 3 modules (a majority), c2 in 1 of 3
    for module, fin in (("a", [True, False, True]), ("b", [True, False, False]), ("c", [True, True, True])):
        rule.decide(_ev(module, 5, fin, [nan] * 3))
    # sync 6: c1 is held out of every module although what it sends now is fine; c2 is not
    d = rule.decide(_ev("a", 6, [True] * 3, [-0.1, 0.05, 0.0]))
    assert d.weights == pytest.approx([1 / 3, 0.0, 1 / 3]) and d.evidence[1]["reasons"] == ["probation"]
    assert rule.decide(_ev("c", 6, [True] * 3, [-0.1, 0.05, 0.0])).weights == pytest.approx([1 / 3, 0.0, 1 / 3])
    # its update of sync 5 demonstrably helped the others (probe <= 0): no probation
    rule2 = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0)))
    meta, tensors = rule.state()
    rule2.load(meta, tensors)
    rule2.probation, rule2.sync = {"c1"}, 6  # as if sync 6 were being decided afresh
    assert rule2.decide(_ev("b", 6, [True] * 3, [-0.1, -0.02, 0.0])).weights == pytest.approx([1 / 3] * 3)
    # sync 7 after a clean sync 6: nobody on probation; a gap in the syncs clears it too
    assert rule.decide(_ev("a", 7, [True] * 3, [nan] * 3)).weights == pytest.approx([1 / 3] * 3)
    for module in ("a", "b"):
        rule.decide(_ev(module, 8, [True, False, True], [nan] * 3))
    assert rule.decide(_ev("a", 10, [True] * 3, [nan] * 3)).weights == pytest.approx([1 / 3] * 3)


def test_probation_and_pooled_direction_state_round_trip() -> None:
    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0)))
    for module in ("a", "b"):
        rule.decide(_ev(module, 3, [True, False, True], [math.nan] * 3))
    rule.decide(_ev("a", 4, [True] * 3, [math.nan] * 3))
    meta, tensors = rule.state()
    other = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0)))
    other.load(meta, tensors)
    assert other.probation == {"c1"} and other.sync == 4 and other.tally == rule.tally
    d1, d2 = rule.decide(_ev("b", 4, [True] * 3, [math.nan] * 3)), other.decide(_ev("b", 4, [True] * 3, [math.nan] * 3))
    assert d1.weights == d2.weights and d1.weights[1] == 0.0
    with pytest.raises(ValueError, match="probation"):
        other.load({**meta, "tally": {"c0": [1, "x"]}}, tensors)


def test_a_pair_keeps_a_cluster_that_stays_wrong_on_probation() -> None:
    """Two clusters. c1 turns its direction around (cosine −0.9 with c0 instead of 0.9) in modules a and b from
    sync 7 on: flagged (the reference breaks the pair's tie), then on probation — and while on probation it is
    still judged against c0, so at sync 9 it is held again and its small module c, which looks fine, is not
    let in. Once everything it sends looks right again (sync 10), it is back at sync 11. Within sync 7 already, c
    is held: both units judged before it left c1 out as corrupt (`VerifiedRule._turned`)."""
    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=4, warmup_syncs=2)))
    u = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)

    def ev(module: str, sync: int, cos: float) -> Evidence:
        gram = torch.tensor([[1.0, cos], [cos, 1.0]], dtype=torch.float64)
        return Evidence(module, ("c0", "c1"), torch.ones(2, dtype=torch.float64),
                        torch.full((2,), 4.0, dtype=torch.float64), (True, True),
                        {"finite": torch.tensor([True, True]), "sync": torch.tensor(sync), "gram": gram,
                         "sketches": [u, u if cos > 0 else -u]})

    def sync(k: int, wrong: tuple[str, ...]) -> dict[str, Decision]:
        return {m: rule.decide(ev(m, k, -0.9 if m in wrong else 0.9)) for m in ("a", "b", "c")}

    for k in range(1, 7):
        assert all(d.weights == [0.5, 0.5] for d in sync(k, ()).values())
    d7 = sync(7, ("a", "b"))
    assert d7["a"].weights == [0.5, 0.0] and "direction" in d7["a"].evidence[1]["reasons"]
    assert d7["c"].weights == [0.5, 0.0] and d7["c"].evidence[1]["reasons"] == ["probation"]
    for k in (8, 9):  # held out of every module, small module c included
        d = sync(k, ("a", "b"))
        assert all(x.weights == [0.5, 0.0] for x in d.values()), k
        assert "probation" in d["c"].evidence[1]["reasons"]
    assert all(x.weights == [0.5, 0.0] for x in sync(10, ()).values())  # still on probation from sync 9
    assert all(x.weights == [0.5, 0.5] for x in sync(11, ()).values())


def test_the_probe_scores_the_others_and_not_itself() -> None:
    """One forward of the anchor plus one per *other* participant: its own score would never be read."""
    from torch import nn

    from edit_train.local_sgd.sync.probe import Probe
    from edit_train.local_sgd.protocols import Contributions
    from edit_train.local_sgd.sync.round import build_units

    model = nn.Linear(3, 2)
    units = build_units(model, [])
    calls: list[float] = []

    def loss() -> float:
        calls.append(float(model.weight.sum()))
        return 1.0 + float(model.weight.abs().sum())

    probe = Probe(units, loss, me="b")
    anchor = [p.detach().clone() for p in units[0].live()]
    parts = [[torch.full_like(p, float(i + 1)) for p in anchor] for i in range(3)]
    probe.keep(units[0].name, anchor, Contributions(parts))
    probe.committed(["a", "b", "c"])
    before = [p.detach().clone() for p in model.parameters()]
    probe.score()
    assert len(calls) == 3  # the anchor, a and c
    assert set(probe.scores) == {"a", "c"} and math.isnan(probe.row(["a", "b", "c"])[1])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # live parameters restored


def test_a_cluster_on_probation_stays_on_it_while_any_unit_is_still_flagged() -> None:
    """Issue 65: at two clusters a garbage-data site stopped standing out in most units after some syncs and was
    trusted again while one unit was still flagged. Now probation goes on while any unit is corrupt; it starts
    only after at least half were, and ends after a clean sync."""
    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0)))
    nan = math.nan
    for module, fin in (("a", [True, False, True]), ("b", [True, False, False]), ("c", [True, True, True])):
        rule.decide(_ev(module, 5, fin, [nan] * 3))  # c1: 2 of 3 corrupt; c2: 1 of 3
    for module, fin in (("a", [True, False, True]), ("b", [True, True, False]), ("c", [True, True, True])):
        rule.decide(_ev(module, 6, fin, [nan] * 3))  # c1 on probation, still 1 of 3 corrupt; c2 again 1 of 3
    d = rule.decide(_ev("c", 7, [True] * 3, [nan] * 3))
    assert rule.probation == {"c1"} and d.weights == pytest.approx([1 / 3, 0.0, 1 / 3])
    for module in ("a", "b"):
        rule.decide(_ev(module, 7, [True] * 3, [nan] * 3))  # a clean sync: off probation at the next
    assert rule.decide(_ev("a", 8, [True] * 3, [nan] * 3)).weights == pytest.approx([1 / 3] * 3)
    assert rule.probation == set()


def test_a_state_with_the_retired_own_past_statistics_loads_without_them() -> None:
    """A checkpoint written before the pair test read the reference (issue 65's first pair test kept each
    cluster's own past: "self/<unit>" statistics and "ref/<unit>#<row>" sketches) loads; the pair's accused
    round-trips, and a bad one is one line."""
    from edit_train.local_sgd.penalty_stats import EWMAStats

    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=4)))
    rule.decide(_ev("a", 1, [True] * 3, [math.nan] * 3))
    meta, tensors = rule.state()
    old = dict(tensors)
    for f in EWMAStats.FIELDS:
        old[f"self/a/{f}"] = torch.zeros(3, dtype=torch.int64 if f in ("count", "streak") else torch.float64)
    old["ref/a#1"] = torch.ones(4, dtype=torch.float64)
    other = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=4)))
    other.load({k: v for k, v in meta.items() if k != "accused"}, old)
    assert not [k for k in other.direction.stats if k.startswith("self/")] and "a#1" not in other.direction.refs
    rule.direction.accused = {"a": 2}
    meta, tensors = rule.state()
    other.load(meta, tensors)
    assert other.direction.accused == {"a": 2}
    with pytest.raises(ValueError, match="accused"):
        other.load({**meta, "accused": {"a": 7}}, tensors)
