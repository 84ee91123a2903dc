"""Issue 65: the rule costs honest federations nothing — the scale bound per lr-weighted step, the probe's
baseline and its suspicion bound, each on honest heterogeneous inputs (nothing done) and on the attack (still
caught); and the default demo's shape (two honest clusters at 1:3 under A-EDiT) in process: no rule warning."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from edit_train.local_sgd.aggregator import Decision, Evidence
from edit_train.local_sgd.evidence import probe_judgement
from edit_train.local_sgd.aggregation.scale import SCALE_BOUND, SCALE_SPREAD, LrShape, bound_scale
from edit_train.train.lr import lr_at

DEMO = LrShape(warmup=30, total=48, min_ratio=0.1)  # the default demo's lr (train.lr_warmup_steps=30), 48 steps


def _bound(norms: list[float], steps: list[float], totals: list[float] | None, shape: LrShape | None,
           spread: float = SCALE_SPREAD, weights: list[float] | None = None
           ) -> tuple[dict[int, float], dict[int, float], list[float]]:
    n = len(norms)
    extra = {"total_steps": torch.tensor(totals, dtype=torch.float64)} if totals is not None else {}
    ev = Evidence("u", tuple(f"c{i}" for i in range(n)), torch.tensor(norms, dtype=torch.float64),
                  torch.tensor(steps, dtype=torch.float64), (True,) * n, extra)
    d = Decision("u", list(norms), list(weights) if weights is not None else [1.0 / n] * n, [False] * n, False)
    clipped, held = bound_scale(d, ev, SCALE_BOUND, spread, shape)
    return clipped, held, d.weights


@pytest.mark.parametrize("warmup,total,ratio", [(30, 48, 0.1), (0, 100, 0.0), (10, 10, 0.5), (5, 200, 1.0)])
def test_the_cores_lr_shape_is_the_trainers_schedule_over_its_peak(warmup: int, total: int, ratio: float) -> None:
    shape = LrShape(warmup, total, ratio)
    for step in range(0, 3 * total + 5):
        assert shape.at(step) == pytest.approx(lr_at(step, 3e-3, total, warmup, ratio) / 3e-3, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("shape", [DEMO, LrShape(0, 100, 0.0), LrShape(10, 10, 0.5), LrShape(16, 160, 0.1)])
def test_lr_weighted_steps_in_closed_form_are_the_sum(shape: LrShape) -> None:
    gen = torch.Generator().manual_seed(0)
    for end, n in torch.randint(0, 700, (200, 2), generator=gen).tolist():
        brute = sum(shape.at(max(t, 0)) for t in range(end - n - 1, end))
        assert shape.weighted(end, n + 1) == pytest.approx(brute, rel=1e-9, abs=1e-9)
    # a claim of 2^40 steps is one closed form, not 2^40 terms
    tail = (2.0 ** 40 - shape.total) * shape.min_ratio  # the floor's steps, plus at most `total` steps above it
    assert tail <= shape.weighted(2.0 ** 40, 2.0 ** 40) <= tail + shape.total


def test_the_demos_honest_fast_cluster_at_sync_1_is_not_clipped() -> None:
    """Measured in the default demo (2 clusters 1:3 on a loaded box: 17 and 2 steps of the lr warm-up at sync
    1, whole-model ‖Δ‖ 6.49 and 0.316): per step, the fast one was clipped; per lr-weighted step, nothing is."""
    norms, steps = [6.49, 0.316], [17.0, 2.0]
    assert list(_bound(norms, steps, None, None)[0]) == [0]  # the law of before: clipped at sync 1
    clipped, held, weights = _bound(norms, steps, steps, DEMO)
    assert clipped == {} and held == {} and weights == [0.5, 0.5]


def test_the_demos_honest_slow_cluster_late_in_the_run_is_not_clipped() -> None:
    """Sync 5 of the same run: the fast cluster past train.steps at the lr floor (19 steps, to step 86), the slow
    one near the peak (4 steps, to step 12), ‖Δ‖ 1.737 and 1.729."""
    norms, steps, totals = [1.737, 1.729], [19.0, 4.0], [86.0, 12.0]
    assert _bound(norms, steps, totals, DEMO)[:2] == ({}, {})


def test_the_demos_honest_fast_lm_head_is_not_clipped() -> None:
    """The full-length demo (420 steps, train.lr_warmup_steps=30), the fast cluster's `lm_head` at syncs 9 and 10:
    6-10 times the slow one's ‖Δ‖ in 3.3 times its steps at half its lr (4.5 and 5.0 times the median per
    lr-weighted step: clipped, with a warning, before); counted in steps as well it is within the spread."""
    shape = LrShape(warmup=30, total=420, min_ratio=0.1)
    for norms, steps, totals in (([3.566, 0.382], [24.0, 7.0], [225.0, 60.0]),
                                 ([3.0, 0.364], [22.0, 7.0], [247.0, 67.0])):
        assert _bound(norms, steps, totals, shape)[:2] == ({}, {})
    # the same fast cluster sending 10 times its Δ is clipped to the median
    assert list(_bound([35.66, 0.382], [24.0, 7.0], [225.0, 60.0], shape)[0]) == [0]


def test_an_honest_noise_dominated_fast_cluster_does_not_put_the_slow_one_over() -> None:
    """‖Δ‖ ∝ √e (noise-dominated, Adam late in a run): 12 times the lr-weighted steps, √12 times the norm."""
    assert _bound([math.sqrt(12.0), 1.0], [24.0, 2.0], [240.0, 20.0], LrShape(0, 10, 1.0))[:2] == ({}, {})


def test_a_liar_just_under_the_bound_pulls_no_harder_than_the_spread() -> None:
    """Issue 69 item 3: 3.9 times its Δ at honest steps passed the bound of 4 whole; now it counts as 3 times the
    median (held, silently) — and 10 times is still clipped to the median."""
    clipped, held, weights = _bound([1.0, 3.9], [8.0, 8.0], [64.0, 64.0], DEMO)
    assert clipped == {} and held == {1: pytest.approx(SCALE_SPREAD / 3.9)}
    assert weights[1] * 3.9 == pytest.approx(SCALE_SPREAD * weights[0])
    clipped, held, weights = _bound([1.0, 1.1, 10.0], [8.0, 8.0, 8.0], [64.0] * 3, DEMO)
    assert list(clipped) == [2] and held == {} and weights[2] * 10.0 == pytest.approx(1.1 * weights[1])
    # claiming the lr's peak does not buy headroom: the counted steps are capped at scale_bound × the median's
    assert list(_bound([1.0, 100.0], [8.0, 2.0 ** 40], [64.0, 2.0 ** 40], DEMO)[0]) == [1]


def test_a_site_below_its_equal_share_is_held_by_its_pull_not_its_size() -> None:
    """benchmarks/false_positives.py, two sites with their own data at 1:8 under token weights (seed 0, sync 14,
    `b1`): the slow site weighs 1/9 and, far from its own optimum, sends 5.8 times the fast one's ‖Δ‖ in 1/8 of its
    steps — held to 3x, which cost +1.4 % final loss (22 unit-decisions of 160). Its pull on the merged update
    (weight x size) is under what an equal-share member held at the spread pulls: not held. A member at or over
    its equal share is held as before, and no member below it pulls harder than an equal-share one at the spread,
    whatever weight it claims."""
    shape = LrShape(16, 160, 0.1)
    norms, steps, totals, w = [1.0, 5.8], [24.0, 3.0], [250.0, 40.0], [8 / 9, 1 / 9]
    clipped, held, weights = _bound(norms, steps, totals, shape, weights=w)
    assert clipped == {} and held == {} and weights == w
    # the same size at an equal share: held to the spread (issue 69 item 3)
    assert list(_bound([1.0, 3.9], [8.0, 8.0], [64.0, 64.0], DEMO, weights=[0.5, 0.5])[1]) == [1]
    # whatever weight a member under its equal share claims, its pull stays within the spread's at an equal share
    for share in (0.02, 0.1, 0.25, 0.4, 0.5):
        for size in (2.0, 3.0, 3.5, 3.9):
            ws = [1 - share, share]
            _, _, out = _bound([1.0, size], [8.0, 8.0], [64.0, 64.0], DEMO, weights=ws)
            assert out[1] * size <= SCALE_SPREAD * 0.5 * 1.0 + 1e-12, (share, size, out)


def test_honest_sites_with_their_own_data_are_not_useless_on_the_probe() -> None:
    """Every site's update raises the others' probe loss by 25-40 % (their own data): nobody is judged useless
    and no evaluator is suspected; a harmful update that hurts by 90 % is, and a liar scoring +1000 % is still
    suspected."""
    nan = math.nan
    honest = torch.tensor([[nan, 0.3, 0.25, 0.35], [0.3, nan, 0.4, 0.3], [0.25, 0.35, nan, 0.3],
                           [0.4, 0.3, 0.35, nan]], dtype=torch.float64)
    m, who = probe_judgement(honest, 0.1)
    assert who == {} and bool((m <= 0.1).all()), m
    harmful = honest.clone()
    harmful[[0, 1, 2], 3] = torch.tensor([0.9, 0.95, 0.9], dtype=torch.float64)
    m, who = probe_judgement(harmful, 0.1)
    assert who == {} and m[3].item() > 0.1 and bool((m[:3] <= 0.1).all()), m
    liar = honest.clone()
    liar[3, :3] = 10.0
    m, who = probe_judgement(liar, 0.1)
    assert who == {3: "disagrees"} and bool((m <= 0.1).all()), m


def test_two_honest_sites_one_evaluator_each_name_nobody() -> None:
    m, who = probe_judgement(torch.tensor([[math.nan, 0.3], [0.2, math.nan]], dtype=torch.float64), 0.1)
    assert bool(m.isnan().all()) and who == {}


def test_the_demos_shape_in_process_fires_no_rule() -> None:
    """Two honest clusters at 1:3 under A-EDiT with the product's lr shape (warm-up, cosine), each its own
    data, the verified rule with the probe: nothing clipped, held, left out or retracted, and no rule warning
    (the stop votes are the lead's A-EDiT stop: not counted here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import false_positives as fp

    got = fp.run({"name": "demo", "schedule": "a_edit", "ratio": 3, "clusters": 2, "data": "lang", "seed": 0})
    assert got["unit_decisions"] > 0
    assert (got["clipped"], got["held"], got["left_out"], got["retracted"]) == (0, 0, 0, 0), got
    assert {k: v for k, v in got["warnings_by"].items() if k != "stop"} == {}, got["warning_lines"]


def test_two_sites_with_their_own_data_at_1_to_8_hold_nothing() -> None:
    """The benchmark's worst honest row (`a_edit_1to8_n2_lang_s0`): held by size, the slow site's 22 unit-decisions
    of 160 were held to the spread (+1.4 % final loss); held by pull, none — and nothing else fires."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import false_positives as fp

    got = fp.run({"name": "lang2", "schedule": "a_edit", "ratio": 8, "clusters": 2, "data": "lang", "seed": 0})
    assert got["unit_decisions"] > 0
    assert (got["clipped"], got["held"], got["left_out"], got["retracted"], got["named"]) == (0, 0, 0, 0, []), got
    assert {k: v for k, v in got["warnings_by"].items() if k != "stop"} == {}, got["warning_lines"]


def test_four_unlike_sites_at_1_to_8_lose_nothing_to_the_rule() -> None:
    """Four sites each with its own data, A-EDiT 1:8 (benchmarks/false_positives.py's `lang`): before, 40 of
    their 320 unit-decisions were left out (26 by the direction test's pooled history, 16 on probation after it,
    8 by the probe's fixed 10 %) and their final loss was 0.78x-1.17x the run with nothing tested. Judged
    against each site's own history: nothing left out, retracted or named, no warning."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import false_positives as fp

    got = fp.run({"name": "lang4", "schedule": "a_edit", "ratio": 8, "clusters": 4, "data": "lang", "seed": 0})
    assert got["unit_decisions"] > 0
    assert (got["clipped"], got["left_out"], got["retracted"], got["named"]) == (0, 0, 0, []), got
    assert got["warnings"] == 0, got["warning_lines"]


def _probe_sync(rule, sync: int, raw: list[float]) -> Decision:  # type: ignore[no-untyped-def]
    """One sync of the verified rule with the probe's scores as the judge hands them over (less each offset)."""
    names = [f"c{i}" for i in range(len(raw))]
    r = torch.tensor(raw, dtype=torch.float64)
    ev = Evidence("u", tuple(names), torch.ones(len(raw), dtype=torch.float64), torch.full((len(raw),), 8.0,
                  dtype=torch.float64), (True,) * len(raw),
                  {"probe_raw": r, "probe": r - rule.probe_offset(names), "sync": torch.tensor(sync)})
    return rule.decide(ev)


def test_the_probe_judges_a_site_against_its_own_harm() -> None:
    """A site whose updates always raise the others' probe loss by ~30 % (its own data) is not useless once its
    history holds 6 scores (`PROBE_WARM`); before that a score counts as harmful above 90 % (`PROBE_LIE` + the tolerance: an honest
    four-language site's second score was +77 %), and after, one that jumps far above its own (+90 %) is, as is
    anything above 90 % whatever its history; a site whose
    history is quiet is judged harmful from 40 % (`PROBE_FLOOR`), not from its mean + 10 %."""
    from edit_train.local_sgd.aggregation.rules import RuleConfig, make_rule
    from edit_train.local_sgd.aggregation.verified import VerifiedConfig

    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, probe_tokens=16)))
    for sync in range(1, 7):
        d = _probe_sync(rule, sync, [0.3 + 0.02 * (sync % 2), -0.1, -0.05, 0.32])
        assert d.left_out == [False] * 4, (sync, d.evidence)
    assert _probe_sync(rule, 7, [0.9, -0.1, -0.05, 0.3]).left_out == [True, False, False, False]
    fresh = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, probe_tokens=16)))
    assert _probe_sync(fresh, 1, [0.8, 0.95, 0.0, 0.0]).left_out == [False, True, False, False]
    quiet = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, probe_tokens=16)))
    for sync in range(1, 7):
        _probe_sync(quiet, sync, [0.0, 0.01, 0.0, 0.0])
    assert _probe_sync(quiet, 7, [0.35, 0.45, 0.0, 0.0]).left_out == [False, True, False, False]
    drift = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, probe_tokens=16)))
    for sync in range(1, 30):  # creeping up in steps its own threshold lets through: held at 90 %
        d = _probe_sync(drift, sync, [min(0.05 * sync, 1.0), 0.0, 0.0, 0.0])
    assert d.left_out[0] and 0.05 * 29 > 0.9


