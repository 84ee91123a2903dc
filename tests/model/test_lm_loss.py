"""The fused, chunked LM-head loss (`model.loss_chunk`, edit_train/model/lm_loss.py): the same loss and gradients
as the plain `F.cross_entropy(F.linear(h, W).float())` (fp32, <= 1e-6), in the model too; its peak memory falls
with the chunk (CPU allocator, benchmarks/_memory.py); and what the defaults keep."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from edit_train.memplan import activation_bytes
from edit_train.model import CausalLM
from edit_train.model.config import ModelConfig
from edit_train.model.lm_loss import ce_chunk, ce_chunk_fusable, linear_cross_entropy
from edit_train.model.presets import load_preset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _memory import cpu_peak_bytes  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _inputs(n: int = 150, h: int = 24, v: int = 500, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) / h ** 0.5).requires_grad_()
    weight = (torch.randn(v, h, generator=g)).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100  # ignored rows: no loss, no gradient
    return hidden, weight, labels


def _plain(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=-100)


@pytest.mark.parametrize("chunk", [1, 32, 150, 1000])
@pytest.mark.parametrize("kernel", [ce_chunk, ce_chunk_fusable], ids=["eager", "fusable"])
def test_chunked_loss_equals_plain_fp32(chunk: int, kernel) -> None:
    hidden, weight, labels = _inputs()
    ref = _plain(hidden, weight, labels)
    ref_h, ref_w = torch.autograd.grad(0.5 * ref, (hidden, weight))
    out = linear_cross_entropy(hidden, weight, labels, chunk, kernel)
    got_h, got_w = torch.autograd.grad(0.5 * out, (hidden, weight))  # the incoming gradient is not 1
    assert out.dtype == torch.float32 and out.shape == ()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(got_h[::7]) == 0  # ignored rows


def test_chunked_loss_under_bf16_autocast_matches_plain() -> None:
    """Under autocast the matmuls run in bf16 (as F.linear does), the softmax in fp32."""
    hidden, weight, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _plain(hidden, weight, labels)
        out = linear_cross_entropy(hidden, weight, labels, 64)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)  # the same bf16 logits, the same fp32 loss
    for a, b in zip(torch.autograd.grad(out, (hidden, weight)), torch.autograd.grad(ref, (hidden, weight))):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)  # bf16 gradient products, summed differently


def test_no_grad_and_twice_backward() -> None:
    hidden, weight, labels = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, 32)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _plain(hidden, weight, labels).detach(), rtol=1e-6, atol=1e-6)
    out = linear_cross_entropy(hidden, weight, labels, 32)
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="model.loss_chunk"):
        out.backward()
    with pytest.raises(ValueError, match="model.loss_chunk"):
        linear_cross_entropy(hidden, weight, labels, 0)


@pytest.mark.parametrize("norm_head,tie", [(True, False), (False, False), (False, True)])
def test_model_with_loss_chunk_equals_plain_model(norm_head: bool, tie: bool) -> None:
    """The whole tiny model: loss and every parameter gradient, fused head loss vs full logits."""
    results = {}
    for chunk in (0, 13):
        cfg = dataclasses.replace(ModelConfig(), norm_head=norm_head, tie_word_embeddings=tie, loss_chunk=chunk)
        torch.manual_seed(0)
        model = CausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
        labels = ids.clone()
        labels[:, :3] = -100
        out = model(ids, labels)
        assert (out.logits is None) == (chunk > 0)
        out.loss.backward()
        results[chunk] = (out.ce_loss.detach(), {n: p.grad for n, p in model.named_parameters()})
        assert model(ids).logits.shape == (2, 24, cfg.vocab_size)  # without labels: the logits, as before
    torch.testing.assert_close(results[13][0], results[0][0], rtol=1e-6, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[13][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_peak_memory_falls_with_the_chunk() -> None:
    """Allocator bytes (not time): plain > fused(all tokens) > fused(1/4) > fused(1/16) for one fwd+bwd; the
    full sweep at Ling's vocabulary is results/lm_loss_memory.json (benchmarks/lm_loss_memory.py)."""
    n, v = 256, 4096
    hidden, weight, labels = _inputs(n, 32, v)

    def peak(chunk: int) -> int:
        def step() -> None:
            loss = _plain(hidden, weight, labels) if chunk == 0 else linear_cross_entropy(hidden, weight, labels,
                                                                                            chunk)
            loss.backward()
            hidden.grad = weight.grad = None

        return cpu_peak_bytes(step)

    peaks = [peak(c) for c in (0, n, n // 4, n // 16)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks
    logits = n * v * 4
    assert peaks[0] >= 3 * logits  # logits, log-softmax, gradient
    assert peaks[-1] < logits  # never the full logits


def test_defaults_keep_the_plain_loss_and_presets_chunk() -> None:
    """tiny/small keep the full-logits loss (bit-identical numerics); the 126k-vocabulary presets fuse it, and the
    memory plan counts one chunk instead of the logits."""
    assert ModelConfig().loss_chunk == 0
    assert load_preset("tiny").loss_chunk == 0 and load_preset("small").loss_chunk == 0
    for name in ("ling_1b", "ling_lite_slice", "ling_lite", "ling_plus"):
        assert load_preset(name).loss_chunk > 0, name
    cfg = load_preset("ling_1b")
    fused = activation_bytes(cfg, 8192, "none", 2, 4)
    plain = activation_bytes(dataclasses.replace(cfg, loss_chunk=0), 8192, "none", 2, 4)
    assert plain - fused > 8192 * cfg.vocab_size * 4  # more than the fp32 logits of the whole batch
    with pytest.raises(ValueError, match="model.loss_chunk"):
        ModelConfig(loss_chunk=-1).validate()
