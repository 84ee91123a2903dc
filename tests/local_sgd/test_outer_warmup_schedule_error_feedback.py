"""Issue 51: the outer-loop options of 2025–26, each against its closed form — Pier's outer-momentum warm-up and
outer-lr schedule (`algo.outer.*_syncs`), SparseLoCo's error feedback as outer momentum
(`sync.error_feedback_decay`) — and their state through checkpoints, rollbacks and heals."""

from __future__ import annotations

import math

import pytest
import torch

from edit_train.codec.dense import CompressionConfig, ErrorFeedback, quantize_own
from edit_train.federation.inproc import InProcessFederation
from edit_train.local_sgd.sync.outer import OuterConfig, OuterState
from test_sync_inproc import NAMES, late_federation
from toy_federation import config, max_diff

MU, LR = 0.8, 0.7


def _params(seed: int = 0) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"a": [torch.randn(5, 3, generator=g), torch.randn(3, generator=g)], "b": [torch.randn(4, generator=g)]}


def _deltas(k: int, seed: int = 1) -> list[dict[str, list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [{n: [torch.randn(p.shape, generator=g) for p in ps] for n, ps in _params().items()} for _ in range(k)]


def _steps(st: OuterState, deltas: list[dict[str, list[torch.Tensor]]]) -> None:
    for d in deltas:
        for name in st.module_names:
            st.step(name, d[name])


# ------------------------------------------------------------------------------------- Pier: closed forms
def test_lr_and_momentum_schedules_closed_form() -> None:
    c = OuterConfig(lr=LR, momentum=MU, momentum_warmup_syncs=4, lr_warmup_syncs=2, lr_decay_syncs=10,
                    min_lr_ratio=0.1)
    assert [c.momentum_at(t) for t in (1, 2, 3, 4, 9)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8])
    assert c.lr_at(1) == pytest.approx(0.35) and c.lr_at(2) == pytest.approx(LR)
    assert c.lr_at(6) == pytest.approx(LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8))))
    assert c.lr_at(10) == pytest.approx(0.07) and c.lr_at(50) == pytest.approx(0.07)
    assert not OuterConfig().scheduled and OuterConfig().lr_at(7) == OuterConfig().lr


def test_momentum_warmup_steps_the_closed_form_nesterov_update() -> None:
    """Nesterov SGD with μₜ = μ·min(1, t/W): bₜ = μₜ·bₜ₋₁ + Δₜ (b₁ = Δ₁), θ̄ₜ = θ̄ₜ₋₁ − ηₜ(Δₜ + μₜ·bₜ)."""
    cfg = OuterConfig(lr=LR, momentum=MU, momentum_warmup_syncs=3, lr_warmup_syncs=2)
    st = OuterState(_params(), cfg)
    deltas = _deltas(5)
    theta = [p.clone() for p in _params()["a"]]
    buf: list[torch.Tensor] | None = None
    for t, d in enumerate(deltas, start=1):
        st.step("a", d["a"])
        mu, lr = MU * min(1.0, t / 3), LR * min(1.0, t / 2)
        buf = [x.clone() for x in d["a"]] if buf is None else [mu * b + x for b, x in zip(buf, d["a"])]
        theta = [th - lr * (x + mu * b) for th, x, b in zip(theta, d["a"], buf)]
        for got, want in zip(st.anchors["a"], theta):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert int(st.state_dict()["a/outer_syncs/0"]) == 5


def test_default_config_keeps_the_old_state_and_updates() -> None:
    """No schedule: no step counter in the state (checkpoints as before) and the plain Nesterov update."""
    plain, same = OuterState(_params(), OuterConfig()), OuterState(_params(), OuterConfig(momentum_warmup_syncs=1))
    _steps(plain, _deltas(3))
    _steps(same, _deltas(3))  # W = 1: μ from the first step on, the same numbers
    assert not any("outer_syncs" in k for k in plain.state_dict())
    for name in plain.module_names:
        assert all(torch.equal(a, b) for a, b in zip(plain.anchors[name], same.anchors[name]))


