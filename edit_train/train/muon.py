"""`train.optimizer=muon`: Muon (torch.optim.Muon's update) on the decoder layers' matrices, AdamW on the rest.

Which parameter gets which optimizer (docs/algorithms.md, "Muon inner steps"):

* **Muon**: every 2-D weight inside a decoder layer (attention, dense MLP/shared experts, the router's
  ``mlp.gate`` matrix) and every 3-D expert stack ``(experts, a, b)``, orthogonalised **per expert matrix**
  (one Newton–Schulz iteration per expert: each expert is its own linear map, so its update is that map's
  orthogonalised momentum, exactly what Muon would do to the expert as a separate 2-D weight);
* **AdamW** (``train.lr``, betas, eps, weight decay as for ``train.optimizer=adamw``): the token embeddings, the
  LM head, the norms and biases — Muon's orthogonalisation is for hidden linear maps, not lookup tables or
  vectors (Jordan et al. 2024; MuLoCo, arXiv 2505.23725).

The Muon update is torch.optim.Muon's (momentum ``lerp``, Nesterov, its quintic Newton–Schulz coefficients)
with ``adjust_lr_fn="match_rms_adamw"`` (the update's RMS matches AdamW's, 0.2·√max(a, b)), so one ``train.lr``
and one schedule serve both halves; 2-D weights step bit-identically to ``torch.optim.Muon``
(tests/train/test_muon.py). One optimizer object holds both halves: one ``state`` (checkpoints and heals read it
per parameter, as for AdamW) and the param groups the trainer sets the lr on.

**Sharded clusters** (FSDP2 ``Shard(0)``, ``cluster.ranks`` > 1): Newton–Schulz needs each whole matrix, and a
rank holds a block of its rows. A 2-D matrix's update is gathered whole over the cluster's ranks
(``full_tensor``: one all-gather of the matrix per step), orthogonalised on every rank alike, and each rank keeps
its own rows (`local_sgd/evidence.shard_range`, FSDP2's chunk layout) — the same update as on one rank, for one
gather and a redundant Newton–Schulz per rank. A 3-D expert stack needs nothing: dim 0 is the experts, so a rank's
rows are whole expert matrices, orthogonalised where they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr, \
    _zeropower_via_newtonschulz

__all__ = ["MuonAdamW", "uses_muon", "orthogonalised", "sharded_orthogonalised"]

_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
ADJUST_LR = "match_rms_adamw"


def uses_muon(name: str, p: Tensor) -> bool:
    """A decoder layer's 2-D matrix or 3-D expert stack (everything else steps with AdamW)."""
    return p.ndim in (2, 3) and bool(_LAYER.search(name))


def _sharded(t: Tensor) -> bool:
    return hasattr(t, "placements") and any(not pl.is_replicate() for pl in t.placements)


def sharded_orthogonalised(update: Tensor, ns_steps: int = DEFAULT_NS_STEPS) -> Tensor:
    """`orthogonalised` of a parameter's update, as this rank's local tensor: a DTensor sharded by rows is
    gathered whole (2-D) or orthogonalised per local expert (3-D); anything else as it is."""
    if not _sharded(update):
        return orthogonalised(update.to_local() if hasattr(update, "to_local") else update, ns_steps)
    from edit_train.local_sgd.evidence import shard_range

    if update.ndim == 3:  # dim 0 is the experts: this rank's rows are whole expert matrices
        local = update.to_local()
        return orthogonalised(local, ns_steps) if local.numel() else local.clone()
    mesh = update.device_mesh
    whole = orthogonalised(update.full_tensor(), ns_steps)  # collective: every rank of the cluster, same order
    lo, hi = shard_range(update, mesh.get_local_rank(), mesh.size())
    return whole[lo:hi]


def orthogonalised(update: Tensor, ns_steps: int = DEFAULT_NS_STEPS) -> Tensor:
    """Muon's Newton–Schulz orthogonalisation of a 2-D matrix, or of each matrix of a 3-D ``(experts, a, b)``
    stack (bf16, as torch computes it)."""
    coeffs = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    if update.ndim == 2:
        return _zeropower_via_newtonschulz(update, coeffs, ns_steps, EPS)
    return torch.stack([_zeropower_via_newtonschulz(m, coeffs, ns_steps, EPS) for m in update.unbind(0)])


class MuonAdamW(torch.optim.Optimizer):
    """Muon on ``uses_muon`` parameters, the given AdamW on the others; ``state`` and ``param_groups`` are shared."""

    def __init__(self, named: Iterable[tuple[str, Tensor]], adamw: Callable[[list[Tensor]], torch.optim.Optimizer],
                 lr: float, weight_decay: float, momentum: float = 0.95, nesterov: bool = True) -> None:
        named = list(named)
        matrices = [p for n, p in named if uses_muon(n, p)]
        rest = [p for n, p in named if not uses_muon(n, p)]
        if not matrices:
            raise ValueError("train.optimizer=muon: the model has no decoder-layer matrices for Muon")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_steps": DEFAULT_NS_STEPS, "adjust_lr_fn": ADJUST_LR, "muon": True}
        super().__init__([{"params": matrices}], defaults)
        self.adamw = adamw(rest) if rest else None
        if self.adamw is not None:
            self.defaults["fused"] = self.adamw.defaults.get("fused")  # where AdamW's step counters live
            for g in self.adamw.param_groups:
                g["muon"] = False
        self._link()

    def _link(self) -> None:
        """One ``state`` and one list of param groups for both halves (also after ``load_state_dict``)."""
        muon = [g for g in self.param_groups if g.get("muon")]
        if self.adamw is not None:
            adam = [g for g in self.param_groups if not g.get("muon")] or self.adamw.param_groups
            self.adamw.param_groups = adam
            self.adamw.state = self.state
            self.param_groups = muon + adam

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group.get("muon"):
                continue
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = st["momentum_buffer"]
                buf.lerp_(grad, 1 - mom)
                update = grad.lerp(buf, mom) if group["nesterov"] else buf
                update = sharded_orthogonalised(update, group["ns_steps"])  # this rank's rows
                local = p.to_local() if hasattr(p, "to_local") else p
                local.mul_(1 - lr * wd)
                local.add_(update.to(local.dtype), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:]))
        if self.adamw is not None:
            self.adamw.step()
        return loss
