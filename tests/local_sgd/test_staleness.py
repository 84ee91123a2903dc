"""Issue 51: the staleness correction (`algo.outer.staleness_correction`, local_sgd/sync/staleness.py) against its
closed form, through the outer step, over a cluster's ranks, through checkpoints, rollbacks and heals."""

from __future__ import annotations

import math

import pytest
import torch

from edit_train.federation.inproc import InProcessFederation
from edit_train.local_sgd.sync.outer import OuterConfig, OuterState
from edit_train.local_sgd.sync.staleness import StalenessConfig, correct
from test_sync_inproc import NAMES, late_federation
from toy_federation import config, max_diff

MU, LR = 0.8, 0.7
ON = {"staleness_correction": True}


def test_closed_form_one_block() -> None:
    """m = (1, 0), Δ = (−1, 1): c = −1/√2, conf = √2/(√2 + κ), β = k·(−c)·conf, Δ̂ = Δ − β·c·‖Δ‖·m̂."""
    m, d = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([-1.0, 1.0], dtype=torch.float64)
    for k, kappa in ((1.0, 1.0), (0.5, 2.0)):
        c, n = -1 / math.sqrt(2), math.sqrt(2)
        beta = min(k * -c * n / (n + kappa), 1.0)
        (got,), (cos,) = correct([d], [m], StalenessConfig(strength=k, kappa=kappa))
        assert cos == pytest.approx(c)
        torch.testing.assert_close(got, d - beta * c * n * m)
        assert float(got @ m) == pytest.approx((1 - beta) * c * n)  # β of the component along m is gone
        assert float(got.norm()) <= n
    (capped,), _ = correct([d], [m], StalenessConfig(strength=100.0, cap=1.0, kappa=0.0))
    torch.testing.assert_close(capped, torch.tensor([0.0, 1.0], dtype=torch.float64))  # β = 1: orthogonal to m


def test_aligned_blocks_and_no_momentum_pass_untouched() -> None:
    d, m = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])], [torch.tensor([1.0, 1.0]), None]
    got, cos = correct(d, m, StalenessConfig())
    assert got[0] is d[0] and got[1] is d[1]
    assert cos[0] == pytest.approx(3 / math.sqrt(10)) and math.isnan(cos[1])
    zero, _ = correct([torch.zeros(2)], [torch.tensor([1.0, 0.0])], StalenessConfig())
    assert torch.equal(zero[0], torch.zeros(2))


def test_shards_with_a_reduce_equal_the_whole_tensor() -> None:
    """Each rank holds a shard; the three sums are reduced over the ranks: the corrected shards are the whole
    tensor's corrected rows."""
    g = torch.Generator().manual_seed(3)
    d, m = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    d = d - ((d * m).sum() / m.pow(2).sum() + 0.5) * m  # ⟨d, m⟩ = −‖m‖²/2: anti-aligned
    cfg = StalenessConfig()
    (whole,), (c_whole,) = correct([d], [m], cfg)
    assert c_whole < 0
    halves = [(d[:5], m[:5]), (d[5:], m[5:])]
    stats = [torch.tensor([[float((dd.double() * mm.double()).sum()), float(dd.double().pow(2).sum()),
                            float(mm.double().pow(2).sum())]], dtype=torch.float64) for dd, mm in halves]
    total = stats[0] + stats[1]
    parts = [correct([dd], [mm], cfg, reduce=lambda t: t - t + total)[0][0] for dd, mm in halves]
    torch.testing.assert_close(torch.cat(parts), whole)


def _params(seed: int = 0) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"a": [torch.randn(5, 3, generator=g), torch.randn(3, generator=g)], "b": [torch.randn(4, generator=g)]}


def _deltas(k: int, seed: int = 1) -> list[dict[str, list[torch.Tensor]]]:
    """Alternating signs: every other Δ points against the momentum of the one before."""
    g = torch.Generator().manual_seed(seed)
    base = {n: [torch.randn(p.shape, generator=g) for p in ps] for n, ps in _params().items()}
    return [{n: [(-1.0) ** j * x + 0.3 * torch.randn(x.shape, generator=g) for x in xs] for n, xs in base.items()}
            for j in range(k)]


def _steps(st: OuterState, deltas: list[dict[str, list[torch.Tensor]]]) -> None:
    for d in deltas:
        for name in st.module_names:
            st.step(name, d[name])


def test_outer_step_is_nesterov_on_the_corrected_delta() -> None:
    """bₜ = μ·bₜ₋₁ + Δ̂ₜ, θ̄ₜ = θ̄ₜ₋₁ − η(Δ̂ₜ + μ·bₜ), Δ̂ₜ the correction of Δₜ against bₜ₋₁ (Δ̂₁ = Δ₁)."""
    st = OuterState(_params(), OuterConfig(lr=LR, momentum=MU, **ON))
    deltas = _deltas(5)
    theta = [p.clone() for p in _params()["a"]]
    buf: list[torch.Tensor] | None = None
    corrected = 0
    for d in deltas:
        st.step("a", d["a"])
        fixed = d["a"] if buf is None else correct(d["a"], buf, StalenessConfig())[0]
        corrected += sum(not torch.equal(f, x) for f, x in zip(fixed, d["a"]))
        buf = [x.clone() for x in fixed] if buf is None else [MU * b + x for b, x in zip(buf, fixed)]
        theta = [th - LR * (x + MU * b) for th, x, b in zip(theta, fixed, buf)]
        for got, want in zip(st.anchors["a"], theta):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert corrected >= 2  # it acted: the alternating Δ point against the momentum


