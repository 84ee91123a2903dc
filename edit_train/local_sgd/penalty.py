"""EDiT's anomaly-aware penalty (§4 steps 2–4), pure tensor math: the per-cluster EWMA norm test with its
regime rescale and re-admission, softmax(−norm) weights, clipping. Used by the `edit_norm` rule
(`rules.py`) and by the norm test of the `verified` rule (`verified.py`); exact math in docs/sync_math.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from edit_train.local_sgd.penalty_stats import EWMAStats, t_quantile

__all__ = ["NormTestConfig", "EWMAStats", "per_step", "interval_norm", "t_quantile", "clip_factor", "weighted", "flag",
           "check_fields"]


PREFIX = "algo.rule"  # where the rules' configs live in the Hydra tree (for error messages)


def check_fields(ok: bool, where: str, what: str) -> None:
    """One line naming the offending field (`ValueError`)."""
    if not ok:
        raise ValueError(f"{PREFIX}.{where} {what}")


@dataclass
class NormTestConfig:
    """EDiT's norm test, shared by the rules that run it (`edit_norm`, `verified`)."""

    anomaly: bool = True  # False: nothing is ever flagged by this test
    ewma_alpha: float = 0.02
    warmup_syncs: int = 10
    z_threshold: float = 3.0  # nominal one-sided z; the test uses the matching Student-t predictive bound
    sigma_floor: float = 0.05  # σ used in z is at least sigma_floor·|μ|
    # the k-th consecutive flag of a cluster is accepted as its new level (0 = never); 16: a 12-sync fault window
    # stays flagged, a lasting shift is re-learned within 25
    readmit_after: int = 16
    regime_change: bool = True  # a shift shared by most clusters rescales everyone's statistics instead

    def validate(self, rule: str) -> None:
        """Raise `ValueError` naming the offending field under `algo.rule.<rule>`."""
        check_fields(0.0 < self.ewma_alpha < 1.0, f"{rule}.ewma_alpha", f"must be in (0, 1), got {self.ewma_alpha}")
        check_fields(self.warmup_syncs >= 0, f"{rule}.warmup_syncs", f"must be >= 0, got {self.warmup_syncs}")
        check_fields(self.z_threshold > 0 and math.isfinite(self.z_threshold), f"{rule}.z_threshold",
                     f"must be > 0, got {self.z_threshold}")
        check_fields(0.0 <= self.sigma_floor < 1.0, f"{rule}.sigma_floor", f"must be in [0, 1), got {self.sigma_floor}")
        check_fields(self.readmit_after >= 0, f"{rule}.readmit_after",
                     f"must be >= 0 (0 = never re-admit), got {self.readmit_after}")


def per_step(norms: Tensor, steps: Tensor | Sequence[float] | None) -> Tensor:
    """``G/s`` (float64): the norm per local step (``s`` clamped to >= 1; ``steps=None`` → ``G``)."""
    g = torch.as_tensor(norms, dtype=torch.float64).reshape(-1)
    if steps is None:
        return g
    s = torch.as_tensor(steps, dtype=torch.float64).reshape(g.shape)
    s = torch.where(torch.isfinite(s), s, torch.ones_like(s)).clamp_min(1.0)
    return g / s


def interval_norm(norms: Tensor, steps: Tensor | Sequence[float], reference: Tensor | None) -> Tensor:
    """The norm per local step that holds for an interval of any length (float64): ``G/s`` for ``s ≥ s₀`` and
    ``G/√(s·s₀)`` for a shorter interval, where ``s₀`` is the cluster's reference interval (its own running mean;
    ``reference`` ≤ 0, non-finite or None: ``s₀ = s``, i.e. ``G/s``). An honest ``G`` grows between ``√s``
    (noise-dominated) and ``s`` (drift-dominated), so neither a long nor a short interval raises the value above
    the cluster's level at ``s₀`` (docs/sync_math.md, "Intervals of any length")."""
    g = torch.as_tensor(norms, dtype=torch.float64).reshape(-1)
    s = torch.as_tensor(steps, dtype=torch.float64).reshape(g.shape)
    s = torch.where(torch.isfinite(s), s, torch.ones_like(s)).clamp_min(1.0)
    if reference is None:
        return g / s
    s0 = torch.as_tensor(reference, dtype=torch.float64).reshape(g.shape)
    s0 = torch.where(torch.isfinite(s0) & (s0 > 0), s0.clamp_min(1.0), s)
    return torch.where(s < s0, g / (s * s0).sqrt(), g / s)


