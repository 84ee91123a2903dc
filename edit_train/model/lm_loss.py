"""Cross-entropy over the LM head without the ``[tokens, vocab]`` logits (``model.loss_chunk``).

The plain path (``loss_chunk=0``) materialises the head's logits ``[N, V]`` in the compute dtype, their fp32
copy, the log-softmax and its gradient: at Ling's 126,464-token vocabulary and 8,192 tokens that is ~16 GB,
more than the whole activation memory of a Ling-Lite decoder layer. Here the tokens go through the head
``chunk`` at a time. Each chunk's logits become its loss sum and — when a gradient is wanted — its logit
gradient ``(softmax - onehot) / n_valid``, which is at once contracted into ``dL/dh`` (this chunk's rows) and
accumulated into ``dL/dW`` (fp32): the gradients are computed inside the forward, as Liger-Kernel's fused
linear cross-entropy does, so the head's three matmuls run once each, as in the plain path. The backward only
scales the two saved gradients by the incoming one. Extra memory: one chunk's logits and their fp32 buffer
(``chunk x V x (2c + 4)`` bytes, c the compute dtype's), ``dL/dW`` (``4 V H``) and ``dL/dh`` (``N H``).

Numerics: in fp32 the loss and both gradients equal ``F.cross_entropy(F.linear(h, W), labels)`` up to the
order of summation (tests: <= 1e-6). Under autocast the matmuls run in the autocast dtype as ``F.linear`` does
and the softmax in fp32 as ``logits.float()`` does; ``dL/dW`` is summed over the chunks in fp32 (the plain
path's is one bf16 GEMM).

Two formulations of the per-chunk work: ``ce_chunk`` (eager: one fp32 buffer, updated in place) and
``ce_chunk_fusable`` (pure, no in-place ops: what ``torch.compile`` fuses into two kernels that read the
low-precision logits and write their gradient, ``train.compile=true``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

IGNORE_INDEX = -100
PROFILE_RANGE = "lm_head_loss"  # the profiler range around the fused loss (benchmarks/gpu_profile.py reads it)

Kernel = Callable[[Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor | None]]


def ce_chunk(logits: Tensor, labels: Tensor, scale: Tensor, grad: bool) -> tuple[Tensor, Tensor | None]:
    """``(loss_sum, dlogits)`` of one chunk: the fp32 sum of ``logsumexp(logits) - logits[label]`` over the rows
    whose label is not ``IGNORE_INDEX``, and (if ``grad``) ``scale * (softmax - onehot)`` on those rows (0 on the
    others) in the logits' dtype. ``logits`` is consumed (a temporary of the caller): in fp32 it is overwritten."""
    lf = logits.float()
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0)
    target = lf.gather(1, safe[:, None]).squeeze(1)
    m = lf.amax(dim=1, keepdim=True)
    lf.sub_(m).exp_()  # exp(x - max): the one fp32 buffer from here on
    s = lf.sum(dim=1, keepdim=True)
    lse = (m + s.log()).squeeze(1)
    loss_sum = torch.where(valid, lse - target, 0.0).sum()
    if not grad:
        return loss_sum, None
    w = (scale * valid)[:, None]
    lf.mul_(w / s)  # softmax * w
    lf.scatter_add_(1, safe[:, None], -w)  # - w at the label
    return loss_sum, lf.to(logits.dtype)


