"""Anomaly-aware pseudo-gradient aggregation (EDiT §4 steps 2–4), pure tensor math.

Every rank sees the same all-gathered vector of per-worker pseudo-gradient norms ``G`` for a module and
runs the same deterministic :meth:`PseudoGradAggregator.decide`, so all ranks agree on anomalies and
weights without further communication. No ``torch.distributed`` here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.penalty_stats import EWMAStats, t_quantile

__all__ = [
    "PenaltyConfig",
    "EWMAStats",
    "Decision",
    "PseudoGradAggregator",
    "anomaly_details",
    "per_step",
    "t_quantile",
    "weights",
    "clip_coef",
    "clip_coef_from_sqnorm",
    "clip_factor",
    "weighted",
    "aggregate",
    "decide_with",
    "flag",
]

_WEIGHTINGS = ("softmax", "uniform")
LEFT_OUT = ("zero", "others")  # `left_out`: see PenaltyConfig
_PREFIX = "algo.penalty"  # where the config lives in the Hydra tree (for error messages)


@dataclass
class PenaltyConfig:
    """Anomaly elimination, weighting and clipping of pseudo-gradients (exact math: docs/sync_math.md).

    ``rule`` names the aggregation rule (`local_sgd/rules.py`): a registered name or ``"module:attr"`` of a
    rule class defined outside the package; the other fields are the parameters of the built-in rules."""

    rule: str = "verified"
    anomaly: bool = True
    weighting: str = "softmax"
    clip: bool = True
    ewma_alpha: float = 0.02
    warmup_syncs: int = 10
    z_threshold: float = 3.0  # nominal one-sided z; the test uses the matching Student-t predictive bound
    temperature: float = 1.0  # relative to the median accepted per-step norm (scale-free)
    clip_threshold: float = 10.0
    step_weight_ratio: float = 0.0
    sigma_floor: float = 0.05  # σ used in z is at least sigma_floor·|μ|
    # the k-th consecutive flag of a worker is accepted as its new level (0 = never); 16: a 12-sync fault window
    # stays flagged (issue 20: at 12 its last sync was re-admitted), a lasting shift is re-learned within 25 (issue 10)
    readmit_after: int = 16
    regime_change: bool = True  # a shift shared by most workers rescales everyone's statistics instead
    # the `verified` rule (docs/sync_math.md): direction and usefulness evidence, weights by tokens
    sketch_dim: int = 1024  # count-sketch buckets per module for the direction test (a power of two; 0 = off)
    direction_rate: float = 0.3  # EWMA rate of the reference direction (accepted aggregates)
    direction_alpha: float = 0.05  # EWMA rate per accepted value of a module's pooled direction statistics
    direction_z: float = 4.0  # the direction test's nominal z (agreements have heavier tails than norms)
    probe_tokens: int = 0  # tokens of validation data each cluster scores every update on (0 = no probe)
    probe_tolerance: float = 0.1  # flag an update that raised the others' probe loss by more than this fraction
    retract: bool = True  # take back, one sync late, an admitted update the probe then shows harmful (retract.py)
    report_tolerance: float = 1e-3  # relative gap between a reported and a measured norm that flags a liar
    max_token_ratio: float = 8.0  # a cluster's claimed tokens count up to this many times the median claim
    # what a left-out cluster's token share of a module's step becomes: "zero" (the step is backed by the
    # accepted tokens only and shrinks with them) or "others" (shared among the accepted, as EDiT renormalises)
    left_out: str = "zero"

    @property
    def clip_phi(self) -> float | None:
        """The clip threshold φ, or None when clipping is off."""
        return self.clip_threshold if self.clip else None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field."""
        if self.weighting not in _WEIGHTINGS:
            raise ValueError(f"{_PREFIX}.weighting must be one of {_WEIGHTINGS}, got {self.weighting!r}")
        if not 0.0 < self.ewma_alpha < 1.0:
            raise ValueError(f"{_PREFIX}.ewma_alpha must be in (0, 1), got {self.ewma_alpha}")
        if self.warmup_syncs < 0:
            raise ValueError(f"{_PREFIX}.warmup_syncs must be >= 0, got {self.warmup_syncs}")
        if not (self.z_threshold > 0 and math.isfinite(self.z_threshold)):
            raise ValueError(f"{_PREFIX}.z_threshold must be > 0, got {self.z_threshold}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"{_PREFIX}.temperature must be > 0, got {self.temperature}")
        if not self.clip_threshold > 0:
            raise ValueError(f"{_PREFIX}.clip_threshold must be > 0, got {self.clip_threshold}")
        if not 0.0 <= self.step_weight_ratio <= 1.0:
            raise ValueError(f"{_PREFIX}.step_weight_ratio must be in [0, 1], got {self.step_weight_ratio}")
        if not (0.0 <= self.sigma_floor < 1.0):
            raise ValueError(f"{_PREFIX}.sigma_floor must be in [0, 1), got {self.sigma_floor}")
        if self.readmit_after < 0:
            raise ValueError(f"{_PREFIX}.readmit_after must be >= 0 (0 = never re-admit), got {self.readmit_after}")
        if self.sketch_dim < 0 or self.sketch_dim & (self.sketch_dim - 1):
            raise ValueError(f"{_PREFIX}.sketch_dim must be 0 or a power of two, got {self.sketch_dim}")
        if not (self.direction_z > 0 and math.isfinite(self.direction_z)):
            raise ValueError(f"{_PREFIX}.direction_z must be > 0, got {self.direction_z}")
        if not 0.0 < self.direction_alpha < 1.0:
            raise ValueError(f"{_PREFIX}.direction_alpha must be in (0, 1), got {self.direction_alpha}")
        if not 0.0 < self.direction_rate <= 1.0:
            raise ValueError(f"{_PREFIX}.direction_rate must be in (0, 1], got {self.direction_rate}")
        if self.left_out not in LEFT_OUT:
            raise ValueError(f"{_PREFIX}.left_out must be one of {LEFT_OUT}, got {self.left_out!r}")
        if self.probe_tokens < 0 or not self.max_token_ratio >= 1.0 or not self.report_tolerance > 0:
            raise ValueError(f"{_PREFIX}: probe_tokens must be >= 0, max_token_ratio >= 1, report_tolerance > 0")


_FIELDS = ("mu", "m2", "count", "streak", "streak_mu", "streak_m2")
_REQUIRED = ("mu", "m2", "count")  # checkpoints written before the streak fields existed lack the rest


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


@dataclass
class Decision:
    """Outcome of one module's sync decision (identical on every rank).

    ``z`` is the score the test used (per local step, after a regime rescale) and ``threshold`` the bound
    it was compared with (inf while a worker is in warm-up or detection is off)."""

    module: str
    norms: list[float]
    weights: list[float]
    anomalous: list[bool]
    z: list[float]
    all_anomalous: bool
    threshold: list[float] = field(default_factory=list)
    evidence: list[dict[str, Any]] = field(default_factory=list)  # per worker: what the rule measured and why

    def as_dict(self) -> dict:
        """JSON-friendly dict; non-finite floats become ``None``."""
        d = asdict(self)
        for key in ("norms", "z", "weights", "threshold"):
            d[key] = [_finite_or_none(v) for v in d[key]]
        return d


def anomaly_details(decisions: Mapping[str, Decision], worker: int) -> dict[str, dict[str, Any]]:
    """``{module: {"z": z, "threshold": bound}}`` for every module where ``worker`` was anomalous (for the
    ``sync`` event: why a cluster was left out). Non-finite values become ``None``."""
    out: dict[str, dict[str, Any]] = {}
    for name, d in decisions.items():
        if d.anomalous[worker]:
            thr = d.threshold[worker] if d.threshold else math.inf
            z = d.z[worker] if d.z else math.nan
            out[name] = {"z": _finite_or_none(float(z)), "threshold": _finite_or_none(float(thr))}
            if d.evidence:
                out[name].update({k: _finite_or_none(v) if isinstance(v, float) else v
                                  for k, v in d.evidence[worker].items()})
    return out


def per_step(norms: Tensor, steps: Tensor | Sequence[float] | None) -> Tensor:
    """``G/s`` (float64): the norm per local step (``s`` clamped to >= 1; ``steps=None`` → ``G``)."""
    g = torch.as_tensor(norms, dtype=torch.float64).reshape(-1)
    if steps is None:
        return g
    s = torch.as_tensor(steps, dtype=torch.float64).reshape(g.shape)
    s = torch.where(torch.isfinite(s), s, torch.ones_like(s)).clamp_min(1.0)
    return g / s


def weights(
    norms: Tensor, anomalous: Tensor, cfg: PenaltyConfig, steps: Tensor | Sequence[float] | None = None
) -> Tensor:
    """Per-worker weights (float64, sum 1 over accepted workers; all zeros if none accepted).

    softmax: ``softmax(−xᵢ/(T·m))`` over the accepted workers, ``xᵢ = Gᵢ/sᵢ`` the per-step norm and ``m``
    the (lower) median accepted ``x``: invariant to the scale of the norms, and exactly the old
    ``softmax(−G/T)`` when ``m = 1``. Then the optional blend with each worker's share of the steps."""
    g = torch.as_tensor(norms, dtype=torch.float64).reshape(-1)
    x = per_step(g, steps)
    ok = ~torch.as_tensor(anomalous, dtype=torch.bool).reshape(-1) & torch.isfinite(x)
    zeros = torch.zeros_like(g)
    n_ok = int(ok.sum())
    if n_ok == 0:
        return zeros
    uniform = torch.where(ok, torch.full_like(g, 1.0 / n_ok), zeros)
    w = uniform
    if cfg.weighting == "softmax":
        acc = x[ok]
        m = float(acc.median())
        if not m > 0:
            m = float(acc.max())
        if m > 0:
            logits = torch.where(ok, -x / (cfg.temperature * m), torch.full_like(g, -math.inf))
            logits = logits - logits.max()
            e = torch.where(ok, logits.exp(), zeros)
            w = e / e.sum()
    r = cfg.step_weight_ratio
    if r > 0 and steps is not None:
        s = torch.as_tensor(steps, dtype=torch.float64).reshape(g.shape)
        s = torch.where(ok & torch.isfinite(s), s.clamp_min(0.0), zeros)
        total = float(s.sum())
        if total > 0:  # no steps recorded → nothing to blend
            w = (1.0 - r) * w + r * (s / total)
    return w


def clip_factor(sqnorm: float, phi: float | None) -> float:
    """``min(1, φ/(‖Δ‖ + 1e-6))`` from the squared norm ``‖Δ‖²`` (1 when ``phi`` is None: no clipping). A
    non-finite norm gives 0 (drop the update)."""
    if phi is None:
        return 1.0
    sqnorm = float(sqnorm)
    if not math.isfinite(sqnorm):
        return 0.0
    return min(1.0, phi / (math.sqrt(max(sqnorm, 0.0)) + 1e-6))


def clip_coef(delta_norm: float, cfg: PenaltyConfig) -> float:
    """:func:`clip_factor` of a norm under ``cfg`` (``cfg.clip`` off: 1)."""
    delta_norm = float(delta_norm)
    return clip_factor(delta_norm * delta_norm if math.isfinite(delta_norm) else math.inf, cfg.clip_phi)


def clip_coef_from_sqnorm(sq: float, cfg: PenaltyConfig) -> float:
    """:func:`clip_coef` from a squared norm (e.g. summed over a shard group)."""
    return clip_factor(sq, cfg.clip_phi)


def weighted(tensors: Sequence[Tensor], weight: float) -> list[Tensor]:
    """``w·Δ`` in fp32 (or wider); weight 0 gives exact zeros even if Δ is NaN/inf (never ``NaN·0``)."""
    out = []
    for t in tensors:
        t = t.to(torch.promote_types(t.dtype, torch.float32))
        out.append(torch.zeros_like(t) if weight == 0.0 else t * weight)
    return out


def aggregate(
    deltas: Sequence[Sequence[Tensor]], w: Tensor | Sequence[float], cfg: PenaltyConfig
) -> tuple[list[Tensor], float]:
    """Single-process reference: ``Δ = Σ wᵢ Δᵢ`` then per-module clipping by its total norm.

    ``deltas[i]`` is worker i's list of tensors for the module. Workers with weight 0 are ignored even if
    their Δ is non-finite. Returns the clipped Δ tensors and the clip coefficient applied.
    """
    wl = [float(x) for x in torch.as_tensor(w, dtype=torch.float64).tolist()]
    if len(wl) != len(deltas):
        raise ValueError(f"aggregate: got {len(deltas)} workers' deltas but {len(wl)} weights")
    if not deltas:
        raise ValueError("aggregate: no workers")
    out: list[Tensor] | None = None
    for wi, di in zip(wl, deltas):
        contrib = weighted(di, wi)
        out = contrib if out is None else [a + b for a, b in zip(out, contrib)]
    assert out is not None
    sq = sum(float(t.double().pow(2).sum()) for t in out)
    coef = clip_coef_from_sqnorm(sq, cfg)
    if coef != 1.0:
        out = [t * coef for t in out]
    return out, coef


def flag(st: EWMAStats, x: Tensor, cfg: PenaltyConfig, floor_abs: float = 0.0,
         regime: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The anomaly test of values ``x`` (larger = worse) against per-worker statistics ``st``: (anomalous —
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


def decide_with(st: EWMAStats, module: str, g: Tensor, steps: Tensor | None, cfg: PenaltyConfig) -> Decision:
    """One module's EDiT decision against the statistics ``st`` (one row per worker of ``g``), which are
    updated with the accepted values: the anomaly test, regime rescale, re-admission and weights."""
    x = per_step(g, steps)
    anomalous, z, thr, readmit = flag(st, x, cfg)
    st.update(x, ~anomalous & ~readmit)
    w = weights(g, anomalous, cfg, steps)
    return Decision(module=module, norms=g.tolist(), weights=w.tolist(), anomalous=anomalous.tolist(),
                    z=z.tolist(), all_anomalous=bool(anomalous.all()), threshold=thr.tolist())


def _regime(st: EWMAStats, x: Tensor, z: Tensor, thr: Tensor, warm: Tensor, finite: Tensor) -> bool:
    """A shift shared by a strict majority of the warm workers is a regime change, not an anomaly:
    rescale every worker's statistics by the shared factor ``c`` (the lower median of ``x/μ`` for a
    rise, the upper median for a drop), so only workers that moved differently stay flagged.
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


class PseudoGradAggregator:
    """Per-module EWMA statistics of a fixed set of workers + the deterministic decision (`decide_with`).
    The sync uses the same math through the per-cluster-name rule in `rules.py`."""

    def __init__(self, cfg: PenaltyConfig, num_workers: int) -> None:
        cfg.validate()
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.cfg = cfg
        self.num_workers = num_workers
        self.stats: dict[str, EWMAStats] = {}

    def _stats(self, module: str) -> EWMAStats:
        if module not in self.stats:
            self.stats[module] = EWMAStats(self.num_workers, self.cfg.ewma_alpha)
        return self.stats[module]

    def decide(self, module: str, norms: Tensor, steps: Tensor | Sequence[float] | None = None) -> Decision:
        """Flag anomalies, update statistics with accepted values, compute weights (docs/sync_math.md)."""
        g = torch.as_tensor(norms, dtype=torch.float64).detach().cpu().reshape(-1)
        if g.numel() != self.num_workers:
            raise ValueError(f"decide({module!r}): expected {self.num_workers} norms, got {g.numel()}")
        if steps is not None:
            steps = torch.as_tensor(steps, dtype=torch.float64).detach().cpu().reshape(-1)
        return decide_with(self._stats(module), module, g, steps, self.cfg)

    def state_dict(self) -> dict[str, Tensor]:
        """Flat ``{"<module>/<field>": tensor}`` for the fields mu, m2, count, streak, streak_mu, streak_m2
        (CPU, contiguous; safetensors-ready)."""
        sd: dict[str, Tensor] = {}
        for name, st in self.stats.items():
            for f in _FIELDS:
                sd[f"{name}/{f}"] = getattr(st, f).clone().contiguous()
        return sd

    def load_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Restore statistics saved by :meth:`state_dict` (replaces all current statistics). Checkpoints
        without the streak fields (older versions) load with empty streaks."""
        grouped: dict[str, dict[str, Tensor]] = {}
        for key, val in sd.items():
            if "/" not in key:
                raise ValueError(f"penalty state: unexpected key {key!r} (expected '<module>/<{'|'.join(_FIELDS)}>')")
            module, fname = key.rsplit("/", 1)
            if fname not in _FIELDS:
                raise ValueError(f"penalty state: unexpected key {key!r}")
            if val.numel() != self.num_workers:
                raise ValueError(
                    f"penalty state: {key!r} has {val.numel()} entries but there are {self.num_workers} "
                    "workers; the checkpoint was written with a different cluster.groups"
                )
            grouped.setdefault(module, {})[fname] = val
        stats: dict[str, EWMAStats] = {}
        for module, fields in grouped.items():
            missing = set(_REQUIRED) - fields.keys()
            if missing:
                raise ValueError(f"penalty state: module {module!r} lacks {sorted(missing)}")
            st = EWMAStats(self.num_workers, self.cfg.ewma_alpha)
            for fname, val in fields.items():
                dtype = torch.int64 if fname in ("count", "streak") else torch.float64
                setattr(st, fname, val.detach().cpu().to(dtype).reshape(-1).clone())
            stats[module] = st
        self.stats = stats
