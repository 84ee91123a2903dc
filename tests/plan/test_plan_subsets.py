"""The planner knows expert subsets (issue 54; `scenario.expert_subsets`, off by default): the bytes each cluster
sends per sync leave its unowned experts' rows at home — the same figures `edit-train-info` reports
(`expert_plan.subsets_plan`) and the traffic formula's —, the sync time follows from them, the memory estimate
counts the frozen rows' copy and saves no optimizer state, and the planner never turns them on by itself."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from edit_train.plan import hardware, report, traffic
from edit_train.plan.costs import resolve
from edit_train.plan.planner import Candidate, make_plan, memory_gb, overrides
from edit_train.plan.profile import Profile
from edit_train.plan.spec import PlanError, scenario_from_dict

SUBSETS = ("algo=edit", "algo.rule.verified.expert_weights=tokens")


def _cfg(*overrides: str):
    from edit_train.cli.common import compose

    return compose(["logger=none", *overrides])


def _scenario(clusters: int = 2, ranks: int = 1, subsets_spec: str = "split", **extra) -> dict:
    return {"name": "t", "model": "tiny", "hours": 1, "expert_subsets": subsets_spec,
            "clusters": [{"name": f"c{i}", "ranks": ranks, "step_s": 0.05} for i in range(clusters)],
            "link": {"bandwidth_mbps": 10, "latency_ms": 50},
            "candidates": {"algos": ["diloco", "edit"], "modes": ["at_end"], "compressions": ["none", "int8"],
                           "intervals": [8]}, **extra}


@pytest.mark.parametrize("experiment, spec", [("noniid_lang_2", "split"), ("noniid_lang_4", "0+1+2+3|4+5|6|7")])
def test_the_planned_bytes_per_sync_are_edit_train_infos_and_the_formulas(experiment, spec):
    """Per cluster, the bytes per sync the simulator charges with subsets = expert_plan's (real model, exact) =
    traffic.sync_bytes with the unowned rows unsent; every expert sent costs exactly (P − 1) · 4 · unsent more
    (fp32, gathered: each of the P − 1 others receives the rows)."""
    from edit_train.expert_plan import subsets_plan

    cfg = _cfg(*SUBSETS, f"experiment={experiment}", f"algo.rule.verified.expert_subsets='{spec}'")
    info = subsets_plan(cfg)
    assert hardware.model_facts(dataclasses.asdict(cfg.model)).units == hardware.model_facts("tiny").units
    world = len(info)
    scn = scenario_from_dict(_scenario(world, subsets_spec=spec))
    fed = resolve(scn, Profile.default())
    members = np.arange(world)
    cand = Candidate("edit", "at_end", "none", 8, subsets=spec)
    on = fed.sync_cost(members, cand)["bytes"]
    off = fed.sync_cost(members, dataclasses.replace(cand, subsets=""))["bytes"]
    plan = make_plan(scn, quick=True)
    for i, name in enumerate(fed.names):
        unsent = info[name]["unsent_params_per_sync"]
        assert int(fed.home[i].sum()) == unsent > 0
        formula = traffic.sync_bytes(fed.facts.unit_sizes, world, "none", unsent=list(fed.home[i]))
        assert on[i] == info[name]["bytes_per_sync"] == formula == plan.subsets["clusters"][name]["bytes_per_sync"]
        assert off[i] - on[i] == (world - 1) * 4 * unsent == info[name]["bytes_saved_per_sync"]
    if spec != "split":  # unequal shares: the cluster owning fewest experts leaves most at home
        assert on[0] > on[1] > on[2] == on[3]


def test_the_sync_time_follows_the_bytes_and_the_recommendation_runs_them():
    """On a slow link the subsets' fewer bytes make a shorter sync and more tokens/s than the same candidate
    sending every expert; a recommendation that carries them composes as an `edit-train` config it accepts."""
    from edit_train.cli.common import compose
    from edit_train.config import validate

    scn = scenario_from_dict(_scenario(candidates={"algos": ["edit"], "modes": ["at_end"], "compressions": ["none"],
                                                   "intervals": [8]}))
    plain = scenario_from_dict({**_scenario(subsets_spec=""), "candidates": scn.candidates})
    with_, without = make_plan(scn, quick=True), make_plan(plain, quick=True)
    assert with_.best.cand.subsets == "split" and not without.best.cand.subsets
    for c in with_.subsets["clusters"].values():
        assert c["at_end_sync_s"] < c["at_end_sync_s_every_expert"]
    assert with_.best.bytes_per_token < without.best.bytes_per_token
    assert with_.best.tokens_per_s > without.best.tokens_per_s
    assert "algo.rule.verified.expert_subsets=split" in with_.overrides
    validate(compose(["logger=none", *with_.overrides]))


def test_the_memory_estimate_counts_the_frozen_copy_and_no_optimizer_saving():
    """Per rank: + 4 · unsent // ranks bytes (the fp32 copy `FrozenRows` holds through each optimizer step),
    nothing else (the stacked experts keep their one AdamW state); the most any cluster holds is what
    `edit-train-info`'s memory plan counts; a cluster whose memory only fits without the copy does not fit."""
    from edit_train.memplan import plan_for_config

    spec = "0+1+2+3+4+5|6+7"
    scn = scenario_from_dict(_scenario(2, ranks=2, subsets_spec=spec))
    fed = resolve(scn, Profile.default())
    cand = Candidate("edit", "at_end", "none", 8, subsets=spec)
    plain = dataclasses.replace(cand, subsets="")
    plan = make_plan(scn, quick=True)
    for i, name in enumerate(fed.names):
        unsent = int(fed.home[i].sum())
        figures = plan.subsets["clusters"][name]
        assert figures["frozen_copy_bytes_per_rank"] == 4 * unsent // 2
        assert figures["optimizer_bytes_saved_per_rank"] == 0
        extra = (memory_gb(fed, cand, i) - memory_gb(fed, plain, i)) * 1e9
        assert extra == pytest.approx(4 * unsent / 2, rel=1e-9)
        assert figures["memory_gb_per_rank"] == memory_gb(fed, cand, i)
    held = max(c["frozen_copy_bytes_per_rank"] for c in plan.subsets["clusters"].values())
    cfg = _cfg(*SUBSETS, "experiment=noniid_lang_2", f"algo.rule.verified.expert_subsets='{spec}'",
               "cluster.ranks=2")
    assert plan_for_config(cfg)["bytes"]["frozen_rows"] == held  # c1 leaves 6 of 8 experts at home
    tight = (memory_gb(fed, plain, 1) + memory_gb(fed, cand, 1)) / 2 / 0.9  # between the two
    clusters = [{"name": f"c{i}", "ranks": 2, "step_s": 0.05, "memory_gb": tight} for i in range(2)]
    squeezed = make_plan(scenario_from_dict({**_scenario(2, 2, spec), "clusters": clusters}), quick=True)
    assert {r.cand.label: r.fits for r in squeezed.rows} == {
        "edit/at_end/none+subsets/H=8": False, "edit/at_end/int8/H=8": True, "diloco/at_end/none/H=8": True,
        "diloco/at_end/int8/H=8": True}