def ce_chunk_fusable(logits: Tensor, labels: Tensor, scale: Tensor, grad: bool) -> tuple[Tensor, Tensor | None]:
    """``ce_chunk`` without in-place ops or scatters (the one-hot is an iota compare), for ``torch.compile``."""
    lf = logits.float()
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0)
    lse = torch.logsumexp(lf, dim=1)
    target = lf.gather(1, safe[:, None]).squeeze(1)
    loss_sum = torch.where(valid, lse - target, 0.0).sum()
    if not grad:
        return loss_sum, None
    hit = torch.arange(lf.shape[1], device=lf.device)[None, :] == safe[:, None]
    g = (torch.exp(lf - lse[:, None]) - hit.to(lf.dtype)) * (scale * valid)[:, None]
    return loss_sum, g.to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ weight.T`` against ``labels``; gradients computed in the forward, per chunk."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk, dtype, kernel, grad_enabled):  # type: ignore[override]
        # needs_input_grad says what requires grad, even under no_grad (eval): the caller's grad mode decides too
        need_h, need_w = (grad_enabled and ctx.needs_input_grad[i] for i in (0, 1))
        n = h.shape[0]
        count = (labels != IGNORE_INDEX).sum()
        scale = 1.0 / count.to(torch.float32)  # no host sync; no valid label: nan, as F.cross_entropy gives
        hc, wc = h.to(dtype), weight.to(dtype)
        dh = torch.empty_like(h) if need_h else None
        dw: Tensor | None = None  # fp32, from the first chunk's product on
        total = torch.zeros((), dtype=torch.float64, device=h.device)  # the chunks' sums, order-stable
        for a in range(0, n, chunk):
            hb = hc[a:a + chunk]
            loss_sum, g = kernel(torch.mm(hb, wc.t()), labels[a:a + chunk], scale, need_h or need_w)
            total += loss_sum
            if dh is not None and g is not None:
                if dh.dtype == g.dtype:
                    torch.mm(g, wc, out=dh[a:a + chunk])
                else:
                    dh[a:a + chunk].copy_(torch.mm(g, wc))
            if need_w and g is not None:
                if dw is None:
                    dw = torch.mm(g.t(), hb).to(torch.float32)
                elif g.dtype == torch.float32:
                    dw.addmm_(g.t(), hb)
                else:
                    dw.add_(torch.mm(g.t(), hb))  # each chunk's product rounded once, summed in fp32
            del g  # one chunk's logits alive at a time: not this one while the next is computed
        ctx.grads = (dh, dw)
        return (total / count).to(torch.float32)

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError("model.loss_chunk: the fused LM-head loss was already backpropagated once; "
                               "backward through it twice (retain_graph) is not supported, use model.loss_chunk=0")
        dh, dw = ctx.grads
        ctx.grads = None  # scaled in place below, and freed as soon as autograd has taken them
        if dh is not None:
            dh.mul_(grad_loss.to(dh.dtype))
        if dw is not None:
            dw.mul_(grad_loss)
        return dh, dw, None, None, None, None, None


def linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, chunk: int,
                         kernel: Kernel = ce_chunk) -> Tensor:
    """``F.cross_entropy(F.linear(h, weight).float().flatten(0, -2), labels.flatten(), ignore_index=-100)``
    (fp32 scalar) without the logits: ``chunk`` tokens at a time (module docstring). ``h [..., H]``,
    ``weight [V, H]``, ``labels [...]``. Under autocast the matmuls run in the autocast dtype."""
    if chunk <= 0:
        raise ValueError(f"model.loss_chunk: the fused loss needs a positive chunk of tokens, got {chunk}")
    device_type = h.device.type
    dtype = torch.promote_types(h.dtype, weight.dtype)
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    grad_enabled = torch.is_grad_enabled()
    with torch.autocast(device_type, enabled=False), torch.profiler.record_function(PROFILE_RANGE):
        return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), chunk, dtype,
                                         kernel, grad_enabled)


class ChunkedCrossEntropy:
    """The loss an LM head computes when ``model.loss_chunk > 0``: its chunk and its per-chunk kernel (eager;
    ``compile()`` swaps in the compiled fusable one — ``train.compile``, from ``train/parallel.py``)."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.kernel: Kernel = ce_chunk

    def compile(self, **compile_kwargs) -> None:  # type: ignore[no-untyped-def]
        self.kernel = torch.compile(ce_chunk_fusable, **compile_kwargs)

    def __call__(self, h: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
        return linear_cross_entropy(h, weight, labels, self.chunk, self.kernel)
