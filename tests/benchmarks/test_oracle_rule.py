"""The oracle of `benchmarks/penalty_faults.py` drops exactly its cluster in exactly its window of syncs, sets
the others' weights as the `verified` rule would with that cluster left out (`left_out`), and is the
`verified` rule everywhere else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from edit_train.local_sgd.aggregator import Evidence, needs_of
from edit_train.local_sgd.aggregation.rules import RuleConfig, make_rule
from edit_train.local_sgd.aggregation.verified import VerifiedConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _oracle_rule  # noqa: E402


def _ev(module: str, n: int) -> Evidence:
    return Evidence(module, tuple(f"c{i}" for i in range(n)), torch.ones(n, dtype=torch.float64),
                    torch.full((n,), 4.0, dtype=torch.float64), (True,) * n,
                    {"tokens": torch.full((n,), 100.0, dtype=torch.float64)})


@pytest.mark.parametrize(("left_out", "n", "inside"), [("zero", 2, [0.5, 0.0]), ("others", 2, [1.0, 0.0]),
                                                        ("zero", 3, [1 / 3, 0.0, 1 / 3])])
def test_the_oracle_drops_its_cluster_in_its_window_only(monkeypatch: pytest.MonkeyPatch, left_out: str, n: int,
                                                         inside: list[float]) -> None:
    monkeypatch.setenv(_oracle_rule.ENV, "c1:3:4")
    oracle = make_rule(RuleConfig(name="_oracle_rule:OracleRule", options={"sketch_dim": 0, "left_out": left_out}))
    plain = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0)))
    assert isinstance(oracle, _oracle_rule.OracleRule) and oracle.cfg.left_out == left_out
    assert needs_of(oracle) is needs_of(plain) and oracle.sketch_dim == 0  # measured as `verified` is
    for sync in range(1, 7):
        for module in ("a", "b"):
            d, ref = oracle.decide(_ev(module, n)), plain.decide(_ev(module, n))
            if 3 <= sync <= 4:
                assert d.weights == pytest.approx(inside) and d.left_out[1], (sync, module)
                assert d.evidence[1]["reasons"] == ["oracle"]
            else:
                assert d.weights == ref.weights == pytest.approx([1 / n] * n), (sync, module)
    assert oracle.sync == 6


def test_a_bad_window_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_oracle_rule.ENV, "c1:5")
    with pytest.raises(ValueError, match=_oracle_rule.ENV):
        _oracle_rule.OracleRule(VerifiedConfig())


def test_the_oracle_takes_the_verified_parameters_as_options() -> None:
    with pytest.raises(ValueError, match="not parameters of rule"):
        make_rule(RuleConfig(name="_oracle_rule:OracleRule", options={"temperature": 1.0}))
