"""The staleness correction (`algo.outer.staleness_correction`, after HeLoCo, arXiv 2606.00271): the merged Δ of a
unit, tensor by tensor, against the outer momentum m — a block pointing against the trajectory loses part of its
component along m before the outer step.

For each parameter tensor b of the unit (its whole tensor: the three sums below are taken over the cluster's ranks):

    c = ⟨Δ, m⟩ / (‖Δ‖·‖m‖)                           cosine to the outer momentum
    c ≥ 0:  Δ̂ = Δ                                   aligned: untouched
    c < 0:  conf = ‖Δ‖ / (‖Δ‖ + κ·‖m‖)               how much the block has to say against the momentum
            β = min(k·(−c)·conf, β_max)
            Δ̂ = Δ − β·c·‖Δ‖·m/‖m‖                    β of its component along m removed

so ⟨Δ̂, m̂⟩ = (1 − β)·c·‖Δ‖ and ‖Δ̂‖ ≤ ‖Δ‖ (the clip bound still holds). No momentum yet (the first outer step),
‖Δ‖ = 0 or ‖m‖ = 0: untouched. Why it sits on the merged Δ and not on each cluster's (docs/sync_math.md, "The
staleness correction"): in a sync every cluster's Δ starts from the same anchor; what is stale is the merged Δ
that `sync.mode=overlap` applies one interval late, and a cut-short A-EDiT interval's Δ is short, not old. The
correction needs no bytes, no gathered contributions and no state of its own: the outer momentum it reads is
in the outer state that checkpoints, rollbacks and heals already carry.

Imports nothing but torch (the algorithm core's rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["StalenessConfig", "correct", "MOMENTUM_KEYS"]

MOMENTUM_KEYS = ("momentum_buffer", "exp_avg")  # SGD's buffer, Adam's first moment: the outer momentum m
_EPS = 1e-12


@dataclass(frozen=True)
class StalenessConfig:
    """k (strength), β_max (cap) and κ of the module docstring's formula."""

    strength: float = 1.0
    cap: float = 1.0
    kappa: float = 1.0

    def factor(self, cos: float, norm: float, m_norm: float) -> float:
        """β for one block (0: untouched)."""
        if not (cos < 0.0 and norm > 0.0 and m_norm > 0.0) or not math.isfinite(cos):
            return 0.0
        conf = norm / (norm + self.kappa * m_norm + _EPS)
        return min(self.strength * -cos * conf, self.cap)


@torch.no_grad()
def correct(delta: Sequence[Tensor], momentum: Sequence[Tensor | None], cfg: StalenessConfig,
            reduce: Callable[[Tensor], Tensor] | None = None) -> tuple[list[Tensor], list[float]]:
    """(Δ̂ per tensor, the cosine per tensor — NaN where there is no momentum). `delta[i]` and `momentum[i]` are
    this rank's shards of tensor i; `reduce` sums a float64 vector over the cluster's ranks (None: one rank)."""
    stats = torch.zeros(len(delta), 3, dtype=torch.float64)
    have = [m is not None for m in momentum]
    for i, (d, m) in enumerate(zip(delta, momentum)):
        if m is None:
            continue
        d64, m64 = d.double(), m.double()
        stats[i, 0] = (d64 * m64).sum().cpu()
        stats[i, 1] = d64.pow(2).sum().cpu()
        stats[i, 2] = m64.pow(2).sum().cpu()
    if reduce is not None and any(have):
        stats = reduce(stats).cpu()
    out: list[Tensor] = []
    cosines: list[float] = []
    for i, (d, m) in enumerate(zip(delta, momentum)):
        dot, dd, mm = (float(x) for x in stats[i])
        norm, m_norm = math.sqrt(dd), math.sqrt(mm)
        cos = dot / (norm * m_norm) if have[i] and norm > 0.0 and m_norm > 0.0 else math.nan
        cosines.append(cos)
        beta = cfg.factor(cos, norm, m_norm)
        if beta == 0.0 or m is None:
            out.append(d)
            continue
        out.append(d - (beta * cos * norm / m_norm) * m.to(d.dtype))
    return out, cosines
