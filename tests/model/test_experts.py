"""Routed experts: the grouped-matmul path (``torch._grouped_mm``) against the sorted reference, the choice
of implementation (``model.expert_impl``), and the absence of host syncs on the grouped path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edit_train.model import CausalLM
from edit_train.model.config import ModelConfig
from edit_train.model.experts import grouped_supported, resolve_impl
from edit_train.model.moe import RoutedExperts

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_grouped = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")


def _run(impl: str, state: dict[str, torch.Tensor] | None, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
         dy: torch.Tensor, dims: tuple[int, int, int], device: str = "cpu", dtype: torch.dtype = torch.float32):
    num_experts, hidden, inter = dims
    torch.manual_seed(0)
    experts = RoutedExperts(num_experts, hidden, inter, impl=impl)
    experts.reset_parameters()
    if state is not None:
        experts.load_state_dict(state)
    experts.to(device=device, dtype=dtype)
    xx = x.to(device, dtype).requires_grad_()
    ww = w.to(device, dtype).requires_grad_()
    y, counts = experts(xx, idx.to(device), ww)
    y.backward(dy.to(device, dtype))
    grads = {"x": xx.grad, "w": ww.grad, **{n: p.grad for n, p in experts.named_parameters()}}
    return experts, y, counts, grads


def _inputs(n: int, k: int, dims: tuple[int, int, int], seed: int = 1):
    num_experts, hidden, _ = dims
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g)
    # experts 0..E-3 only: the last two are empty (their weight gradients must be exactly zero)
    idx = torch.stack([torch.randperm(num_experts - 2, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    dy = torch.randn(n, hidden, generator=g)
    return x, idx, w, dy


@needs_grouped
@pytest.mark.parametrize("k", [1, 2, 4])
def test_grouped_equals_sorted_on_cpu(k: int) -> None:
    dims = (8, 32, 48)
    x, idx, w, dy = _inputs(37, k, dims)
    ref, y_ref, c_ref, g_ref = _run("sorted", None, x, idx, w, dy, dims)
    grp, y, c, g = _run("grouped", ref.state_dict(), x, idx, w, dy, dims)
    assert ref.last_impl == "sorted" and grp.last_impl == "grouped"
    assert torch.equal(c, c_ref) and c.dtype == torch.int64 and int(c.sum()) == 37 * k
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-6, msg=name)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.count_nonzero(g[name][-2:]) == 0, f"{name}: empty experts got a gradient"


@needs_grouped
def test_grouped_model_matches_sorted_model() -> None:
    """The whole tiny model: loss and every parameter gradient agree between the two implementations."""
    results = {}
    for impl in ("sorted", "grouped"):
        cfg = dataclasses.replace(ModelConfig(), expert_impl=impl)
        torch.manual_seed(0)
        model = CausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
        out = model(ids, ids)
        out.loss.backward()
        results[impl] = (out.loss.detach(), {n: p.grad for n, p in model.named_parameters()})
        assert all(b.experts.last_impl == impl for b in model.moe_blocks())
    torch.testing.assert_close(results["grouped"][0], results["sorted"][0], rtol=1e-6, atol=1e-6)
    for name, grad in results["sorted"][1].items():
        torch.testing.assert_close(results["grouped"][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@needs_grouped
def test_grouped_path_reads_nothing_back_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """No `.tolist()` / `.item()` / `bincount` (whose CUDA kernel reads the max on the host) on the grouped
    path; the sorted path does read its counts (and so would fail here)."""

    def host_read(*_a, **_k):
        raise AssertionError("host read of a device tensor on the grouped path")

    dims = (8, 32, 48)
    x, idx, w, dy = _inputs(16, 2, dims)
    experts = RoutedExperts(*dims, impl="grouped")
    experts.reset_parameters()
    for name in ("tolist", "item", "__int__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    monkeypatch.setattr(torch, "bincount", host_read)
    y, counts = experts(x, idx, w)
    y.backward(dy)
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="host read"):
        monkeypatch.setattr(torch.Tensor, "tolist", host_read)
        RoutedExperts(*dims, impl="sorted")(x, idx, w)


def test_impl_selection() -> None:
    cpu = torch.device("cpu")
    assert resolve_impl("sorted", cpu, torch.float32, (64, 64)) == "sorted"
    assert resolve_impl("auto", cpu, torch.float32, (64, 64)) == "sorted"  # CPU: the per-expert loop is faster
    assert resolve_impl("auto", cpu, torch.bfloat16, (64, 64)) == "sorted"
    if hasattr(torch, "_grouped_mm"):
        assert resolve_impl("grouped", cpu, torch.float32, (64, 64)) == "grouped"
        ok, why = grouped_supported(cpu, torch.bfloat16, (64, 12))
        assert not ok and "12" in why  # bf16 needs multiples of 8 (16-byte strides)
        with pytest.raises(ValueError, match="model.expert_impl=grouped"):
            resolve_impl("grouped", cpu, torch.bfloat16, (64, 12))


def test_expert_impl_is_validated() -> None:
    with pytest.raises(ValueError, match="model.expert_impl"):
        ModelConfig(expert_impl="fast").validate()


@cuda
@pytest.mark.cuda
def test_grouped_bf16_on_cuda_equals_sorted_without_host_sync() -> None:
    dims = (16, 256, 128)  # multiples of 8: the bf16 grouped GEMM applies
    x, idx, w, dy = _inputs(512, 4, dims)
    dev = torch.device("cuda")
    assert resolve_impl("auto", dev, torch.bfloat16, dims[1:]) == "grouped"
    ref, y_ref, c_ref, g_ref = _run("sorted", None, x, idx, w, dy, dims, "cuda", torch.bfloat16)
    experts = RoutedExperts(*dims, impl="auto").to(dev)  # set-up copies from the host are outside the window
    experts.load_state_dict(ref.state_dict())
    experts.to(torch.bfloat16)
    xx = x.to(dev, torch.bfloat16).requires_grad_()
    ww = w.to(dev, torch.bfloat16).requires_grad_()
    ii = idx.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the forward raises
    try:
        y, counts = experts(xx, ii, ww)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert experts.last_impl == "grouped"
    y.backward(dy.to(dev, torch.bfloat16))
    assert torch.equal(counts, c_ref)
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    grads = {"x": xx.grad, "w": ww.grad, **{n: p.grad for n, p in experts.named_parameters()}}
    for name, ref_grad in g_ref.items():
        torch.testing.assert_close(grads[name].float(), ref_grad.float(), rtol=3e-2, atol=3e-2, msg=name)
