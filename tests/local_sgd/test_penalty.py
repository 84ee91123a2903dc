"""Pure-math tests for the anomaly-aware pseudo-gradient aggregator (DESIGN §4 steps 2–4)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from edit_train.local_sgd.penalty import EWMAStats, clip_factor
from edit_train.local_sgd.aggregation.rules import EditNormConfig, RuleConfig, softmax_weights as weights
from edit_train.local_sgd.aggregation.verified import VerifiedConfig
from fixed_set import FixedSet, merge


def ewma_ref(xs: list[float], alpha: float) -> tuple[float, float, float]:
    """docs/sync_math.md: rate max(alpha, 1/n) for the n-th value, S = (1-a)(S + a d^2), W2 = sum of squared
    normalised weights; returns (mu, S, unbiased variance S / (1 - W2))."""
    mu, m2, w2 = xs[0], 0.0, 1.0
    for n, x in enumerate(xs[1:], start=2):
        a = max(alpha, 1.0 / n)
        d = x - mu
        mu = mu + a * d
        m2 = (1 - a) * (m2 + a * d * d)
        w2 = (1 - a) ** 2 * w2 + a * a
    return mu, m2, m2 / (1 - w2)


def test_ewma_closed_form() -> None:
    xs = [1.0, 1.5, 0.7, 2.0, 1.1, 0.9]
    st = EWMAStats(2, alpha=0.1)
    for x in xs:
        st.update(torch.tensor([x, 2 * x], dtype=torch.float64), torch.tensor([True, True]))
    for w, scale in ((0, 1.0), (1, 2.0)):
        mu, m2, var = ewma_ref([scale * x for x in xs], 0.1)
        assert st.mu[w].item() == pytest.approx(mu, rel=1e-12)
        assert st.m2[w].item() == pytest.approx(m2, rel=1e-12)
        assert st.sigma[w].item() == pytest.approx(math.sqrt(var), rel=1e-12)
    # while a = 1/n this is exactly the sample mean and the (n-1) sample variance
    t = torch.tensor(xs, dtype=torch.float64)
    assert st.mu[0].item() == pytest.approx(float(t.mean()), rel=1e-12)
    assert st.sigma[0].item() == pytest.approx(float(t.std()), rel=1e-12)
    assert st.count.tolist() == [len(xs), len(xs)]
    z = st.zscore(torch.tensor([3.0, 3.0]))
    mu0, _, var0 = ewma_ref(xs, 0.1)
    assert z[0].item() == pytest.approx((3.0 - mu0) / math.sqrt(var0))


def test_ewma_is_plain_alpha_ewma_after_the_first_values() -> None:
    st = EWMAStats(1, alpha=0.25)
    xs = [1.0, 2.0, 4.0, 3.0, 5.0, 2.5, 7.0, 1.0, 3.0]
    for x in xs:
        st.update(torch.tensor([x]), torch.tensor([True]))
    # by hand: n=2 -> a=1/2, n=3 -> 1/3, n=4 -> 1/4 = alpha, then alpha
    mu, m2, w2 = 1.0, 0.0, 1.0
    for n, x in enumerate(xs[1:], start=2):
        a = 1 / 2 if n == 2 else 1 / 3 if n == 3 else 0.25
        d = x - mu
        mu = mu + a * d
        m2 = (1 - a) * (m2 + a * d * d)
        w2 = (1 - a) ** 2 * w2 + a * a
    assert st.mu.item() == pytest.approx(mu) and st.m2.item() == pytest.approx(m2)
    assert st.w2.item() == pytest.approx(w2, rel=1e-12)
    assert st.var.item() == pytest.approx(m2 / (1 - w2), rel=1e-12)


def test_slowly_rising_norms_are_never_all_anomalous() -> None:
    """A healthy module whose norm drifts on every worker must not be frozen (all anomalous)."""
    agg = FixedSet(EditNormConfig(), 2)
    for k in range(1, 60):
        g = 1 + 0.05 * k
        assert not agg.decide("m", torch.tensor([g * 1.01, g * 0.99])).skip, k
    # while a real spike on one worker is still caught
    d = agg.decide("m", torch.tensor([4.0 * 20, 4.0]))
    assert d.left_out == [True, False]


def test_zscore_zero_sigma() -> None:
    st = EWMAStats(3, alpha=0.02)
    st.update(torch.tensor([1.0, 1.0, 1.0]), torch.ones(3, dtype=torch.bool))
    assert st.zscore(torch.tensor([1.0, 2.0, 0.5])).tolist() == [0.0, math.inf, -math.inf]


def test_update_only_accepted() -> None:
    st = EWMAStats(2, alpha=0.5)
    st.update(torch.tensor([1.0, 1.0]), torch.tensor([True, False]))
    st.update(torch.tensor([float("nan"), 3.0]), torch.tensor([True, True]))  # NaN never accepted
    assert st.count.tolist() == [1, 1]
    assert st.mu.tolist() == [1.0, 3.0]


def _feed(agg: FixedSet, values: list[list[float]]) -> None:
    for v in values:
        agg.decide("layers.0", torch.tensor(v, dtype=torch.float64))


def test_warmup_never_flags_finite_but_flags_nonfinite() -> None:
    cfg = EditNormConfig(warmup_syncs=5)
    agg = FixedSet(cfg, 2)
    for i in range(5):
        big = 1.0 if i < 3 else 1e9
        d = agg.decide("m", torch.tensor([big, float("nan") if i == 4 else 1.0]))
        assert d.left_out[0] is False
    assert d.left_out == [False, True]
    assert d.weights[1] == 0.0 and d.weights[0] == 1.0
    assert agg.stats["m"].count.tolist() == [5, 4]


def test_spike_after_warmup_flagged_and_not_folded() -> None:
    cfg = EditNormConfig(warmup_syncs=10, ewma_alpha=0.1)
    agg = FixedSet(cfg, 2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        _feed(agg, [(1.0 + 0.1 * torch.randn(2, generator=gen, dtype=torch.float64)).tolist()])
    st = agg.stats["layers.0"]
    mu, m2, count = st.mu.clone(), st.m2.clone(), st.count.clone()
    sigma = st.sigma_eff(cfg.sigma_floor)
    spike = (mu[0] + 10 * sigma[0]).item()
    ok = (mu[1] + 1 * sigma[1]).item()
    d = agg.decide("layers.0", torch.tensor([spike, ok]))
    assert d.left_out == [True, False]
    assert d.evidence[0]["z"] == pytest.approx(10.0) and d.evidence[1]["z"] == pytest.approx(1.0)
    assert d.weights == [0.0, 1.0]
    # the spike does not move worker 0's stats; worker 1's accepted value does
    assert st.mu[0] == mu[0] and st.m2[0] == m2[0] and st.count[0] == count[0]
    assert st.count[1] == count[1] + 1
    mu1_ref, m21_ref = mu[1].item(), m2[1].item()
    dd = ok - mu1_ref
    assert st.mu[1].item() == pytest.approx(mu1_ref + 0.1 * dd)
    assert st.m2[1].item() == pytest.approx(0.9 * (m21_ref + 0.1 * dd * dd))


def test_anomaly_disabled_only_nonfinite() -> None:
    agg = FixedSet(EditNormConfig(anomaly=False, warmup_syncs=2), 2)
    _feed(agg, [[1.0, 1.0], [1.1, 0.9], [1.0, 1.05]])
    d = agg.decide("layers.0", torch.tensor([1e6, math.inf]))
    assert d.left_out == [False, True]


def test_all_anomalous() -> None:
    agg = FixedSet(EditNormConfig(), 3)
    d = agg.decide("m", torch.tensor([math.nan, math.inf, -math.inf]))
    assert d.skip and d.weights == [0.0, 0.0, 0.0]
    json.dumps(d.as_dict(), allow_nan=False)


def softmax_ref(gs: list[float], t: float) -> list[float]:
    e = [math.exp(-g / t) for g in gs]
    return [x / sum(e) for x in e]


def test_softmax_weights_closed_form_and_temperature() -> None:
    """softmax(-G/(T*m)), m = the (lower) median accepted norm: here m = 2."""
    g = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    none = torch.zeros(3, dtype=torch.bool)
    for t in (0.5, 1.0, 10.0):
        w = weights(g, none, EditNormConfig(temperature=t))
        assert w.tolist() == pytest.approx(softmax_ref([0.5, 1.0, 2.0], t), rel=1e-12)
    # higher temperature -> flatter
    w_lo = weights(g, none, EditNormConfig(temperature=0.5))
    w_hi = weights(g, none, EditNormConfig(temperature=10.0))
    assert w_hi.max() - w_hi.min() < w_lo.max() - w_lo.min()
    # numerically stable (and scale-free) for huge norms
    w = weights(torch.tensor([1e6, 2e6], dtype=torch.float64), torch.zeros(2, dtype=torch.bool), EditNormConfig())
    assert w.tolist() == pytest.approx(softmax_ref([1.0, 2.0], 1.0))
    # all-zero norms (a frozen module): uniform
    assert weights(torch.zeros(2), torch.zeros(2, dtype=torch.bool), EditNormConfig()).tolist() == [0.5, 0.5]


def test_weights_exclude_anomalous_and_renormalise() -> None:
    g = torch.tensor([1.0, 2.0, 3.0])
    w = weights(g, torch.tensor([False, True, False]), EditNormConfig())
    ref = softmax_ref([1.0, 3.0], 1.0)  # lower median of the accepted [1, 3] is 1
    assert w.tolist() == pytest.approx([ref[0], 0.0, ref[1]])
    u = weights(g, torch.tensor([False, True, False]), EditNormConfig(weighting="uniform"))
    assert u.tolist() == [0.5, 0.0, 0.5]
    assert weights(g, torch.ones(3, dtype=torch.bool), EditNormConfig()).tolist() == [0.0, 0.0, 0.0]


def test_step_share_blending() -> None:
    g = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    an = torch.tensor([False, False, True])
    cfg = EditNormConfig(step_weight_ratio=0.25)
    steps = torch.tensor([10.0, 30.0, 99.0], dtype=torch.float64)
    w = weights(g, an, cfg, steps=steps)
    # per-step norms [0.1, 0.0667]; lower median 0.0667 -> logits [-1.5, -1]
    sm = softmax_ref([1.5, 1.0], 1.0)
    s = [0.25, 0.75]
    ref = [0.75 * sm[i] + 0.25 * s[i] for i in range(2)] + [0.0]
    assert w.tolist() == pytest.approx(ref)
    assert float(w.sum()) == pytest.approx(1.0)
    # ratio 0: the per-step softmax alone; no steps: softmax of G (lower median 1 -> softmax(-G))
    assert weights(g, an, EditNormConfig(), steps=steps).tolist() == pytest.approx(sm + [0.0])
    assert weights(g, an, cfg).tolist() == pytest.approx(softmax_ref([1.0, 2.0], 1.0) + [0.0])


def test_clip_closed_form() -> None:
    phi = RuleConfig(clip_threshold=10.0).clip_phi
    assert clip_factor(5.0**2, phi) == 1.0
    assert clip_factor(1600.0, phi) == pytest.approx(10.0 / (40.0 + 1e-6))
    assert clip_factor(1e18, RuleConfig(clip=False).clip_phi) == 1.0
    assert clip_factor(math.inf, phi) == 0.0 and clip_factor(math.nan, phi) == 0.0  # non-finite: drop the update


def test_weighted_sum_and_clip() -> None:
    gen = torch.Generator().manual_seed(1)
    deltas = [[torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)] for _ in range(3)]
    w = [0.2, 0.3, 0.5]
    out, coef = merge(deltas, w, RuleConfig(clip=False).clip_phi)
    assert coef == 1.0
    for k in range(2):
        torch.testing.assert_close(out[k], sum(wi * d[k] for wi, d in zip(w, deltas)))
    big = [[100 * t for t in d] for d in deltas]
    out, coef = merge(big, w, RuleConfig(clip_threshold=1.0).clip_phi)
    ref = [sum(wi * d[k] for wi, d in zip(w, big)) for k in range(2)]
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in ref))
    assert coef == pytest.approx(1.0 / (norm + 1e-6))
    total = math.sqrt(sum(float(t.double().pow(2).sum()) for t in out))
    assert total == pytest.approx(1.0, rel=1e-5)


def test_nan_worker_is_ignored() -> None:
    gen = torch.Generator().manual_seed(2)
    deltas = [[torch.randn(6, generator=gen)] for _ in range(3)]
    deltas[1][0][2] = float("nan")
    norms = torch.tensor([float(torch.linalg.vector_norm(d[0])) for d in deltas], dtype=torch.float64)
    agg = FixedSet(EditNormConfig(weighting="uniform"), 3)
    dec = agg.decide("layers.0", norms)
    assert dec.left_out == [False, True, False]
    assert dec.weights == [0.5, 0.0, 0.5]
    out, _ = merge(deltas, dec.weights, None)
    assert torch.isfinite(out[0]).all()
    ref, _ = merge([deltas[0], deltas[2]], [0.5, 0.5], None)
    torch.testing.assert_close(out[0], ref[0])


def test_state_round_trip() -> None:
    agg = FixedSet(EditNormConfig(warmup_syncs=2), 2)
    _feed(agg, [[1.0, 2.0], [1.2, 2.1], [0.9, 1.9]])
    agg.decide("head", torch.tensor([3.0, 4.0]))
    meta, sd = agg.state()
    assert meta == {"roster": ["c0", "c1"]}
    fields = ("mu", "m2", "count", "streak", "streak_mu", "streak_m2")
    assert set(sd) == {f"{m}/{f}" for m in ("layers.0", "head") for f in fields}
    other = FixedSet(EditNormConfig(warmup_syncs=2), 2)
    other.load(meta, sd)
    x = torch.tensor([5.0, 2.05])
    assert other.decide("layers.0", x) == agg.decide("layers.0", x)
    # statistics that do not fit the roster they come with are refused
    with pytest.raises(ValueError, match="does not fit a roster of 3 clusters"):
        FixedSet(EditNormConfig(), 3).load({"roster": ["c0", "c1", "c2"]}, sd)
    # statistics are kept per cluster name: a cluster the state does not know starts empty, the others keep theirs
    grown = FixedSet(EditNormConfig(warmup_syncs=2), 3)
    grown.load(meta, sd)
    count = sd["layers.0/count"].tolist()
    d = grown.decide("layers.0", torch.tensor([1.1, 2.0, 7.0]))
    assert grown.stats["layers.0"].count.tolist() == [count[0] + 1, count[1] + 1, 1] and not any(d.left_out)
    # a checkpoint from before the streak fields loads with empty streaks
    old = FixedSet(EditNormConfig(warmup_syncs=2), 2)
    old.load(meta, {k: v for k, v in sd.items() if k.rsplit("/", 1)[1] in ("mu", "m2", "count")})
    assert old.stats["layers.0"].streak.tolist() == [0, 0]
    ref = FixedSet(EditNormConfig(warmup_syncs=2), 2)
    ref.load(meta, sd)
    assert old.decide("layers.0", x) == ref.decide("layers.0", x)


NORM_TEST = [  # EDiT's norm test: fields of both rules that run it
    ({"ewma_alpha": 1.5}, "ewma_alpha"),
    ({"warmup_syncs": -1}, "warmup_syncs"),
    ({"z_threshold": 0.0}, "z_threshold"),
    ({"sigma_floor": -0.1}, "sigma_floor"),
    ({"sigma_floor": 1.0}, "sigma_floor"),
    ({"readmit_after": -1}, "readmit_after"),
]
EDIT_NORM = [({"temperature": 0.0}, "temperature"), ({"weighting": "max"}, "weighting"),
             ({"step_weight_ratio": 2.0}, "step_weight_ratio")]


@pytest.mark.parametrize("kw, field", NORM_TEST + EDIT_NORM)
def test_validate_edit_norm(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^algo\\.rule\\.edit_norm\\.{field} "):
        EditNormConfig(**kw).validate()
    with pytest.raises(ValueError, match=f"^algo\\.rule\\.edit_norm\\.{field} "):
        RuleConfig(edit_norm=EditNormConfig(**kw)).validate()


@pytest.mark.parametrize("kw, field", NORM_TEST)
def test_validate_the_norm_test_of_verified(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^algo\\.rule\\.verified\\.{field} "):
        RuleConfig(verified=VerifiedConfig(**kw)).validate()


def test_validate_clip_threshold() -> None:
    with pytest.raises(ValueError, match="^algo\\.rule\\.clip_threshold "):
        RuleConfig(clip_threshold=-1.0).validate()
    RuleConfig().validate()
