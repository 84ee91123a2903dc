"""Tests for the anchor + outer optimizer (DESIGN §4 step 5), including the averaging equivalence."""

from __future__ import annotations

import pytest
import torch

from edit_train.local_sgd.sync.outer import OuterConfig, OuterState
from edit_train.local_sgd.aggregation.rules import EditNormConfig, RuleConfig
from fixed_set import FixedSet, merge


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": [torch.randn(5, 3, generator=g).to(dtype)],
        "layers.0": [torch.randn(4, 4, generator=g).to(dtype), torch.randn(4, generator=g).to(dtype)],
    }


def test_anchor_cloned_and_pseudo_grad() -> None:
    params = _params()
    st = OuterState(params, OuterConfig())
    assert st.module_names == ["embed", "layers.0"]
    assert st.numel("layers.0") == 20 and st.nbytes("layers.0") == 80
    a0 = [a.clone() for a in st.anchors["layers.0"]]
    for p in params["layers.0"]:
        p.add_(0.5)  # local training moves the live params, not the anchor
    for a, ref in zip(st.anchors["layers.0"], a0):
        assert torch.equal(a, ref)
    for d in st.pseudo_grad("layers.0"):
        torch.testing.assert_close(d, torch.full_like(d, -0.5))


def test_bf16_params_keep_fp32_anchor() -> None:
    params = _params(dtype=torch.bfloat16)
    st = OuterState(params, OuterConfig())
    assert all(a.dtype == torch.float32 for a in st.anchors["embed"])
    assert st.pseudo_grad("embed")[0].dtype == torch.float32
    st.reset("embed")
    assert params["embed"][0].dtype == torch.bfloat16


def test_nesterov_sgd_two_steps_closed_form() -> None:
    lr, mom = 0.7, 0.8
    p = torch.tensor([1.0, -2.0, 3.0])
    st = OuterState({"m": [p]}, OuterConfig(lr=lr, momentum=mom, nesterov=True))
    g1, g2 = torch.tensor([0.1, 0.2, -0.3]), torch.tensor([-0.5, 0.4, 0.05])
    theta = p.clone()
    buf = g1.clone()
    theta = theta - lr * (g1 + mom * buf)
    st.step("m", [g1])
    torch.testing.assert_close(st.anchors["m"][0], theta)
    assert st.anchors["m"][0].grad is None
    assert torch.equal(p, torch.tensor([1.0, -2.0, 3.0]))  # live params untouched by step
    buf = mom * buf + g2
    theta = theta - lr * (g2 + mom * buf)
    st.step("m", [g2])
    torch.testing.assert_close(st.anchors["m"][0], theta)
    st.reset("m")
    torch.testing.assert_close(p, theta)


def test_skip_resets_without_step() -> None:
    params = _params()
    st = OuterState(params, OuterConfig())
    anchor = st.anchors["embed"][0].clone()
    params["embed"][0].mul_(3.0)
    st.skip("embed")
    assert torch.equal(params["embed"][0], anchor) and torch.equal(st.anchors["embed"][0], anchor)
    assert not st.optimizers["embed"].state


def _run(cfg: OuterConfig, steps: int = 3, seed: int = 0) -> tuple[OuterState, dict]:
    params = _params(seed)
    st = OuterState(params, cfg)
    g = torch.Generator().manual_seed(seed + 100)
    for _ in range(steps):
        for name in st.module_names:
            st.step(name, [torch.randn(a.shape, generator=g) for a in st.anchors[name]])
            st.reset(name)
    return st, params


def test_offload_cpu_matches() -> None:
    a, _ = _run(OuterConfig(offload=False))
    b, _ = _run(OuterConfig(offload=True))
    for name in a.module_names:
        for x, y in zip(a.anchors[name], b.anchors[name]):
            assert torch.equal(x, y)
    # explicit prefetch/release split works too
    b.prefetch("embed")
    b.step("embed", [torch.ones(5, 3)])
    b.release("embed")
    a.step("embed", [torch.ones(5, 3)])
    assert torch.equal(a.anchors["embed"][0], b.anchors["embed"][0])


ADAM = OuterConfig(optimizer="Adam", lr=0.01, kwargs={"betas": (0.8, 0.9)})


@pytest.mark.parametrize("cfg", [OuterConfig(), ADAM])
def test_state_dict_round_trip_bit_identical(cfg: OuterConfig) -> None:
    st, _ = _run(cfg, steps=2)
    sd = st.state_dict()
    assert "embed/anchor/0" in sd
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in sd.values())
    if cfg.optimizer == "SGD":
        assert "layers.0/momentum_buffer/1" in sd
    else:
        assert {"layers.0/exp_avg/1", "layers.0/exp_avg_sq/1", "layers.0/step/1"} <= set(sd)
    fresh = OuterState(_params(seed=7), cfg)  # different initial values, overwritten by the load
    fresh.load_state_dict(sd)
    d = [torch.full((5, 3), 0.3)]
    st.step("embed", d)
    fresh.step("embed", d)
    assert torch.equal(st.anchors["embed"][0], fresh.anchors["embed"][0])
    # loading a pre-first-step state (no momentum buffer) works too
    empty = OuterState(_params(), cfg)
    sd0 = empty.state_dict()
    assert set(sd0) == {"embed/anchor/0", "layers.0/anchor/0", "layers.0/anchor/1"}
    fresh.load_state_dict(sd0)
    assert not fresh.optimizers["embed"].state


