"""Per-layer execution options applied to a built model from outside: precision policy, activation
checkpointing and ``torch.compile``. The model file stays free of them (torchtitan's ``parallelize`` shape).

Nothing here renames a module or a parameter: checkpointing and compilation replace the *instance*
``forward`` of a decoder layer (or of its MoE block), so state-dict keys, FSDP units and the local-SGD
sync hooks (forward pre-hooks on the layer, which run in ``__call__`` before ``forward``) are untouched —
a sync is never re-run by a recompute.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

CHECKPOINT_MODES = ("none", "full", "moe")


@dataclass(frozen=True)
class PrecisionPolicy:
    """How ``train.precision`` is realised on this rank.

    * ``fsdp_param_dtype``: FSDP2 ``MixedPrecisionPolicy(param_dtype=…, reduce_dtype=fp32)`` — bf16 on CUDA
      for a sharded group. The sharded parameters FSDP keeps (what AdamW, the anchor, the outer momentum and
      the pseudo-gradients see) stay fp32; only the gathered compute copies are bf16.
    * ``autocast_dtype``: ``torch.autocast`` around forward — bf16 for unsharded groups and on CPU.
    """

    precision: str
    fsdp_param_dtype: torch.dtype | None = None
    autocast_dtype: torch.dtype | None = None

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def optimizer_step(self, device_type: str) -> contextlib.AbstractContextManager:
        """Around all the micro-batches of one optimizer step (forward and backward): the bf16 working copies
        of the weights are made once per optimizer step, not once per micro-batch. Autocast caches its casts
        of the weights until its outermost region ends — this region, held open across the micro-batches —
        and the expert weights, which the MoE block casts itself, use ``model.experts.working_copies``. The
        copies are the same casts of the same fp32 weights, so the numerics are those of per-micro-batch
        casts (tests/train/test_working_copies.py). Backward runs inside it with autocast off (`backward`)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        from edit_train.model.experts import working_copies

        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device_type, dtype=self.autocast_dtype))
        stack.enter_context(working_copies())
        return stack

    def backward(self, device_type: str) -> contextlib.AbstractContextManager:
        """Backward inside `optimizer_step`: autocast off (as outside any region), its cache kept."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, enabled=False)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fsdp_param_dtype or self.autocast_dtype or torch.float32


def precision_policy(precision: str, device: torch.device, sharded: bool) -> PrecisionPolicy:
    """``fp32``: nothing. ``bf16``: FSDP2 mixed precision on a sharded CUDA group, autocast otherwise."""
    if precision == "fp32":
        return PrecisionPolicy(precision)
    if precision != "bf16":
        raise ValueError(f"train.precision: must be fp32 or bf16, got {precision!r}")
    if device.type == "cuda" and sharded:
        return PrecisionPolicy(precision, fsdp_param_dtype=torch.bfloat16)
    return PrecisionPolicy(precision, autocast_dtype=torch.bfloat16)


def _checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` recomputed in backward (non-reentrant; the RNG state is replayed, so routing noise matches). The
    routed-token tally is taken in `CausalLM.forward`, outside: the recompute does not count again."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)  # eval: nothing to save, nothing to recompute
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return run


def _set_forward(module: nn.Module, fn: Callable[..., Any]) -> None:
    module.forward = fn  # type: ignore[method-assign]  # instance attribute: hooks and names are kept


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .layers: cannot apply per-layer options")
    return list(layers)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """``full``: each decoder layer's forward is recomputed in backward (only its input is kept).
    ``moe``: only the MoE blocks (router + experts + shared experts) are recomputed; attention keeps its
    activations. Returns the number of modules wrapped."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"train.activation_checkpointing: must be none, full or moe, got {mode!r}")
    if mode == "none":
        return 0
    from edit_train.model.moe import MoEBlock

    wrapped = 0
    for layer in decoder_layers(model):
        target = layer if mode == "full" else getattr(layer, "mlp", None)
        if mode == "moe" and not isinstance(target, MoEBlock):
            continue
        assert target is not None
        _set_forward(target, _checkpointed(type(target).forward.__get__(target)))
        wrapped += 1
    return wrapped


def apply_compile(model: nn.Module, **compile_kwargs: Any) -> int:
    """``torch.compile`` each decoder layer's forward (after checkpointing, so the recompute is compiled
    too) and, with ``model.loss_chunk > 0``, the per-chunk work of the fused head loss. The FSDP and sync
    hooks stay eager around them. Returns the number of layers compiled."""
    from edit_train.model.lm_loss import ChunkedCrossEntropy

    # The MoE block keeps its router losses and expert load on the module (side effects). Inside a checkpointed
    # region dynamo refuses them — the whole layer fell back to eager, silently — unless told that the recompute
    # need not replay them (it need not: the forward's values are the ones the loss and the logs read).
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    layers = decoder_layers(model)
    for layer in layers:
        fn = layer.forward  # the instance (checkpointed) forward if any, else the bound class forward
        _set_forward(layer, torch.compile(fn, **compile_kwargs))
    head_loss = getattr(getattr(model, "lm_head", None), "loss", None)
    if isinstance(head_loss, ChunkedCrossEntropy) and head_loss.chunk > 0:
        head_loss.compile(**compile_kwargs)
    return len(layers)


def check_expert_impl(model: nn.Module, device: torch.device, compute_dtype: torch.dtype, compile: bool) -> None:
    """Fail before training (ValueError naming ``model.expert_impl``) if ``grouped`` was asked for where it
    cannot run; ``auto`` is resolved per forward and never fails."""
    from edit_train.model.experts import resolve_impl
    from edit_train.model.moe import RoutedExperts

    for module in model.modules():
        if isinstance(module, RoutedExperts):
            resolve_impl(module.impl, device, compute_dtype, tuple(module.gate_proj.shape[1:]), compiling=compile)


def apply_layer_options(model: nn.Module, activation_checkpointing: str = "none", compile: bool = False,
                        device: torch.device | None = None, compute_dtype: torch.dtype = torch.float32
                        ) -> dict[str, int]:
    """What the trainer calls after building the model and before FSDP wrapping (``device``: also check
    that the requested expert implementation can run there in ``compute_dtype``)."""
    if device is not None:
        check_expert_impl(model, device, compute_dtype, compile)
    counts = {"checkpointed": apply_activation_checkpointing(model, activation_checkpointing),
              "compiled": apply_compile(model) if compile else 0}
    if counts["checkpointed"] or counts["compiled"]:
        log.info("activation checkpointing=%s on %d modules, torch.compile on %d layers",
                 activation_checkpointing, counts["checkpointed"], counts["compiled"])
    return counts