def test_a_site_is_judged_on_its_own_probe_history_only_once_it_holds_six_scores() -> None:
    """Measured under `weighting=uniform` (four-language sites, 1:3-1:8): honest sites scored +0.41 to +0.75 at
    syncs 5-7 after 3-5 quiet scores (left out at PROBE_WARM 3, whose floor of 40 % applied). Until a site holds
    PROBE_WARM (6) scores an update is harmful above 90 % only; after, as before."""
    from edit_train.local_sgd.aggregation.rules import RuleConfig, make_rule
    from edit_train.local_sgd.aggregation.verified import PROBE_WARM, VerifiedConfig

    assert PROBE_WARM == 6
    rule = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, probe_tokens=16)))
    for sync, score in enumerate([0.03, -0.02, 0.0], start=1):
        assert not any(_probe_sync(rule, sync, [0.0, -0.1, score, 0.02]).left_out)
    assert _probe_sync(rule, 4, [0.0, -0.1, 0.75, 0.02]).left_out == [False] * 4  # the measured +0.75
    assert _probe_sync(rule, 5, [0.0, -0.1, 0.95, 0.02]).left_out == [False, False, True, False]
    for quiet in (5, 6):  # the boundary: a quiet history of 5 scores does not judge +45 %, one of 6 does (40 %)
        fresh = make_rule(RuleConfig(name="verified", verified=VerifiedConfig(sketch_dim=0, probe_tokens=16)))
        for sync in range(1, quiet + 1):
            _probe_sync(fresh, sync, [0.0, -0.1, 0.01 * (sync % 2), 0.02])
        assert _probe_sync(fresh, quiet + 1, [0.0, -0.1, 0.45, 0.02]).left_out[2] is (quiet == 6)