def test_the_planner_never_turns_subsets_on_by_itself():
    """A scenario without them: no candidate carries them, not even on a link so slow that bytes are all that
    counts, and nothing in the output mentions them."""
    scn = scenario_from_dict(_scenario(subsets_spec="", link={"bandwidth_mbps": 1, "latency_ms": 50},
                                       candidates={"algos": ["ddp", "diloco", "edit", "a_edit"],
                                                   "modes": ["layerwise", "at_end", "overlap"],
                                                   "compressions": ["none"], "intervals": [8, 32]}))
    plan = make_plan(scn, quick=True)
    assert plan.rows and not any(r.cand.subsets for r in plan.rows)
    assert not any("expert_subsets" in o for o in plan.overrides)
    assert plan.subsets is None and "expert_subsets" not in report.to_json(plan)
    assert report.subsets_block(plan) == ""


def test_only_the_candidates_the_product_runs_with_subsets_carry_them():
    """edit / a_edit with compression none (the verified rule's option; rows left out cannot go compressed)."""
    plan = make_plan(scenario_from_dict(_scenario()), quick=True)
    carried = {r.cand.label for r in plan.rows if r.cand.subsets}
    assert carried == {"edit/at_end/none+subsets/H=8"}
    plain = [overrides(plan.scenario, r.cand) for r in plan.rows if not r.cand.subsets]
    assert plain and not any("expert_subsets" in o for o in sum(plain, []))


def test_a_map_decided_at_run_time_is_planned_as_split_with_one_line():
    split = make_plan(scenario_from_dict(_scenario()), quick=True)
    later = make_plan(scenario_from_dict(_scenario(subsets_spec="routed")), quick=True)
    assert later.subsets["clusters"] == split.subsets["clusters"]
    assert later.subsets["note"] == "expert_subsets=routed is decided at run time: planned as split (8 experts over " \
                                    "2 clusters)"
    assert split.subsets["note"] == ""
    block = report.subsets_block(later).splitlines()
    assert sum("decided at run time" in line for line in block) == 1 and len(block) == 4


@pytest.mark.parametrize("extra, needle", [
    ({"expert_subsets": "0+1|2"}, r"expert\(s\) \[3, 4, 5, 6, 7\] belong to no cluster"),
    ({"expert_subsets": "0+1+2+3|4+5+6+7+9"}, r"expert\(s\) \[9\] not in the model's 8"),
    ({"gather_max": 1}, "gather_max=1 < 2 clusters"),
    ({"candidates": {"algos": ["diloco"], "compressions": ["none"]}}, "only edit / a_edit candidates"),
])
def test_a_scenario_the_product_would_refuse_is_one_plan_error(extra, needle):
    scn = {**_scenario(), **extra}
    with pytest.raises(PlanError, match=needle) as err:
        make_plan(scenario_from_dict(scn), quick=True)
    assert "\n" not in str(err.value)


def test_a_model_without_experts_is_one_plan_error():
    dense = dataclasses.replace(hardware.model_facts("tiny"), experts=0, expert_sizes=())
    with pytest.raises(PlanError, match="expert_subsets: model tiny has no routed experts"):
        resolve(scenario_from_dict(_scenario()), Profile.default(), dense)


def test_edit_train_plan_prints_the_block_and_writes_it_to_the_json(tmp_path, monkeypatch, capsys):
    from edit_train.cli.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["edit-train", "plan", "scenario=local_2x1", "scenario.expert_subsets=split",
                                      "quick=true", "top=3", f"out={tmp_path}", "scenario.candidates.modes=[at_end]",
                                      "scenario.candidates.intervals=[8]"])
    main()
    out = capsys.readouterr().out
    assert "expert subsets (split; on " in out and out.count("frozen-rows copy") == 2
    import json

    data = json.loads((tmp_path / "plan.json").read_text())
    assert set(data["expert_subsets"]["clusters"]) == {"c0", "c1"}
    assert {c["expert_subsets"] for c in data["candidates"]} == {"split", None}
    figures = data["expert_subsets"]["clusters"]["c0"]
    assert figures["bytes_saved_per_sync"] == figures["bytes_per_sync_every_expert"] - figures["bytes_per_sync"] > 0