def clip_factor(sqnorm: float, phi: float | None) -> float:
    """``min(1, φ/(‖Δ‖ + 1e-6))`` from the squared norm ``‖Δ‖²`` (1 when ``phi`` is None: no clipping). A
    non-finite norm gives 0 (drop the update)."""
    if phi is None:
        return 1.0
    sqnorm = float(sqnorm)
    if not math.isfinite(sqnorm):
        return 0.0
    return min(1.0, phi / (math.sqrt(max(sqnorm, 0.0)) + 1e-6))


def weighted(tensors: Sequence[Tensor], weight: float) -> list[Tensor]:
    """``w·Δ`` in fp32 (or wider); weight 0 gives exact zeros even if Δ is NaN/inf (never ``NaN·0``)."""
    out = []
    for t in tensors:
        t = t.to(torch.promote_types(t.dtype, torch.float32))
        out.append(torch.zeros_like(t) if weight == 0.0 else t * weight)
    return out


def flag(st: EWMAStats, x: Tensor, cfg: NormTestConfig, floor_abs: float = 0.0,
         regime: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The anomaly test of values ``x`` (larger = worse) against per-cluster statistics ``st``: (anomalous —
    non-finite included —, z, threshold, re-admitted). Applies the regime rescale (for ratio-scaled values,
    `regime`) and tracks streaks; the caller folds the accepted values in (``st.update``). σ is at least
    ``sigma_floor·|μ|`` and ``floor_abs``."""
    finite = torch.isfinite(x)
    anomalous = ~finite
    readmit = torch.zeros_like(finite)
    floor = cfg.sigma_floor
    z = torch.where(st.count == 0, torch.where(finite, 0.0, x), st.zscore(x, floor, floor_abs))
    thr = torch.full_like(x, math.inf)
    if cfg.anomaly:
        # At least 2 accepted values are needed for a meaningful σ, whatever warmup_syncs says.
        warm = st.count >= max(cfg.warmup_syncs, 2)
        thr = torch.where(warm, st.threshold(cfg.z_threshold), thr)
        if regime and cfg.regime_change and _regime(st, x, z, thr, warm, finite):
            z = torch.where(st.count == 0, torch.where(finite, 0.0, x), st.zscore(x, floor, floor_abs))
            warm = st.count >= max(cfg.warmup_syncs, 2)
            thr = torch.where(warm, st.threshold(cfg.z_threshold), torch.full_like(x, math.inf))
        flagged = warm & finite & (z > thr)
        if cfg.readmit_after > 0:
            st.track_streak(x, flagged)
            readmit = st.streak >= cfg.readmit_after
            if bool(readmit.any()):
                st.rebase(readmit)  # the streak (this value included) becomes the new level
            flagged = flagged & ~readmit
        anomalous = anomalous | flagged
    return anomalous, z, thr, readmit


def _regime(st: EWMAStats, x: Tensor, z: Tensor, thr: Tensor, warm: Tensor, finite: Tensor) -> bool:
    """A shift shared by a strict majority of the warm clusters is a regime change, not an anomaly:
    rescale every cluster's statistics by the shared factor ``c`` (the lower median of ``x/μ`` for a
    rise, the upper median for a drop), so only clusters that moved differently stay flagged.
    If ``c`` is 0 or infinite (e.g. a history of exact zeros), the statistics restart. True if so."""
    n_warm = int(warm.sum())
    if n_warm < 2:
        return False
    live = warm & finite
    up, down = int((live & (z > thr)).sum()), int((live & (z < -thr)).sum())
    if 2 * up <= n_warm and 2 * down <= n_warm:
        return False
    xs, mus = x[live], st.mu[live]
    q = torch.where(mus > 0, xs / torch.where(mus > 0, mus, torch.ones_like(mus)),
                    torch.where(xs > 0, math.inf, 1.0))
    q, _ = torch.sort(q)
    c = float(q[(q.numel() - 1) // 2]) if 2 * up > n_warm else float(q[q.numel() // 2])
    if math.isfinite(c) and c > 0:
        st.rescale(c)
    else:
        st.reset()
    return True
