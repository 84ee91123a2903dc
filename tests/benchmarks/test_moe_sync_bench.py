"""benchmarks/moe_sync.py's readings, on crafted events: the routing skew (how far token weights would be from
today's rule) and the IID paired noise a gain must beat."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench() -> Any:
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("moe_sync", REPO / "benchmarks" / "moe_sync.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _experts(interval: int, cluster: str, counts: list[list[int]]) -> dict[str, Any]:
    return {"event": "experts", "interval": interval, "cluster": cluster, "counts": counts}


def test_routing_skew_is_the_mean_distance_of_equal_backing_token_weights_from_one_over_p() -> None:
    m = _bench()
    early = [_experts(k, c, [[100, 0]]) for k in range(m.SETTLED) for c in ("c0", "c1")]  # unsettled: not counted
    # one MoE layer, two experts: c0 routes 3:1, c1 1:1 -> shares (.75, .25) and (.5, .5); expert 0's weights
    # .75/1.25 = .6 and .4, expert 1's .25/.75 = 1/3 and 2/3 -> |w - 1/2| = .1, .1, 1/6, 1/6
    settled = [_experts(m.SETTLED, "c0", [[30, 10]]), _experts(m.SETTLED, "c1", [[20, 20]])]
    assert m.routing_skew(early + settled) == pytest.approx((0.1 + 0.1 + 1 / 6 + 1 / 6) / 4)
    alike = [_experts(m.SETTLED, "c0", [[7, 7]]), _experts(m.SETTLED, "c1", [[50, 50]])]
    assert m.routing_skew(alike) == 0.0
    assert m.routing_skew(early) is None  # nothing settled yet
    assert m.routing_skew([_experts(m.SETTLED, "c0", [[3, 1]])]) is None  # one cluster: no weights to compare


def test_the_iid_paired_noise_is_tokens_against_default_per_seed() -> None:
    m = _bench()
    runs = [{"model": "tiny", "clusters": 2, "data": d, "arm": a, "seed": s, "final_val_loss": v}
            for d, a, s, v in [("iid", "default", 0, 2.0), ("iid", "tokens", 0, 2.03), ("iid", "default", 1, 2.1),
                               ("iid", "tokens", 1, 2.09), ("noniid", "default", 0, 5.0), ("iid", "tokens", 2, 9.0)]]
    n = m.paired_noise(runs, "tiny", 2)
    assert n["n"] == 2 and n["max_abs"] == pytest.approx(0.03) and n["mean"] == pytest.approx(-0.01)
    assert m.paired_noise(runs, "small", 2) == {}


# ------------------------------------------------------------------------------------- the paired criterion
def _paired() -> Any:
    _bench()  # puts benchmarks/ on sys.path
    import paired

    return paired


def test_the_t_quantile_matches_its_closed_forms() -> None:
    import math

    p = _paired()
    # ν = 1 (Cauchy): t = tan(π (0.975 − 1/2)); ν = 2: t = (2q − 1) / √(2 q (1 − q)), q = 0.975
    assert p.t_quantile(1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-9)
    assert p.t_quantile(2) == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), rel=1e-9)
    # ν = 4: A(t) = sin θ (1 + cos²θ / 2) with θ = atan(t / 2), at the tabulated 2.776445105
    assert p.t_two_sided(2.776445105197793, 4) == pytest.approx(0.95, abs=1e-12)
    assert p.t_quantile(4) == pytest.approx(2.776445105197793, rel=1e-9)
    # ν = 3 (odd): A(t) = (2/π)(θ + sin θ cos θ), θ = atan(t / √3)
    th = math.atan(p.t_quantile(3) / math.sqrt(3))
    assert 2 / math.pi * (th + math.sin(th) * math.cos(th)) == pytest.approx(0.95, abs=1e-12)
    assert p.t_quantile(1000) == pytest.approx(1.962339081, abs=1e-6)  # tabulated; → the normal 1.95996


def test_the_paired_gain_is_seed_by_seed_with_its_t_interval() -> None:
    import math
    import statistics

    p = _paired()
    default = {0: 2.00, 1: 2.10, 2: 1.95, 3: 2.05, 4: 2.02, 9: 7.0}  # seed 9: no pair, left out
    arm = {0: 1.98, 1: 2.07, 2: 1.94, 3: 2.01, 4: 2.00}
    g = p.paired_gain(default, arm)
    d = [0.02, 0.03, 0.01, 0.04, 0.02]
    half = 2.7764451051977934 * statistics.stdev(d) / math.sqrt(5)
    assert g["seeds"] == [0, 1, 2, 3, 4] and g["per_seed"] == pytest.approx(d)
    assert g["mean"] == pytest.approx(0.024) and g["half_width"] == pytest.approx(half)
    assert g["ci"] == pytest.approx([0.024 - half, 0.024 + half]) and g["pays"] is True and g["costs"] is False
    assert p.paired_gain({0: 1.0}, {0: 0.5})["ci"] is None  # one seed: no interval
    assert p.paired_gain({0: 1.0}, {1: 0.5}) == {}


def test_the_summary_reports_the_paired_gain_overall_and_per_language() -> None:
    m = _bench()
    runs = []
    for s in range(5):
        for arm, shift in (("default", 0.0), ("tokens", 0.01 * (s % 2))):
            by = {"lang:python": 2.0 + s / 10 - shift, "lang:man": 3.0 + s / 10}
            runs.append({"model": "tiny", "clusters": 2, "data": "lang", "arm": arm, "seed": s,
                         "final_val_loss": sum(by.values()) / 2, "val_loss_by_source": by, "bytes_per_sync": 1.0,
                         "unsent_share": 0.0, "routing_skew": 0.1, "off_formula": 0, "sync_events": 1})
    row = m.summarize(runs, ["default", "tokens"])[0]
    g = row["tokens"]
    assert g["gain"]["n"] == 5 and g["gain"]["mean"] == pytest.approx(0.002) and len(g["gain"]["ci"]) == 2
    assert g["gain_by_source"]["lang:python"]["mean"] == pytest.approx(0.004)
    assert g["gain_by_source"]["lang:man"]["mean"] == pytest.approx(0.0)
    assert g["gain_by_source"]["lang:man"]["pays"] is False


def test_routing_skew_over_the_run_cancels_noise_that_the_per_interval_skew_keeps() -> None:
    m = _bench()
    k = m.SETTLED
    # c0 swings 3:1 then 1:3, c1 routes 1:1: every interval is skewed, the run is not (noise cancels)
    swings = [_experts(k, "c0", [[30, 10]]), _experts(k, "c1", [[20, 20]]),
              _experts(k + 1, "c0", [[10, 30]]), _experts(k + 1, "c1", [[20, 20]])]
    assert m.interval_skew(swings) == pytest.approx((0.1 + 0.1 + 1 / 6 + 1 / 6) / 4)
    assert m.routing_skew(swings) == pytest.approx(0.0)
    # a site's own routing persists: the same 3:1 in both intervals is the same skew either way
    steady = [_experts(k + i, c, [[30, 10]] if c == "c0" else [[20, 20]]) for i in range(2) for c in ("c0", "c1")]
    assert m.routing_skew(steady) == pytest.approx(m.interval_skew(steady))
    assert m.routing_skew(steady) == pytest.approx((0.1 + 0.1 + 1 / 6 + 1 / 6) / 4)


def test_a_setting_reports_its_skew_against_its_iid_counterpart_per_seed() -> None:
    m = _bench()
    runs = [{"model": "tiny", "clusters": 2, "data": d, "arm": "default", "seed": s, "routing_skew": v}
            for d, s, v in [("lang", 0, 0.03), ("lang", 1, 0.04), ("lang_iid", 0, 0.01), ("lang_iid", 1, 0.01)]]
    v = m.skew_against_iid(runs, "tiny", 2, "lang")
    assert v["per_seed"] == {0: pytest.approx(3.0), 1: pytest.approx(4.0)}
    assert v["min_ratio"] == pytest.approx(3.0) and v["mean_ratio"] == pytest.approx(3.5)
    assert m.skew_against_iid(runs, "tiny", 2, "lang_iid") is None  # IID against itself: nothing to say
    assert m.skew_against_iid(runs, "tiny", 4, "lang") is None  # no runs at 4 clusters


def test_a_finished_run_recorded_under_a_retired_key_is_reused_under_todays(tmp_path: Path) -> None:
    import json

    sys.path.insert(0, str(REPO / "benchmarks"))
    import _common as C

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    today = ["model=tiny", "algo.rule.verified.expert_weights=tokens"]
    old = ["model=tiny", "algo.penalty.verified.expert_weights=tokens"]  # before issue 50's rename
    (run / "bench_job.json").write_text(json.dumps({"args": C.job_args(run, old)}))
    assert C.finished_run(run, today) is not None
    assert C.finished_run(run, ["model=tiny", "algo.rule.verified.expert_weights=none"]) is None
