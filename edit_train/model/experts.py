"""Routed-expert computation through grouped matmuls (``torch._grouped_mm``) and the choice of implementation.

``model.expert_impl`` selects how ``RoutedExperts`` runs its SwiGLU experts:

* ``sorted``  — the reference path in ``moe.py``: tokens sorted by expert, one matmul per non-empty expert.
  It reads the per-expert counts on the host (one sync per MoE layer) to slice the sorted tokens.
* ``grouped`` — this module: the same sort, then three ``torch._grouped_mm`` calls over all experts at once,
  delimited by on-device int32 offsets. Counts never leave the device (no ``.tolist()`` / ``.item()`` /
  ``bincount``, whose CUDA kernel reads the max on the host), so the layer issues no host sync.
* ``auto``    — ``grouped`` where the device's grouped GEMM applies, else ``sorted``.

What torch 2.13 requires of ``torch._grouped_mm`` (read from its meta registration and docs):

* CUDA: bf16 operands only (fp32 is rejected), compute capability >= 8.0 (a CUTLASS kernel on sm90/sm100,
  a slower loop elsewhere); the CPU build also implements it (any float dtype, differentiable), which is
  what lets the CPU tests check this path against the reference. Under ``torch.compile`` the meta kernel
  accepts bf16 only, on any device.
* Every operand's leading stride must be a multiple of 16 bytes: ``hidden_size`` and
  ``moe_intermediate_size`` multiples of 8 for bf16 (4 for fp32). Offsets need no alignment; they are the
  int32 cumulative ends of the groups, and rows past ``offs[-1]`` are not written.
* 2-D x 3-D layout: ``out[offs[e-1]:offs[e]] = a[offs[e-1]:offs[e]] @ b[e]`` with ``b`` of shape
  ``[E, K, N]`` — our ``[E, out, in]`` weights are passed transposed (a view, no copy).

The token permutation around the GEMMs moves data by gathers only, forward and backward (``_Dispatch``,
``_Unsort``): autograd's backward of ``index_select`` is ``index_add_``, a scatter with atomics — slow and
non-deterministic on CUDA in bf16 — where the inverse permutation turns it into a gather.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

EXPERT_IMPLS = ("auto", "grouped", "sorted")
# One optimizer step's working copies of the expert weights (`working_copies`): id -> (weight, version, copy)
_working: dict[int, tuple[torch.Tensor, int, torch.Tensor]] | None = None
_warned: set[str] = set()
_capability: dict[int | None, tuple[int, int]] = {}  # CUDA device index -> compute capability


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability, cached: under ``torch.compile`` the lookup is a dict read (a guarded
    constant), not a CUDA call. ``train/parallel.py`` fills the cache before compiling."""
    if device.index not in _capability:
        index = device.index if device.index is not None else torch.cuda.current_device()
        _capability[device.index] = _capability[index] = torch.cuda.get_device_capability(index)
    return _capability[device.index]


def grouped_mm_available() -> bool:
    """Whether this torch build exposes ``torch._grouped_mm``."""
    return hasattr(torch, "_grouped_mm")


