"""The aggregation seam: rules by name, EDiT's statistics per cluster name over a changing quorum."""

from __future__ import annotations

import math

import pytest
import torch

from edit_train.local_sgd.aggregator import Evidence
from edit_train.local_sgd.aggregation.rules import EditNormConfig, EditNormRule, RuleConfig, UniformRule, make_rule, rule_names


def _norms(seed: int, n: int) -> torch.Tensor:
    return 1 + 0.05 * torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _ev(norms: torch.Tensor, names: list[str], contributes: list[bool] | None = None, steps: float = 4.0,
        module: str = "m") -> Evidence:
    n = len(names)
    return Evidence(module, tuple(names), torch.as_tensor(norms, dtype=torch.float64),
                    torch.full((n,), steps, dtype=torch.float64), tuple(contributes or [True] * n))


def test_registered_rules_and_a_clear_error_for_an_unknown_one() -> None:
    assert {"edit_norm", "uniform"} <= set(rule_names())
    assert isinstance(make_rule(RuleConfig(name="uniform")), UniformRule)
    with pytest.raises(ValueError, match="algo.rule.name: unknown rule 'nope'"):
        make_rule(RuleConfig(name="nope"))
    with pytest.raises(ValueError, match="cannot load 'no_such_module:Rule'"):
        make_rule(RuleConfig(name="no_such_module:Rule"))


def test_a_rule_defined_outside_the_package_is_loaded_by_name() -> None:
    rule = make_rule(RuleConfig(name="custom_rule:FirstClusterOnly"))
    d = rule.decide(_ev(torch.tensor([1.0, 2.0]), ["a", "b"]))
    assert d.weights == [1.0, 0.0]


def test_a_rule_gets_its_own_options_and_unknown_ones_are_refused() -> None:
    """`algo.rule.options` reach a rule of one's own: as its `Config` dataclass when it declares one (an unknown
    key is one line naming the rule and what it takes), else as the dict."""
    import custom_rule

    assert isinstance(make_rule(RuleConfig(name="custom_rule:FirstClusterOnly", options={"x": 1})),
                      custom_rule.FirstClusterOnly)
    with pytest.raises(ValueError, match=r"\['nope'\] are not parameters of rule 'custom_rule:WithConfig'"):
        make_rule(RuleConfig(name="custom_rule:WithConfig", options={"nope": 1}))
    assert make_rule(RuleConfig(name="custom_rule:WithConfig", options={"favourite": 2})).favourite == 2
    with pytest.raises(ValueError, match="algo.rule.edit_norm.temperature must be > 0"):
        RuleConfig(edit_norm=EditNormConfig(temperature=0.0)).validate()


def test_absent_cluster_keeps_its_statistics_and_returns_to_them() -> None:
    rule = EditNormRule(EditNormConfig(warmup_syncs=2))
    for k in range(5):
        rule.decide(_ev(_norms(k, 2), ["a", "b"]))
    before = {k: v[1].clone() for k, v in rule.state()[1].items()}
    for k in range(5, 10):  # b is away
        assert rule.decide(_ev(_norms(k, 1), ["a"])).weights == [1.0]
    after = {k: v[1] for k, v in rule.state()[1].items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    d = rule.decide(_ev(_norms(11, 2), ["a", "b"]))
    assert not any(d.left_out) and abs(sum(d.weights) - 1) < 1e-9


def test_newcomer_and_non_contributor() -> None:
    rule = EditNormRule(EditNormConfig())
    rule.decide(_ev(_norms(0, 2), ["a", "b"]))
    d = rule.decide(_ev(torch.tensor([1.0, 0.0, 1.1]), ["a", "b", "c"], [True, False, True]))
    assert rule.roster == ["a", "b", "c"]
    assert d.weights[1] == 0.0 and not d.left_out[1] and abs(d.weights[0] + d.weights[2] - 1) < 1e-9
    nobody = rule.decide(_ev(torch.zeros(2), ["a", "b"], [False, False]))
    assert nobody.skip and nobody.weights == [0.0, 0.0]


def test_state_round_trip_and_refusal_of_a_mismatched_roster() -> None:
    rule = EditNormRule(EditNormConfig())
    rule.decide(_ev(_norms(0, 2), ["x", "y"]))
    other = EditNormRule(EditNormConfig())
    other.load(*rule.state())
    a = rule.decide(_ev(_norms(1, 2), ["x", "y"]))
    b = other.decide(_ev(_norms(1, 2), ["x", "y"]))
    assert a.weights == b.weights
    meta, tensors = rule.state()
    with pytest.raises(ValueError, match="roster of 3"):
        other.load({"roster": ["x", "y", "z"]}, tensors)


def test_uniform_rule_drops_non_finite_and_non_contributors() -> None:
    d = UniformRule().decide(_ev(torch.tensor([1.0, math.nan, 2.0, 0.0]), list("abcd"),
                                                 [True, True, True, False]))
    assert d.weights == [0.5, 0.0, 0.5, 0.0] and d.left_out == [False, True, False, False]


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_a_median_from_outside_the_package_drives_a_real_three_cluster_run(tmp_path, corpus) -> None:  # type: ignore[no-untyped-def]
    """`algo.rule.name=median_rule:CoordinateMedian` (defined in tests/, not in the package) in a real
    3-cluster run (a Lighthouse and three cluster jobs over gloo): every sync gathers every contribution, the
    rule's own combine merges them on every cluster (its call count travels in the checkpoint), and all three
    end on one anchor."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fed_utils import anchors, same

    run_dir = tmp_path / "median"
    tests = str(Path(__file__).resolve().parents[1] / "helpers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "edit_train.cli.train", "algo=edit", "cluster=local", "cluster.count=3",
           "model=tiny", "logger=none", "train.progress=false", "train.seq_len=32", "train.batch_size=2",
           "train.steps=8", "algo.interval=4", "train.eval_every=0", "train.eval_batches=1", f"data.source={corpus}",
           f"run.dir={run_dir}", "algo.rule.name=median_rule:CoordinateMedian"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [e for e in events if e["event"] == "sync"]
    assert len(syncs) == 6 and all(e["aggregation"] == "gathered" and len(e["quorum"]) == 3 for e in syncs)
    assert same(anchors(run_dir, "c0"), anchors(run_dir, "c1")) == 0.0
    assert same(anchors(run_dir, "c0"), anchors(run_dir, "c2")) == 0.0
    states = list((run_dir / "checkpoints" / "c2").rglob("*.json"))
    assert any('"calls"' in p.read_text() for p in states), "the rule's state is not in the checkpoint"


def test_the_custom_rule_example_in_the_architecture_doc_works(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import re
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    code = re.search(r"```python\n(# my_rules\.py.*?)```", doc, re.S)
    assert code, "the example is gone from docs/architecture.md"
    (tmp_path / "my_rules.py").write_text(code.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rules", None)
    rule = make_rule(RuleConfig(name="my_rules:TrustBiggest"))
    ev = Evidence("m", ("a", "b", "c"), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
                  torch.tensor([4.0, 9.0, 0.0], dtype=torch.float64), (True, True, False))
    assert rule.decide(ev).weights == [0.0, 1.0, 0.0]
    assert make_rule(RuleConfig(name="my_rules:TrustBiggest", options={"share": 0.5})).decide(ev).weights[1] == 0.5
    median = make_rule(RuleConfig(name="my_rules:Median"))
    parts = [[torch.tensor([1.0, 9.0])], [torch.tensor([2.0, 0.0])], [torch.tensor([7.0, 3.0])]]
    assert median.combine(ev, median.decide(ev), parts)[0].tolist() == [2.0, 3.0]
