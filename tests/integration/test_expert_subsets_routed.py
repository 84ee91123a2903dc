"""Expert subsets assigned by routing (issue 54, `algo.rule.verified.expert_subsets=routed`): the balanced
greedy-by-share map in closed form and as a property, one map on every cluster from the exchanged counts of the
warm-up, each expert's update from its owner alone after it, the unowned rows back on the anchor after every
sync, and the map kept by a checkpoint and carried by a heal."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edit_train.local_sgd.moe.assignment import RoutedAssignment, routed_owners
from edit_train.local_sgd.moe.experts import RoutedCounts, owned_counts
from edit_train.cluster.group import RankGroup
from edit_train.federation import heal
from edit_train.federation.inproc import InProcessFederation
from toy_federation import H, Outcome, config, run_inproc, toy_model, units_of

NAMES = ["c0", "c1", "c2"]
E, ROWS = 4, 6  # unit "2" (Linear 24x24) cut into 4 experts of 6 rows (as tests/local_sgd/test_expert_sync.py)
COUNTS = torch.tensor([[12, 4, 0, 0], [0, 8, 8, 0], [8, 8, 16, 0]], dtype=torch.int64)
MAP = {"c0": (0,), "c1": (1, 2), "c2": (3,)}  # worked below (the toy has one MoE layer: unit "2")


def test_routed_owners_in_closed_form() -> None:
    # shares: c0 .75 .25 0 0 | c1 0 .5 .5 0 | c2 .25 .25 .5 0; quotas 1, 1, 1 and one cluster 2 (4 over 3).
    # Ranked: c0e0 .75, c1e1 .5, c1e2 .5 (c1 reaches 2: the one above), c2e2 .5 (taken), the .25s (taken or c0
    # full), the 0s in order: c2e3 — c2 gets the expert nobody routed to
    assert routed_owners(COUNTS) == (0, 1, 1, 2)
    assert routed_owners(torch.tensor([[40, 30, 20, 10], [5, 5, 45, 45]])) == (0, 0, 1, 1)
    assert routed_owners(torch.tensor([[70, 20, 6, 4], [25, 25, 25, 25]])) == (0, 1, 1, 0)  # c0 full at 2
    assert routed_owners(torch.zeros(2, 4)) == (0, 0, 1, 1)  # nothing routed: ties by cluster, then expert
    assert routed_owners(torch.tensor([[5, 1]])) == (0, 0)  # one cluster owns everything
    assert routed_owners(torch.tensor([[1, 0], [0, 1], [1, 1]])) == (0, 1)  # more clusters than experts


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 12), st.data())
def test_routed_owners_gives_every_expert_one_owner_balanced(clusters: int, experts: int, data: st.DataObject) -> None:
    counts = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 50), min_size=experts, max_size=experts),
                                             min_size=clusters, max_size=clusters)))
    owner = routed_owners(counts)
    assert len(owner) == experts and all(0 <= o < clusters for o in owner)
    sizes = sorted(owner.count(c) for c in range(clusters))
    low, extra = divmod(experts, clusters)
    assert sizes == [low] * (clusters - extra) + [low + 1] * extra


def _experts(owned: tuple[tuple[bool, ...], ...] | None) -> list[tuple[int, ...]]:
    assert owned is not None
    return [tuple(e for e, o in enumerate(layer) if o) for layer in owned]


def test_the_map_is_decided_layer_by_layer_after_the_warm_up_and_round_trips_through_json() -> None:
    a = RoutedAssignment(2)
    layers = torch.stack([COUNTS, COUNTS.flip(0), COUNTS], 1)  # [P, L, E]: layer 1 routes as if c0 and c2 swapped
    assert not a.observe(NAMES, layers) and a.owned("c0", E) is None  # the warm-up trains every expert
    assert a.observe(NAMES, layers) and a.decided
    # layer 1: shares c0 .25 .25 .5 0 | c1 0 .5 .5 0 | c2 .75 .25 0 0 — c2 takes e0, c0 e2 (first of the .5s), c1
    # e1; of the 0s c0 is first to take its second expert: e3
    flipped = {"c0": (2, 3), "c1": (1,), "c2": (0,)}
    for n in NAMES:
        assert _experts(a.owned(n, E)) == [MAP[n], flipped[n], MAP[n]], n  # each layer its own map
    assert a.owned("c9", E) is None  # a cluster the map does not name trains and sends every expert
    assert not a.observe(NAMES, layers * 0)  # decided once
    again = RoutedAssignment(2)
    again.load(json.loads(json.dumps(a.state_json())))  # what a checkpoint or a heal carries: JSON
    assert again.owners == a.owners and again.seen == 2 and again.counts == a.counts
    with pytest.raises(ValueError, match="warm-up of >= 1 sync"):
        RoutedAssignment(0)


def test_counts_sum_per_cluster_name_over_the_warm_up_whatever_the_quorum_order() -> None:
    a = RoutedAssignment(2)
    a.observe(["c1", "c0"], torch.tensor([[[0, 0, 9, 9]], [[9, 9, 0, 0]]]))
    a.observe(["c0", "c1"], torch.tensor([[[1, 0, 0, 0]], [[0, 0, 0, 1]]]))
    assert a.counts == {"c0": [[10.0, 9.0, 0.0, 0.0]], "c1": [[0.0, 0.0, 9.0, 10.0]]}
    assert a.owners == {"c0": ((0, 1),), "c1": ((2, 3),)}


def test_owned_counts_and_frozen_rows_take_a_mask_per_layer() -> None:
    from edit_train.local_sgd.moe.experts import layer_mask

    owned = ((True, False), (False, True))
    assert layer_mask(owned, 1) == (False, True) and layer_mask((True, False), 1) == (True, False)
    assert owned_counts(torch.tensor([[3, 4], [5, 6]]), owned).tolist() == [[3, 0], [0, 6]]
    assert owned_counts(torch.tensor([[3, 4], [5, 6]]), (True, False)).tolist() == [[3, 0], [5, 0]]


# ------------------------------------------------------------------------------------------ whole rounds
def _pieces(name: str, _module: object, _params: object) -> tuple[int, list[list[tuple[int, slice]]]] | None:
    return (0, [[(0, slice(ROWS * e, ROWS * (e + 1))), (1, slice(ROWS * e, ROWS * (e + 1)))] for e in range(E)]) \
        if name == "2" else None


def _run(syncs: int, warmup: int) -> dict[str, Outcome]:
    """Three toy clusters, the verified rule with token weights and `routed` after `warmup` syncs; each reports
    COUNTS per interval, 0 for the experts it does not own once the map reaches it (what `RoutedTally` does)."""
    cfg = config("at_end", "verified", syncs=syncs, phi=1e9, lr=1.0, momentum=0.0, nesterov=False)
    v = cfg.rule.verified
    v.expert_weights, v.expert_subsets, v.expert_subsets_syncs = "tokens", "routed", warmup
    hub = InProcessFederation(min_clusters=1, join_timeout_s=30.0, timeout_s=30.0)
    outs = {n: Outcome() for n in NAMES}

    def routed(i: int) -> RoutedCounts:
        def take() -> torch.Tensor:
            algo = outs[NAMES[i]].algo
            return owned_counts(COUNTS[i][None], algo.owned_experts(E) if algo is not None else None)
        return RoutedCounts(take, _pieces)

    return run_inproc(NAMES, cfg, hub=hub, outs=outs, routed=routed,
                      after_at=tuple(k * H - 1 for k in range(1, syncs + 1)))


def test_after_the_warm_up_each_expert_takes_its_owners_delta_alone_and_the_rest_stays_on_the_anchor() -> None:
    outs = _run(syncs=3, warmup=1)
    for n, out in outs.items():
        assert out.algo is not None and out.algo.assignment is not None
        assert out.algo.assignment.owners == {c: (v,) for c, v in MAP.items()}, n  # one map everywhere
        weights = [e["expert_weights"]["2"] for e in out.events if e["event"] == "sync"]
        assert len(weights) == 3
        assert weights[0] == pytest.approx([0.75, 0.25, 0.0, 0.0] if n == "c0" else  # the warm-up: token weights
                                           [0.0, 0.5, 0.5, 0.0] if n == "c1" else [0.25, 0.25, 0.5, 0.0])
        mine = [1.0 if e in MAP[n] and COUNTS[NAMES.index(n), e] > 0 else 0.0 for e in range(E)]
        assert weights[1] == weights[2] == mine, n  # after it: an expert's update is its owner's Δ alone
        # the rows of the experts it does not own are the anchor's after every sync after the decision
        # (`ExpertRows.unowned_to_anchor`; without it they would hold θ̄ − Δ, the Δ they did not send: this toy
        # trains them on, the trainer freezes them)
        for k in (2, 3):
            after = out.snapshots[("after", k * H - 1)]
            live, anchor = [after["params"][i] for i in UNIT2], after["anchor"][1]
            on = [all(torch.equal(p[ROWS * e:ROWS * (e + 1)], a[ROWS * e:ROWS * (e + 1)]) for p, a in zip(live, anchor))
                  for e in range(E)]
            assert all(on[e] for e in range(E) if e not in MAP[n]), (n, k, on)


UNIT2 = [i for i, (name, _) in enumerate(toy_model().named_parameters()) if name.startswith("2.")]


def test_where_the_map_first_applies_the_unowned_rows_take_the_anchor_and_the_owned_keep_their_progress() -> None:
    """`LocalSGD.to_anchor`: what the trainer calls when the map reaches it (decided, healed, resumed), between a
    backward and the optimizer step."""
    outs = _run(syncs=1, warmup=1)
    algo = outs["c1"].algo
    assert algo is not None and algo.driver is not None
    unit = algo.replica.units[1]
    anchor = algo.driver.core.outer.anchors[unit.name]
    with torch.no_grad():
        for p in unit.params:
            p.add_(1.0)  # progress on every row since the sync
    assert algo.to_anchor() == 2 * ROWS * 25  # experts 0 and 3 (c1 owns 1, 2): 6 rows of 24 + 1 values each
    for p, a in zip(unit.params, anchor):
        for e in range(E):
            rows = slice(ROWS * e, ROWS * (e + 1))
            assert torch.equal(p[rows], a[rows] + 1.0) if e in MAP["c1"] else torch.equal(p[rows], a[rows]), e
    assert outs["c0"].algo is not None and outs["c0"].algo.to_anchor() == 3 * ROWS * 25  # c0 owns expert 0 only


def test_the_map_survives_a_checkpoint_and_a_heal() -> None:
    from edit_train.local_sgd.sync.algorithms import LocalSGD

    outs = _run(syncs=2, warmup=1)
    src = outs["c0"].algo
    assert src is not None
    saved = json.loads(json.dumps(src.state.json()))  # the checkpoint's sync state is JSON
    assert saved["assignment"]["owners"] == {n: [list(v)] for n, v in MAP.items()}
    cfg = src.cfg
    fresh_hub = InProcessFederation(min_clusters=1, join_timeout_s=5.0, timeout_s=5.0)

    def fresh() -> LocalSGD:
        model = toy_model()
        return LocalSGD(cfg, model, units_of(model), fresh_hub.transport("c1", RankGroup()),
                        (heal.encode, heal.decode), cluster_index=1,
                        routed_counts=RoutedCounts(lambda: COUNTS[1][None], _pieces))

    resumed = fresh()
    assert resumed.owned_experts(E) is None
    resumed.state.load(src.state.tensors(), saved)
    assert resumed.owned_experts(E) == ((False, True, True, False),)  # a resumed cluster keeps its experts
    meta, local = src.state.heal_out()
    healed = fresh()
    healed.state.heal_in(json.loads(json.dumps(meta)), {k: t for k, (t, _like) in local.items()})
    assert healed.owned_experts(E) == ((False, True, True, False),)  # a healed one takes the source's map


def test_a_two_cluster_run_follows_the_routed_map(tmp_path, small_corpus: str) -> None:
    """What a user runs: `edit-train` with two clusters on the tiny MoE. After 2 syncs both clusters name the same
    map (per MoE layer a partition of the 8 experts, 4 each) in one `expert_subsets` event; from then on each
    cluster's expert weights are 0 on the experts it does not own, and its checkpoint keeps the map."""
    from conftest import read_events, run_cli, tiny_overrides

    run = tmp_path / "run"
    routed = ["algo=edit", "cluster.count=2", "cluster.ranks=1", "train.steps=16", "algo.interval=4",
              "algo.warmup_steps=0", "train.eval_every=0", "train.batch_size=4", "checkpoint.at_end=true",
              "algo.rule.verified.expert_weights=tokens", "algo.rule.verified.expert_subsets=routed",
              "algo.rule.verified.expert_subsets_syncs=2"]
    proc = run_cli("edit-train", "edit_train.cli.train", tiny_overrides(run, small_corpus, *routed), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = read_events(run / "metrics.jsonl")
    decided = {e["cluster"]: e["experts"] for e in events if e["event"] == "expert_subsets"}
    assert sorted(decided) == ["c0", "c1"] and len(decided["c0"]) == 3  # the tiny model's 3 MoE layers
    for layer in range(3):
        assert sorted(decided["c0"][layer] + decided["c1"][layer]) == list(range(8))
        assert len(decided["c0"][layer]) == len(decided["c1"][layer]) == 4
    for e in (e for e in events if e["event"] == "sync" and e["sync"] > 2):
        for layer, (unit, w) in enumerate(sorted(e["expert_weights"].items())):  # layers.1, .2, .3
            assert all(w[x] == 0.0 for x in range(8) if x not in decided[e["cluster"]][layer]), (e["sync"], unit)
    for c in ("c0", "c1"):
        state = json.loads(next((run / "checkpoints" / c).glob("step_*/rank0-state.json")).read_text())
        assert state["algo"]["assignment"]["owners"] == decided


def test_edit_train_info_plans_a_routed_map_at_splits_sizes_and_says_so() -> None:
    from edit_train.cli.common import compose
    from edit_train.cli.info import estimate

    base = ["logger=none", "algo=edit", "algo.rule.verified.expert_weights=tokens", "experiment=noniid_lang_2"]
    routed = estimate(compose([*base, "algo.rule.verified.expert_subsets=routed"]))["expert_subsets"]
    split = estimate(compose([*base, "algo.rule.verified.expert_subsets=split"]))["expert_subsets"]
    for c in ("c0", "c1"):
        assert "decided at run time" in routed[c]["experts"]
        assert {k: v for k, v in routed[c].items() if k != "experts"} == \
            {k: v for k, v in split[c].items() if k != "experts"}
