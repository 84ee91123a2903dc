"""Anomaly-aware pseudo-gradient aggregation (EDiT §4 steps 2–4), pure tensor math.

Every rank sees the same all-gathered vector of per-worker pseudo-gradient norms ``G`` for a module and
runs the same deterministic :meth:`PseudoGradAggregator.decide`, so all ranks agree on anomalies and
weights without further communication. No ``torch.distributed`` here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

__all__ = [
    "PenaltyConfig",
    "EWMAStats",
    "Decision",
    "PseudoGradAggregator",
    "weights",
    "clip_coef",
    "clip_coef_from_sqnorm",
    "weighted",
    "aggregate",
]

_WEIGHTINGS = ("softmax", "uniform")
_PREFIX = "algo.penalty"  # where the config lives in the Hydra tree (for error messages)


@dataclass
class PenaltyConfig:
    """Anomaly elimination, weighting and clipping of pseudo-gradients."""

    anomaly: bool = True
    weighting: str = "softmax"
    clip: bool = True
    ewma_alpha: float = 0.02
    warmup_syncs: int = 10
    z_threshold: float = 3.0
    temperature: float = 1.0
    clip_threshold: float = 10.0
    step_weight_ratio: float = 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field."""
        if self.weighting not in _WEIGHTINGS:
            raise ValueError(f"{_PREFIX}.weighting must be one of {_WEIGHTINGS}, got {self.weighting!r}")
        if not 0.0 < self.ewma_alpha < 1.0:
            raise ValueError(f"{_PREFIX}.ewma_alpha must be in (0, 1), got {self.ewma_alpha}")
        if self.warmup_syncs < 0:
            raise ValueError(f"{_PREFIX}.warmup_syncs must be >= 0, got {self.warmup_syncs}")
        if not self.z_threshold > 0:
            raise ValueError(f"{_PREFIX}.z_threshold must be > 0, got {self.z_threshold}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"{_PREFIX}.temperature must be > 0, got {self.temperature}")
        if not self.clip_threshold > 0:
            raise ValueError(f"{_PREFIX}.clip_threshold must be > 0, got {self.clip_threshold}")
        if not 0.0 <= self.step_weight_ratio <= 1.0:
            raise ValueError(f"{_PREFIX}.step_weight_ratio must be in [0, 1], got {self.step_weight_ratio}")


class EWMAStats:
    """EWMA mean/variance of ``G`` for one module, vectorised over workers (float64).

    Update (DESIGN.md §4): ``d = x − μ; μ ← μ + a·d; M2 ← (1−a)(M2 + a·d·(x − μ_new))`` with
    ``a = max(α, 1/n)`` for the n-th accepted value (bias correction for the first ~1/α values)."""

    def __init__(self, num_workers: int, alpha: float) -> None:
        self.alpha = float(alpha)
        self.mu = torch.zeros(num_workers, dtype=torch.float64)
        self.m2 = torch.zeros(num_workers, dtype=torch.float64)
        self.count = torch.zeros(num_workers, dtype=torch.int64)

    @property
    def sigma(self) -> Tensor:
        return self.m2.clamp_min(0.0).sqrt()

    def zscore(self, x: Tensor) -> Tensor:
        """``(x − μ)/σ``; with σ == 0: 0 if x == μ, ±inf otherwise (NaN stays NaN)."""
        x = x.to(torch.float64)
        d = x - self.mu
        sigma = self.sigma
        z = d / torch.where(sigma > 0, sigma, torch.ones_like(sigma))
        inf = torch.full_like(d, math.inf)
        flat = torch.where(d > 0, inf, torch.where(d < 0, -inf, torch.where(d == 0, 0.0, d)))
        return torch.where(sigma > 0, z, flat)

    def update(self, x: Tensor, accept: Tensor) -> None:
        """Fold ``x[i]`` into worker i's statistics where ``accept[i]`` (non-finite never accepted)."""
        x = x.to(torch.float64)
        accept = accept.bool() & torch.isfinite(x)
        # Bias-corrected rate: the n-th accepted value uses max(α, 1/n), so the first ~1/α values give the
        # plain running mean/variance instead of a μ stuck at the first value and a σ shrunk by ~√α (which
        # flags every healthy but still-moving module right after the warm-up). Afterwards it is the EWMA
        # of DESIGN.md §4 with α.
        a = torch.maximum(torch.full_like(x, self.alpha), 1.0 / (self.count.to(torch.float64) + 1.0))
        first = accept & (self.count == 0)
        later = accept & (self.count > 0)
        xs = torch.where(accept, x, self.mu)  # keep NaN out of the arithmetic
        d = xs - self.mu
        mu_new = self.mu + a * d
        m2_new = (1.0 - a) * (self.m2 + a * d * (xs - mu_new))
        self.mu = torch.where(first, xs, torch.where(later, mu_new, self.mu))
        self.m2 = torch.where(first, torch.zeros_like(self.m2), torch.where(later, m2_new, self.m2))
        self.count = self.count + accept.to(torch.int64)


@dataclass
class Decision:
    """Outcome of one module's sync decision (identical on every rank)."""

    module: str
    norms: list[float]
    weights: list[float]
    anomalous: list[bool]
    z: list[float]
    all_anomalous: bool

    def as_dict(self) -> dict:
        """JSON-friendly dict; non-finite floats become ``None``."""
        d = asdict(self)
        for key in ("norms", "z", "weights"):
            d[key] = [v if math.isfinite(v) else None for v in d[key]]
        return d


def weights(
    norms: Tensor, anomalous: Tensor, cfg: PenaltyConfig, steps: Tensor | Sequence[float] | None = None
) -> Tensor:
    """Per-worker weights (float64, sum 1 over accepted workers; all zeros if none accepted)."""
    g = torch.as_tensor(norms, dtype=torch.float64)
    ok = ~torch.as_tensor(anomalous, dtype=torch.bool) & torch.isfinite(g)
    zeros = torch.zeros_like(g)
    n_ok = int(ok.sum())
    if n_ok == 0:
        return zeros
    if cfg.weighting == "uniform":
        w = torch.where(ok, torch.full_like(g, 1.0 / n_ok), zeros)
    else:
        logits = torch.where(ok, -g / cfg.temperature, torch.full_like(g, -math.inf))
        logits = logits - logits.max()
        e = torch.where(ok, logits.exp(), zeros)
        w = e / e.sum()
    r = cfg.step_weight_ratio
    if r > 0 and steps is not None:
        s = torch.as_tensor(steps, dtype=torch.float64).reshape(g.shape)
        s = torch.where(ok, s.clamp_min(0.0), zeros)
        total = float(s.sum())
        if total > 0:  # no steps recorded → nothing to blend
            w = (1.0 - r) * w + r * (s / total)
    return w


def clip_coef(delta_norm: float, cfg: PenaltyConfig) -> float:
    """``min(1, φ/(‖Δ‖ + 1e-6))`` if clipping, else 1. A non-finite norm gives 0 (drop the update)."""
    if not cfg.clip:
        return 1.0
    delta_norm = float(delta_norm)
    if not math.isfinite(delta_norm):
        return 0.0
    return min(1.0, cfg.clip_threshold / (delta_norm + 1e-6))


def clip_coef_from_sqnorm(sq: float, cfg: PenaltyConfig) -> float:
    """:func:`clip_coef` from a squared norm (e.g. summed over a shard group)."""
    sq = float(sq)
    return clip_coef(math.sqrt(max(sq, 0.0)) if math.isfinite(sq) else math.inf, cfg)


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


class PseudoGradAggregator:
    """Per-module EWMA statistics + the deterministic anomaly/weight decision."""

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
        """Flag anomalies, update statistics with accepted norms, compute weights."""
        g = torch.as_tensor(norms, dtype=torch.float64).detach().cpu().reshape(-1)
        if g.numel() != self.num_workers:
            raise ValueError(f"decide({module!r}): expected {self.num_workers} norms, got {g.numel()}")
        st = self._stats(module)
        z = st.zscore(g)
        z = torch.where(st.count == 0, torch.where(torch.isfinite(g), 0.0, z), z)
        anomalous = ~torch.isfinite(g)
        if self.cfg.anomaly:
            # At least 2 accepted values are needed for a meaningful σ, whatever warmup_syncs says.
            warm = st.count >= max(self.cfg.warmup_syncs, 2)
            anomalous = anomalous | (warm & (z > self.cfg.z_threshold))
        st.update(g, ~anomalous)
        w = weights(g, anomalous, self.cfg, steps)
        return Decision(
            module=module,
            norms=g.tolist(),
            weights=w.tolist(),
            anomalous=anomalous.tolist(),
            z=z.tolist(),
            all_anomalous=bool(anomalous.all()),
        )

    def state_dict(self) -> dict[str, Tensor]:
        """Flat ``{"<module>/mu"|"/m2"|"/count": tensor}`` (CPU, contiguous; safetensors-ready)."""
        sd: dict[str, Tensor] = {}
        for name, st in self.stats.items():
            sd[f"{name}/mu"] = st.mu.clone().contiguous()
            sd[f"{name}/m2"] = st.m2.clone().contiguous()
            sd[f"{name}/count"] = st.count.clone().contiguous()
        return sd

    def load_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Restore statistics saved by :meth:`state_dict` (replaces all current statistics)."""
        grouped: dict[str, dict[str, Tensor]] = {}
        for key, val in sd.items():
            if "/" not in key:
                raise ValueError(f"penalty state: unexpected key {key!r} (expected '<module>/<mu|m2|count>')")
            module, field = key.rsplit("/", 1)
            if field not in ("mu", "m2", "count"):
                raise ValueError(f"penalty state: unexpected key {key!r}")
            if val.numel() != self.num_workers:
                raise ValueError(
                    f"penalty state: {key!r} has {val.numel()} entries but there are {self.num_workers} "
                    "workers; the checkpoint was written with a different cluster.groups"
                )
            grouped.setdefault(module, {})[field] = val
        stats: dict[str, EWMAStats] = {}
        for module, fields in grouped.items():
            missing = {"mu", "m2", "count"} - fields.keys()
            if missing:
                raise ValueError(f"penalty state: module {module!r} lacks {sorted(missing)}")
            st = EWMAStats(self.num_workers, self.cfg.ewma_alpha)
            st.mu = fields["mu"].detach().cpu().to(torch.float64).reshape(-1).clone()
            st.m2 = fields["m2"].detach().cpu().to(torch.float64).reshape(-1).clone()
            st.count = fields["count"].detach().cpu().to(torch.int64).reshape(-1).clone()
            stats[module] = st
        self.stats = stats