def test_two_own_task_sites_with_uniform_weighting_leave_nobody_out() -> None:
    """Four-language sites at 1:8 under `weighting=uniform`, seed 1: before the pair test corroborated across units
    (direction.PAIR_ALONE), one hidden layer's anomaly left the fast site out, and the pair's history, learning
    nothing while a member was out, kept it out for 14 syncs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import false_positives as fp

    got = fp.run({"name": "lang2u", "schedule": "a_edit", "ratio": 8, "clusters": 2, "data": "lang", "seed": 1,
                  "weighting": "uniform"})
    assert got["unit_decisions"] > 0
    assert (got["clipped"], got["held"], got["left_out"], got["retracted"], got["named"]) == (0, 0, 0, 0, []), got
    assert got["below_token_share"] == 0 and got["warnings"] == 0, got


def test_the_weighting_is_the_federations_declaration() -> None:
    """`algo.rule.verified.weighting`: `tokens` by default, `uniform` where the four-language experiment declares
    sites with their own task; part of the configuration fingerprint, so a cluster declaring the other refuses
    itself (the roster signs the fingerprint), and the difference is named."""
    from edit_train.cli.common import compose
    from edit_train.local_sgd.aggregation.claims import differences
    from edit_train.train.build import fingerprint

    tokens = compose(["cluster=local_2x1"])
    assert tokens.algo.rule.verified.weighting == "tokens"
    assert compose(["experiment=noniid_lang_4"]).algo.rule.verified.weighting == "uniform"
    uniform = compose(["cluster=local_2x1", "algo.rule.verified.weighting=uniform"])
    assert fingerprint(uniform) != fingerprint(tokens)
    assert "model/algo/sync" in differences(fingerprint(uniform), fingerprint(tokens))


def test_an_honest_evaluator_with_other_data_is_not_suspected() -> None:
    """Four-language sites' evaluators disagreed with the others by up to 0.87 (median over the updates they
    scored, false_positives.py seed 0): not suspected; a liar scoring +1000 % is, whatever the others' data."""
    nan = math.nan
    s = torch.tensor([[nan, 0.9, 0.85, 0.8], [0.0, nan, 0.05, 0.1], [0.05, 0.0, nan, 0.0],
                      [0.1, 0.05, 0.0, nan]], dtype=torch.float64)
    assert probe_judgement(s, 0.1)[1] == {}
    s[3, :3] = 10.0
    assert probe_judgement(s, 0.1)[1] == {3: "disagrees"}


@pytest.mark.parametrize("attack", ["sign_flip", "garbage"])
def test_a_pairs_liar_is_left_out_and_the_honest_cluster_never(attack: str) -> None:
    """Two clusters (1:3 under A-EDiT, the benchmark's attack column): c1 flips its sign or trains on garbage from
    sync 7 on. The pair test's anomaly is pinned on the member whose distance to the anchor's path rose (the
    reference) — or, where that does not place it, on the member flagged in an earlier unit of the sync — the
    accused stays the accused, probation lasts while a unit is still flagged: the liar is out of every unit of
    every lying sync, and the honest cluster is never left out (the last stop: 0 % caught; before that, the
    honest cluster of the garbage pair left out in 28 of 80)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import false_positives as fp

    got = fp.run({"name": f"attack_{attack}_n2", "schedule": "a_edit", "ratio": 3, "clusters": 2, "data": "iid",
                  "seed": 0, "attack": attack})
    assert got["liar_caught"] == 1.0 and got["left_out"] == 0 and got["named"] == [], got