def test_adam_reads_its_first_moment() -> None:
    st = OuterState(_params(), OuterConfig(optimizer="Adam", lr=0.1, momentum=0.0, nesterov=False, **ON))
    _steps(st, _deltas(2))
    assert all(not math.isnan(c) for c in st.cosines["a"]) and min(st.cosines["a"]) < 0


def test_off_by_default_and_unchanged() -> None:
    assert OuterConfig().staleness is None
    plain, off = OuterState(_params(), OuterConfig()), OuterState(_params(), OuterConfig(staleness_strength=3.0))
    _steps(plain, _deltas(3))
    _steps(off, _deltas(3))
    for name in plain.module_names:
        assert all(torch.equal(a, b) for a, b in zip(plain.anchors[name], off.anchors[name]))
    assert plain.state_dict().keys() == off.state_dict().keys()


@pytest.mark.parametrize("bad,match", [
    ({"staleness_cap": 1.5}, "staleness_cap"),
    ({"staleness_strength": -1.0}, "staleness_strength"),
    ({"staleness_kappa": float("nan")}, "staleness_kappa"),
    ({"staleness_correction": True, "momentum": 0.0, "nesterov": False}, "staleness_correction"),
])
def test_bad_values_are_one_line(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=f"algo.outer.{match}") as e:
        OuterConfig(**bad).validate()
    assert "\n" not in str(e.value)


def test_resume_and_rollback_are_bit_identical() -> None:
    cfg = OuterConfig(lr=LR, momentum=MU, momentum_warmup_syncs=2, **ON)
    deltas = _deltas(6)
    whole = OuterState(_params(), cfg)
    _steps(whole, deltas)
    first = OuterState(_params(), cfg)
    _steps(first, deltas[:3])
    resumed = OuterState(_params(), cfg)
    resumed.load_state_dict({k: v.clone() for k, v in first.state_dict().items()})
    snap = resumed.snapshot("a")
    resumed.step("a", _deltas(1, seed=9)[0]["a"])  # a sync that is rolled back
    resumed.restore("a", snap)
    _steps(resumed, deltas[3:])
    assert whole.state_dict().keys() == resumed.state_dict().keys()
    for k, v in whole.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_a_healed_cluster_carries_the_momentum_the_correction_reads() -> None:
    """A late cluster heals the anchor and the outer momentum; with the correction on every cluster then
    corrects against the same momentum and all end on one anchor and one outer state, bit for bit."""
    outs = late_federation(InProcessFederation(min_clusters=1, join_timeout_s=30.0, timeout_s=30.0),
                           config("layerwise", "edit_norm", syncs=12, **ON))
    assert outs["c2"].algo is not None and outs["c2"].algo.membership.healed_from
    outers = {n: outs[n].algo.driver.core.outer for n in NAMES}  # type: ignore[union-attr]
    assert all(o.staleness is not None and o.cosines for o in outers.values())
    states = {n: o.state_dict() for n, o in outers.items()}
    for n in NAMES[1:]:
        assert max_diff(outs[n].anchors, outs["c0"].anchors) == 0.0, n
        assert states[n].keys() == states["c0"].keys()
        assert all(torch.equal(v, states["c0"][k]) for k, v in states[n].items()), n
        same = [torch.tensor(outers[n].cosines[u]).nan_to_num(9.0) for u in sorted(outers[n].cosines)]
        ref = [torch.tensor(outers["c0"].cosines[u]).nan_to_num(9.0) for u in sorted(outers["c0"].cosines)]
        assert len(same) == len(ref) and all(torch.equal(x, y) for x, y in zip(same, ref)), n


def test_a_run_with_the_correction_resumes_bit_identically(tmp_path, small_corpus, torch_one_thread) -> None:
    """`algo=a_edit`-style correction on a real `algo=edit` run (the trainer, checkpoints on disk): 6 steps
    (checkpoint every 3) then resume=auto to 9 == 9 steps uninterrupted, every checkpointed tensor bit for bit."""
    from conftest import resumed_bit_identically

    resumed_bit_identically(tmp_path, small_corpus, "algo=edit", "algo.interval=3", "algo.warmup_steps=0",
                            "train.eval_every=3", "algo.outer.staleness_correction=true")


def test_an_overlapped_a_edit_run_with_the_correction_trains(tmp_path, small_corpus, torch_one_thread) -> None:
    """Where the merged Δ is stale (`sync.mode=overlap` lands it one interval late): a real `algo=a_edit` run with
    the correction on ends finite and synced."""
    from conftest import run_train, tiny_overrides

    s = run_train(tiny_overrides(tmp_path / "run", small_corpus, "algo=a_edit", "algo.interval=3", "algo.sync_time_s=0.5",
                                 "algo.warmup_steps=0", "sync.mode=overlap", "algo.outer.staleness_correction=true",
                                 "train.steps=9", "train.eval_every=9"))
    assert s["steps"] >= 9 and s["syncs"] >= 2 and math.isfinite(s["final_val_loss"])