def grouped_supported(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...],
                      compiling: bool | None = None) -> tuple[bool, str]:
    """``(ok, reason)``: can ``torch._grouped_mm`` run experts of these dims in ``dtype`` on ``device``
    (under ``torch.compile`` if ``compiling``; default: whether this call is being traced)?"""
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    if not grouped_mm_available():
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    align = max(16 // dtype.itemsize, 1)
    bad = [d for d in dims if d % align]
    if bad:
        return False, f"dims {bad} are not multiples of {align} ({dtype} needs 16-byte strides)"
    if dtype != torch.bfloat16 and compiling:
        return False, f"torch.compile traces torch._grouped_mm in bf16 only, compute dtype is {dtype}"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return False, f"CUDA grouped GEMM takes bf16 only, compute dtype is {dtype}"
        major, _ = cuda_capability(device)
        if major < 8:
            return False, f"compute capability {major}.x < 8.0"
        return True, "cuda"
    if device.type == "cpu":
        return True, "cpu"
    return False, f"no grouped GEMM on {device.type}"


def resolve_impl(requested: str, device: torch.device, dtype: torch.dtype, dims: tuple[int, ...],
                 compiling: bool | None = None) -> str:
    """The implementation to run: ``grouped`` or ``sorted``.

    ``auto`` picks ``grouped`` only on CUDA (on CPU the per-expert loop of the sorted path is faster and
    its host sync costs nothing). ``grouped`` where the device cannot run it raises a one-line error.
    """
    if requested == "sorted":
        return "sorted"
    ok, why = grouped_supported(device, dtype, dims, compiling)
    if requested == "grouped":
        if not ok:
            raise ValueError(f"model.expert_impl=grouped: {why}; use model.expert_impl=auto or sorted")
        return "grouped"
    if ok and device.type == "cuda":
        return "grouped"
    key = f"{device.type}:{dtype}:{why}"
    if device.type == "cuda" and key not in _warned:
        _warned.add(key)
        log.warning("model.expert_impl=auto: sorted experts on %s (%s)", device, why)
    return "sorted"


@contextlib.contextmanager
def working_copies() -> Iterator[None]:
    """Within it (the trainer: one optimizer step, all its micro-batches) an expert weight is cast to the compute
    dtype once, at its first use, and that copy is used again by the later micro-batches (`working_copy`). Its
    end drops the copies; the optimizer then changes the weights."""
    global _working
    outer = _working is None
    if outer:
        _working = {}
    try:
        yield
    finally:
        if outer:
            _working = None


def working_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype``: the step's copy inside `working_copies` while the weight is unchanged (same
    tensor, same in-place version: a sync that re-bases the weight before this forward makes a new copy),
    else a fresh cast. The copy is differentiable: its gradient reaches the fp32 weight through the cast.
    Under ``torch.compile`` or without autograd the cast is the traced/plain one."""
    if weight.dtype == dtype:
        return weight
    cache = _working
    if cache is None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return weight.to(dtype)
    hit = cache.get(id(weight))
    if hit is not None and hit[0] is weight and hit[1] == weight._version and hit[2].dtype == dtype:
        return hit[2]
    copy = weight.to(dtype)
    cache[id(weight)] = (weight, weight._version, copy)
    return copy


def grouped_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                    gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropless experts through grouped matmuls; same contract as ``RoutedExperts.forward``.

    Args:
        x: ``[N, H]`` tokens (the compute dtype; the weights already cast to it).
        topk_idx / topk_weight: ``[N, k]`` expert and weight of every routing slot.
        gate_proj / up_proj: ``[E, I, H]``; down_proj: ``[E, H, I]``.

    Returns:
        ``(y [N, H], counts [E] int64)`` — all on the device, no host sync.
    """
    n, k = topk_idx.shape
    num_experts = gate_proj.shape[0]
    flat_idx = topk_idx.reshape(-1)
    order = torch.argsort(flat_idx, stable=True)  # slots grouped by expert, token order kept inside a group
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat_idx, torch.ones_like(flat_idx))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    inv_order = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    xs = _Dispatch.apply(x, order // k, inv_order)  # [N*k, H], expert-sorted
    g = torch._grouped_mm(xs, gate_proj.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(xs, up_proj.transpose(-2, -1), offs=offs)
    out = torch._grouped_mm(F.silu(g) * u, down_proj.transpose(-2, -1), offs=offs)  # [N*k, H]
    slots = _Unsort.apply(out, inv_order, order).view(n, k, -1)  # back to (token, slot) order
    y = torch.einsum("nkh,nk->nh", slots, topk_weight.to(slots.dtype))
    return y, counts


class _Dispatch(torch.autograd.Function):
    """``xs = x[token_idx]`` (each token once per routing slot, expert-sorted); backward by gathers:
    ``dx[n] = sum_j dxs[inv_order[n k + j]]`` (the k sorted positions of token n)."""

    @staticmethod
    def forward(ctx, x, token_idx, inv_order):  # type: ignore[override]
        ctx.save_for_backward(inv_order)
        ctx.n = x.shape[0]
        return x.index_select(0, token_idx)

    @staticmethod
    def backward(ctx, dxs):  # type: ignore[override]
        (inv_order,) = ctx.saved_tensors
        return dxs.index_select(0, inv_order).view(ctx.n, -1, dxs.shape[-1]).sum(1), None, None


class _Unsort(torch.autograd.Function):
    """``slots = out[inv_order]``, a permutation: its backward is the gather by the inverse, ``order``."""

    @staticmethod
    def forward(ctx, out, inv_order, order):  # type: ignore[override]
        ctx.save_for_backward(order)
        return out.index_select(0, inv_order)

    @staticmethod
    def backward(ctx, dslots):  # type: ignore[override]
        (order,) = ctx.saved_tensors
        return dslots.index_select(0, order), None, None