@pytest.mark.parametrize("cfg", [
    OuterConfig(momentum_warmup_syncs=3, lr_warmup_syncs=2, lr_decay_syncs=6),
    OuterConfig(optimizer="Adam", lr=0.1, lr_warmup_syncs=2, lr_decay_syncs=5),
], ids=["nesterov", "adam"])
def test_resume_mid_schedule_is_bit_identical(cfg: OuterConfig) -> None:
    deltas = _deltas(6)
    whole = OuterState(_params(), cfg)
    _steps(whole, deltas)
    first = OuterState(_params(), cfg)
    _steps(first, deltas[:3])
    resumed = OuterState(_params(), cfg)
    resumed.load_state_dict({k: v.clone() for k, v in first.state_dict().items()})
    _steps(resumed, deltas[3:])
    assert whole.state_dict().keys() == resumed.state_dict().keys()
    for k, v in whole.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_a_rolled_back_sync_rolls_the_count_back() -> None:
    st = OuterState(_params(), OuterConfig(momentum_warmup_syncs=4))
    _steps(st, _deltas(2))
    snap = st.snapshot("a")
    st.step("a", _deltas(1, seed=9)[0]["a"])
    assert int(st.state_dict()["a/outer_syncs/0"]) == 3
    st.restore("a", snap)
    assert int(st.state_dict()["a/outer_syncs/0"]) == 2


@pytest.mark.parametrize("bad,match", [
    ({"momentum_warmup_syncs": -1}, "momentum_warmup_syncs"),
    ({"lr_warmup_syncs": 4, "lr_decay_syncs": 3}, "lr_decay_syncs"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
])
def test_bad_schedule_is_one_line(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=f"algo.outer.{match}") as e:
        OuterConfig(**bad).validate()
    assert "\n" not in str(e.value)


def test_a_healed_cluster_carries_the_schedule_count() -> None:
    """A late cluster heals the anchor, the outer momentum and its schedule position: all end on one state."""
    outs = late_federation(InProcessFederation(min_clusters=1, join_timeout_s=30.0, timeout_s=30.0),
                           config("layerwise", "edit_norm", syncs=12, momentum_warmup_syncs=20, lr_warmup_syncs=5))
    assert outs["c2"].algo is not None and outs["c2"].algo.membership.healed_from
    states = {n: outs[n].algo.driver.core.outer.state_dict() for n in NAMES}  # type: ignore[union-attr]
    counts = {n: {k: int(v) for k, v in s.items() if "outer_syncs" in k} for n, s in states.items()}
    assert counts["c0"] and all(v == 12 for v in counts["c0"].values())
    for n in NAMES[1:]:
        assert counts[n] == counts["c0"], n
        assert max_diff(outs[n].anchors, outs["c0"].anchors) == 0.0, n


# ------------------------------------------------------------------- SparseLoCo: error feedback as momentum
@pytest.mark.parametrize("scheme", ["int8", "topk"])
def test_error_feedback_decay_is_a_momentum_buffer_of_what_was_not_sent(scheme: str) -> None:
    """eₖ = β·eₖ₋₁ + Δₖ − cₖ (cₖ what was sent): after k syncs Σⱼ βᵏ⁻ʲ·cⱼ + eₖ = Σⱼ βᵏ⁻ʲ·Δⱼ, the momentum buffer
    of SGD(momentum=β) fed the Δⱼ — what was sent plus the residual *is* the outer momentum."""
    beta, k, n = 0.9, 6, 512
    cfg = CompressionConfig(scheme, 256, "fp32", True, 0.05, 2, error_feedback_decay=beta)
    cfg.validate()
    fb = ErrorFeedback(cfg.error_feedback_decay)
    g = torch.Generator().manual_seed(0)
    p = torch.zeros(n, requires_grad=True)
    sgd = torch.optim.SGD([p], lr=1.0, momentum=beta)
    sent_sum = torch.zeros(n, dtype=torch.float64)
    for _ in range(k):
        delta = torch.randn(n, generator=g)
        send = fb.compensate("m", delta)
        _, sent = quantize_own(send, cfg)
        fb.update("m", sent, send)
        sent_sum = beta * sent_sum + sent.double()
        p.grad = delta.clone()
        sgd.step()
    buf = sgd.state[p]["momentum_buffer"].double()
    res = fb.residual("m")
    assert res is not None
    torch.testing.assert_close(sent_sum + res.double(), buf, rtol=1e-5, atol=1e-5)
    if scheme == "topk":  # 5 % of each chunk sent: most of the momentum is still in the residual
        assert float(res.norm()) > 0.5 * float(buf.norm())


def test_error_feedback_decay_one_is_plain_error_feedback_and_bad_values_are_one_line() -> None:
    fb, plain = ErrorFeedback(1.0), ErrorFeedback()
    r = torch.ones(4)
    fb.update("m", torch.zeros(4), r)
    plain.update("m", torch.zeros(4), r)
    assert torch.equal(fb.compensate("m", r), plain.compensate("m", r))
    assert torch.equal(fb.pinned().compensate("m", r), r + r)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="sync.error_feedback_decay") as e:
            CompressionConfig("int8", error_feedback_decay=bad).validate()
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="error_feedback=true"):
        CompressionConfig("int8", error_feedback=False, error_feedback_decay=0.5).validate()


