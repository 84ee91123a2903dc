"""Issue 51, acceptance 4: the verified rule's norm test holds for intervals of any length. An honest cluster's
‖Δ‖ grows like √s while noise dominates, so the old statistic ‖Δ‖/s made a short honest interval (the budget's
last sync cut short, a restarted cluster's first interval) look √(s₀/s) times larger and flagged it."""

from __future__ import annotations

import math

import pytest
import torch

from edit_train.local_sgd.aggregator import Evidence
from edit_train.local_sgd.penalty import interval_norm
from edit_train.local_sgd.aggregation.rules import RuleConfig, make_rule
from edit_train.local_sgd.aggregation.verified import VerifiedConfig

F64 = torch.float64
TOKENS_PER_STEP = 64.0


def _honest_norms(gen: torch.Generator, steps: list[float], dim: int = 2000) -> torch.Tensor:
    """‖Δ‖ of an honest noise-dominated interval: the sum of `s` independent per-step updates (each N(0, 1/dim)
    per coordinate): exactly √s times the norm of one N(0, 1/dim) vector, ‖Δ‖ ≈ √s with ~2 % spread."""
    out = [math.sqrt(s) * float(torch.randn(dim, generator=gen, dtype=F64).norm()) / math.sqrt(dim) for s in steps]
    return torch.tensor(out, dtype=F64)


def _evidence(module: str, sync: int, names: tuple[str, ...], norms: torch.Tensor, steps: list[float]) -> Evidence:
    s = torch.tensor(steps, dtype=F64)
    return Evidence(module, names, norms, s, (True,) * len(names),
                    {"sync": sync, "tokens": s * TOKENS_PER_STEP, "exact": torch.tensor(True), "reported": norms})


def _rule():  # type: ignore[no-untyped-def]
    return make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0)))


def _a_edit_history(rule, gen: torch.Generator, syncs: int = 60) -> int:  # type: ignore[no-untyped-def]
    """A time-budgeted 1:3 A-EDiT federation: the fast cluster's intervals 66–161 local steps, the slow one's 7–11."""
    for k in range(syncs):
        steps = [float(66 + (k * 37) % 96), float(7 + k % 5)]
        for module in ("layers.0", "layers.1", "root"):
            d = rule.decide(_evidence(module, k, ("fast", "slow"), _honest_norms(gen, steps), steps))
            assert not any(d.left_out), (k, module, d.evidence)
    return syncs


def test_an_honest_interval_cut_short_by_the_budget_is_not_flagged_and_weighs_its_tokens() -> None:
    """The final sync of a time-budgeted run meets the fast cluster after 24 steps (its median ~113) and the slow
    one after its usual 9: neither is left out and each weighs its share of the tokens (the issue's runs: the fast
    cluster flagged at z 3.9–10.2 and weighed 0.02 instead of ~0.78)."""
    gen = torch.Generator().manual_seed(0)
    rule = _rule()
    last = _a_edit_history(rule, gen)
    steps = [24.0, 9.0]
    for module in ("layers.0", "layers.1", "root"):
        d = rule.decide(_evidence(module, last, ("fast", "slow"), _honest_norms(gen, steps), steps))
        assert d.left_out == [False, False], d.evidence
        assert d.weights == pytest.approx([24 / 33, 9 / 33])


def test_a_joiners_first_short_interval_weighs_as_its_tokens_say() -> None:
    """A cluster that joins late trains only part of an interval before its first sync: it weighs its tokens,
    and so does a known cluster restarted mid-interval (its first interval back is short)."""
    gen = torch.Generator().manual_seed(1)
    rule = _rule()
    last = _a_edit_history(rule, gen)
    steps = [120.0, 9.0, 17.0]  # "new" joined a few seconds before this sync
    d = rule.decide(_evidence("layers.0", last, ("fast", "slow", "new"), _honest_norms(gen, steps), steps))
    assert d.left_out == [False, False, False]
    assert d.weights == pytest.approx([120 / 146, 9 / 146, 17 / 146])
    steps = [12.0, 9.0, 17.0]  # "fast" healed mid-interval: 12 steps since it came back
    d = rule.decide(_evidence("layers.0", last + 1, ("fast", "slow", "new"), _honest_norms(gen, steps), steps))
    assert d.left_out == [False, False, False] and d.weights == pytest.approx([12 / 38, 9 / 38, 17 / 38])


def test_a_short_interval_still_catches_a_scaled_contribution() -> None:
    """Leniency for short intervals is bounded by the noise law: ×5 the honest norm is still left out."""
    gen = torch.Generator().manual_seed(2)
    rule = _rule()
    last = _a_edit_history(rule, gen)
    steps = [24.0, 9.0]
    norms = _honest_norms(gen, steps) * torch.tensor([5.0, 1.0], dtype=F64)
    d = rule.decide(_evidence("layers.0", last, ("fast", "slow"), norms, steps))
    assert d.left_out == [True, False]


def test_the_reference_interval_survives_a_state_round_trip() -> None:
    gen = torch.Generator().manual_seed(3)
    rule = _rule()
    last = _a_edit_history(rule, gen, syncs=12)
    meta, tensors = rule.state()
    assert tensors["interval/root/count"].tolist() == [12, 12]
    other = _rule()
    other.load(meta, tensors)
    steps = [30.0, 4.0]
    norms = _honest_norms(gen, steps)
    a = rule.decide(_evidence("root", last, ("fast", "slow"), norms, steps))
    b = other.decide(_evidence("root", last, ("fast", "slow"), norms, steps))
    assert a.weights == b.weights and [e["norm_z"] for e in a.evidence] == [e["norm_z"] for e in b.evidence]


def test_interval_norm_closed_form() -> None:
    g = torch.tensor([10.0, 10.0, 10.0, 10.0], dtype=F64)
    x = interval_norm(g, [100.0, 25.0, 400.0, 25.0], torch.tensor([100.0, 100.0, 100.0, 0.0], dtype=F64))
    assert x.tolist() == pytest.approx([0.1, 10 / 50, 10 / 400, 10 / 25])  # s₀ unknown (0): ‖Δ‖/s
