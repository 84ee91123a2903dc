"""benchmarks/moe_sync.py's readings, on crafted events: the routing skew (how far token weights would be from
today's rule) and the IID paired noise a gain must beat."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


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