# ------------------------------------------------------------------------- a real run: resume bit-identical
def test_a_run_with_every_option_resumes_bit_identically(tmp_path, small_corpus, torch_one_thread) -> None:
    """`algo=edit` with Muon inner steps and Pier's warm-up and schedule: 6 steps (checkpoint every 3) then
    resume=auto to 9 == 9 steps uninterrupted, every checkpointed tensor (model, inner and outer state) bit for bit."""
    from conftest import resumed_bit_identically

    loaded = resumed_bit_identically(tmp_path, small_corpus, "algo=edit", "algo.interval=3", "algo.warmup_steps=0",
                                     "train.optimizer=muon", "train.eval_every=3", "algo.outer.momentum_warmup_syncs=3",
                                     "algo.outer.lr_warmup_syncs=2", "algo.outer.lr_decay_syncs=3")
    counts = [int(v) for a in loaded for k, v in a.items() if k.endswith("outer_syncs/0")]
    assert counts and set(counts) == {3}  # the schedule's position is in the checkpoint
    assert any(k.endswith("momentum_buffer") for a in loaded for k in a)  # Muon's state too


def test_top_k_defaults_to_the_hundredth_pair_with_error_feedback_as_momentum() -> None:
    """Unset, `sync.error_feedback_decay` is 0.6 for top-k that resends with error feedback (issue 51's pair: 3 of 32
    groups of 8, 2 bits) and 1 — plain, exact error feedback — for every dense codec, without error feedback and
    under `sync.unsent=keep`; a value given is taken as given."""
    from edit_train.cli.common import compose
    from edit_train.config import validate

    def of(*overrides: str) -> CompressionConfig:
        cfg = compose(list(overrides))
        validate(cfg)
        return CompressionConfig.of(cfg.sync)

    c = of("sync.compression=topk")
    assert (c.topk_density, c.bits, c.topk_group, c.unsent, c.error_feedback_decay) == (0.09375, 2, 8, "resend", 0.6)
    assert c.format.k == 3 and c.format.groups == 32
    assert of("sync.compression=int8").error_feedback_decay == 1.0
    assert of("sync.compression=topk", "sync.error_feedback=false").error_feedback_decay == 1.0
    assert of("sync.compression=topk", "sync.unsent=keep").error_feedback_decay == 1.0
    assert of("sync.compression=topk", "sync.error_feedback_decay=0.95").error_feedback_decay == 0.95
    assert of("sync.compression=topk", "sync.error_feedback_decay=1").error_feedback_decay == 1.0