def test_safetensors_round_trip(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    st, _ = _run(OuterConfig(), steps=1)
    save_file(st.state_dict(), str(tmp_path / "outer.safetensors"))
    fresh = OuterState(_params(), OuterConfig())
    fresh.load_state_dict(load_file(str(tmp_path / "outer.safetensors")))
    d = [torch.ones(4, 4), torch.ones(4)]
    st.step("layers.0", d)
    fresh.step("layers.0", d)
    assert all(torch.equal(x, y) for x, y in zip(st.anchors["layers.0"], fresh.anchors["layers.0"]))


def test_load_rejects_bad_state() -> None:
    st = OuterState(_params(), OuterConfig())
    with pytest.raises(ValueError, match="unknown module"):
        st.load_state_dict({"nope/anchor/0": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        st.load_state_dict({"embed/anchor/0": torch.zeros(2), "layers.0/anchor/0": torch.zeros(4, 4),
                            "layers.0/anchor/1": torch.zeros(4)})
    with pytest.raises(ValueError, match="lacks anchor"):
        st.load_state_dict({"embed/anchor/0": torch.zeros(5, 3)})


def test_adam_by_name() -> None:
    p = torch.zeros(3)
    st = OuterState({"m": [p]}, OuterConfig(optimizer="Adam", lr=0.1))
    assert isinstance(st.optimizers["m"], torch.optim.Adam)
    st.step("m", [torch.tensor([1.0, -1.0, 0.0])])
    torch.testing.assert_close(st.anchors["m"][0], torch.tensor([-0.1, 0.1, 0.0]))


def test_validate() -> None:
    with pytest.raises(ValueError, match="outer.optimizer"):
        OuterConfig(optimizer="Nope").validate()
    with pytest.raises(ValueError, match="outer.lr"):
        OuterConfig(lr=0.0).validate()
    with pytest.raises(ValueError, match="outer.nesterov"):
        OuterConfig(momentum=0.0).validate()
    with pytest.raises(ValueError, match="outer.kwargs"):
        OuterConfig(kwargs={"bogus": 1}).validate()
    OuterConfig(optimizer="Adam").validate()  # momentum/nesterov not passed to Adam


def test_lr1_uniform_outer_step_is_parameter_averaging() -> None:
    """DESIGN §4: outer SGD(lr=1, momentum=0) with uniform weights == plain parameter averaging."""
    anchor_params = _params(seed=3)
    init = {n: [t.clone() for t in ts] for n, ts in anchor_params.items()}
    st = OuterState(anchor_params, OuterConfig(lr=1.0, momentum=0.0, nesterov=False))
    g = torch.Generator().manual_seed(4)
    workers = [{n: [t + 0.3 * torch.randn(t.shape, generator=g) for t in ts] for n, ts in init.items()}
               for _ in range(3)]
    pcfg = RuleConfig(name="edit_norm", clip=False, edit_norm=EditNormConfig(weighting="uniform", anomaly=False))
    agg = FixedSet(pcfg.edit_norm, 3)
    for name in st.module_names:
        deltas = [[a - p for a, p in zip(st.anchors[name], w[name])] for w in workers]
        norms = torch.tensor([float(sum(d.double().pow(2).sum() for d in ds).sqrt()) for ds in deltas])
        dec = agg.decide(name, norms)
        delta, coef = merge(deltas, dec.weights, pcfg.clip_phi)
        assert coef == 1.0
        st.step(name, delta)
        st.reset(name)
        for i, a in enumerate(st.anchors[name]):
            avg = sum(w[name][i] for w in workers) / 3
            torch.testing.assert_close(a, avg, rtol=0, atol=1e-6)
            torch.testing.assert_close(anchor_params[name][i], avg, rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_cuda_pinned_matches_resident() -> None:
    def build(offload: bool) -> tuple[OuterState, dict]:
        params = {n: [t.cuda() for t in ts] for n, ts in _params().items()}
        return OuterState(params, OuterConfig(offload=offload)), params

    a, pa = build(False)
    b, pb = build(True)
    assert b.anchors["embed"][0].device.type == "cpu" and b.anchors["embed"][0].is_pinned()
    for _ in range(2):
        for name in a.module_names:
            d = [torch.ones_like(t) * 0.1 for t in pa[name]]
            a.step(name, d)
            a.reset(name)
            b.prefetch(name)
            assert b.anchors[name][0].is_cuda
            b.step(name, d)
            b.reset(name)
            b.release(name)
    assert b.optimizers["embed"].state[b.anchors["embed"][0]]["momentum_buffer"].is_pinned()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(pa["layers.0"], pb["layers.0"]))
