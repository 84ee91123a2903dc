"""Anchor θ̄ and outer optimizer per unit, on plain (local-shard) tensors (EDiT §4 step 5).

``OuterState`` never touches ``torch.distributed``: the caller hands it the rank's live local tensors
(e.g. ``p.to_local()`` of FSDP2 DTensors) and the already-reduced pseudo-gradient.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from edit_train.local_sgd.sync.staleness import MOMENTUM_KEYS, StalenessConfig, correct

__all__ = ["DEFAULT_OUTER_STEPS", "OuterConfig", "OuterState", "default_outer_step"]

_PREFIX = "algo.outer"  # where the config lives in the Hydra tree (for error messages)

# The outer step `algo=edit` gets when `algo.outer.lr` / `algo.outer.momentum` are left unset (null), by the number
# of configured clusters M: (up to M clusters, lr, Nesterov momentum), the first row whose M is >= the federation's.
# Measured at the convergence setting (tiny, 320 steps, H = 8, AdamW 3e-3; docs/algorithms.md, "The outer step's
# default"): at M = 2 the 9-point grid lr {0.5, 0.7, 1.0} x momentum {0, 0.5, 0.8} is best at 0.5 / 0.5 (1.969;
# the EDiT paper's 0.7 / 0.8 that edit shipped before: 2.203, worst but two). M >= 3: a longer step, 0.7 / 0.5, beat
# M = 2's point at 4 clusters (seed 0: 1.8789 against 1.9095; benchmarks/default_outer.py), as the DiLoCo scaling
# laws' best outer lr rises with M; only those two points were tried. The interval enters once a second interval is
# measured: every interval takes H = 8's row today.
DEFAULT_OUTER_STEPS: tuple[tuple[float, float, float], ...] = ((2, 0.5, 0.5), (math.inf, 0.7, 0.5))
MEASURED_INTERVALS = (8,)  # the intervals the table was measured at


def default_outer_step(clusters: int, interval: int) -> tuple[float, float]:
    """(outer lr, Nesterov momentum) for a federation of `clusters` configured clusters syncing every `interval`
    local steps: `DEFAULT_OUTER_STEPS`' row for the cluster count (the interval does not move it yet: the table
    holds H = 8 only, `MEASURED_INTERVALS`)."""
    if clusters < 1 or interval < 1:
        raise ValueError(f"the outer step's default needs >= 1 cluster and an interval >= 1, got {clusters} "
                         f"cluster(s), interval {interval}")
    for up_to, lr, momentum in DEFAULT_OUTER_STEPS:
        if clusters <= up_to:
            return lr, momentum
    raise AssertionError("DEFAULT_OUTER_STEPS ends with an unbounded row")


@dataclass
class OuterConfig:
    """Outer optimizer: any ``torch.optim`` class by name (default Nesterov SGD). ``lr`` / ``momentum`` None: the
    default by cluster count (`default_outer_step`), filled in by `resolved` before the config is used."""

    optimizer: str = "SGD"
    lr: Optional[float] = 0.7
    momentum: Optional[float] = 0.8
    nesterov: bool = True
    kwargs: dict[str, Any] = field(default_factory=dict)
    offload: bool = False
    # Pier (arXiv 2511.17849), per unit, counted in its outer steps t = 1, 2, ...: momentum μ·min(1, t/W)
    momentum_warmup_syncs: int = 0  # W (0 = off)
    lr_warmup_syncs: int = 0  # lr·min(1, t/W_lr) (0 = off)
    lr_decay_syncs: int = 0  # > 0: cosine from lr (after the warm-up) to lr·min_lr_ratio at t = this, then flat
    min_lr_ratio: float = 0.1
    # the staleness correction (HeLoCo, arXiv 2606.00271; staleness.py): a merged Δ's block that points against the
    # outer momentum loses part of its component along it, β = min(strength·(−cos)·conf, cap)
    staleness_correction: bool = False
    staleness_strength: float = 1.0
    staleness_cap: float = 1.0
    staleness_kappa: float = 1.0

    @property
    def unset(self) -> tuple[str, ...]:
        """The fields left to the default by cluster count (None): "lr", "momentum"."""
        return tuple(k for k in ("lr", "momentum") if getattr(self, k) is None)

    def resolved(self, clusters: int, interval: int) -> "OuterConfig":
        """This config with `lr` / `momentum` left unset taken from `default_outer_step(clusters, interval)`; a set
        value is kept (an explicit `algo.outer.lr` wins)."""
        if not self.unset:
            return self
        lr, momentum = default_outer_step(clusters, interval)
        return dataclasses.replace(self, lr=lr if self.lr is None else self.lr,
                                   momentum=momentum if self.momentum is None else self.momentum)

    @property
    def staleness(self) -> StalenessConfig | None:
        """The correction's parameters, or None when it is off."""
        if not self.staleness_correction:
            return None
        return StalenessConfig(self.staleness_strength, self.staleness_cap, self.staleness_kappa)

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        cls = getattr(torch.optim, self.optimizer, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(
                f"{_PREFIX}.optimizer must name a torch.optim optimizer (e.g. 'SGD'), got {self.optimizer!r}"
            )
        return cls

    def optimizer_kwargs(self) -> dict[str, Any]:
        """``lr`` + momentum/nesterov where the class accepts them + ``kwargs`` (which win)."""
        accepted = inspect.signature(self.optimizer_class().__init__).parameters
        kw: dict[str, Any] = {"lr": self.lr}
        if "momentum" in accepted:
            kw["momentum"] = self.momentum
        if "nesterov" in accepted:
            kw["nesterov"] = self.nesterov
        kw.update(self.kwargs)
        return kw

    @property
    def scheduled(self) -> bool:
        """Whether the outer lr or momentum changes with the sync count (then each unit keeps its count)."""
        return bool(self.momentum_warmup_syncs or self.lr_warmup_syncs or self.lr_decay_syncs)

    def lr_at(self, t: int) -> float:
        """The outer lr at this unit's t-th outer step (t >= 1)."""
        w, d = self.lr_warmup_syncs, self.lr_decay_syncs
        if w and t < w:
            return self.lr * t / w
        if d and d > w:
            frac = min(1.0, (t - w) / (d - w))
            return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))
        return self.lr

    def momentum_at(self, t: int) -> float:
        """The outer momentum at this unit's t-th outer step (t >= 1)."""
        w = self.momentum_warmup_syncs
        return self.momentum * min(1.0, t / w) if w else self.momentum

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field."""
        if self.unset:
            raise ValueError(f"{_PREFIX}.{self.unset[0]} is unset: it is the default by cluster count only once "
                             "resolved (OuterConfig.resolved); give a number")
        for key in ("momentum_warmup_syncs", "lr_warmup_syncs", "lr_decay_syncs"):
            v = getattr(self, key)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ValueError(f"{_PREFIX}.{key} must be an integer >= 0 (0 = off), got {v!r}")
        if self.lr_decay_syncs and self.lr_decay_syncs <= self.lr_warmup_syncs:
            raise ValueError(f"{_PREFIX}.lr_decay_syncs must be > lr_warmup_syncs ({self.lr_warmup_syncs}) or 0, "
                             f"got {self.lr_decay_syncs}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"{_PREFIX}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        self._validate_staleness()
        cls = self.optimizer_class()
        if not self.lr > 0:
            raise ValueError(f"{_PREFIX}.lr must be > 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"{_PREFIX}.momentum must be in [0, 1), got {self.momentum}")
        kw = self.optimizer_kwargs()
        if kw.get("nesterov") and not kw.get("momentum"):
            raise ValueError(
                f"{_PREFIX}.nesterov=true requires {_PREFIX}.momentum > 0 (set {_PREFIX}.nesterov=false)"
            )
        try:
            cls([torch.zeros(1)], **kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{_PREFIX}.kwargs rejected by torch.optim.{self.optimizer}: {e}") from e

    def _validate_staleness(self) -> None:
        for key, lo, hi in (("staleness_strength", 0.0, math.inf), ("staleness_cap", 0.0, 1.0),
                            ("staleness_kappa", 0.0, math.inf)):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and lo <= v <= hi and math.isfinite(v)):
                raise ValueError(f"{_PREFIX}.{key} must be in [{lo:g}, {hi:g}], got {v!r}")
        if self.staleness_correction and self.optimizer == "SGD" and not self.momentum:
            raise ValueError(f"{_PREFIX}.staleness_correction=true needs an outer momentum to compare against "
                             f"({_PREFIX}.momentum > 0, or an optimizer with one, e.g. Adam)")


def _anchor_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


class OuterState:
    """Per-unit anchors θ̄ and one outer optimizer per unit (so units step independently)."""

    def __init__(self, modules: dict[str, list[Tensor]], cfg: OuterConfig,
                 reduce: Callable[[Tensor], Tensor] | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.reduce = reduce  # sums a small tensor over the cluster's ranks (the staleness correction's cosines)
        self.staleness = cfg.staleness
        self.cosines: dict[str, list[float]] = {}  # the correction's last cosines per unit (NaN: no momentum yet)
        self.params: dict[str, list[Tensor]] = {n: list(ps) for n, ps in modules.items()}
        self._pin = cfg.offload and torch.cuda.is_available()
        self.anchors: dict[str, list[Tensor]] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self._resident: set[str] = set()
        cls, kw = cfg.optimizer_class(), cfg.optimizer_kwargs()
        with torch.no_grad():
            for name, ps in self.params.items():
                if not ps:
                    raise ValueError(f"outer: module {name!r} has no parameters")
                anchors = []
                for p in ps:
                    dev = torch.device("cpu") if cfg.offload else p.device
                    a = torch.empty(p.shape, dtype=_anchor_dtype(p.dtype), device=dev, pin_memory=self._pin)
                    a.copy_(p.detach())
                    anchors.append(a)
                self.anchors[name] = anchors
                self.optimizers[name] = cls(anchors, **kw)

    # ----------------------------------------------------------------- helpers
    @property
    def module_names(self) -> list[str]:
        return list(self.params)

    def numel(self, name: str) -> int:
        return sum(a.numel() for a in self.anchors[name])

    def nbytes(self, name: str) -> int:
        """Bytes of the unit's anchor tensors (= one fp32 pseudo-gradient)."""
        return sum(a.numel() * a.element_size() for a in self.anchors[name])

    def _state_tensors(self, name: str) -> list[tuple[dict, str, int]]:
        """(state dict, key, param index) for every non-scalar optimizer state tensor of ``name``."""
        opt = self.optimizers[name]
        out = []
        for i, a in enumerate(self.anchors[name]):
            for k, v in opt.state.get(a, {}).items():
                if isinstance(v, Tensor) and v.dim() > 0:
                    out.append((opt.state[a], k, i))
        return out

    # ---------------------------------------------------------------- offload
    def prefetch(self, name: str) -> None:
        """Offload only: copy the unit's anchor and optimizer state to the params' devices."""
        if not self.cfg.offload or name in self._resident:
            return
        ps = self.params[name]
        for a, p in zip(self.anchors[name], ps):
            a.data = a.data.to(p.device, non_blocking=True)
        for st, k, i in self._state_tensors(name):
            st[k] = st[k].to(ps[i].device, non_blocking=True)
        self._resident.add(name)

    def _to_host(self, t: Tensor) -> Tensor:
        if t.device.type == "cpu":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
        host.copy_(t, non_blocking=self._pin)
        return host

    def release(self, name: str) -> None:
        """Offload only: move the unit's anchor and optimizer state back to (pinned) CPU memory."""
        if not self.cfg.offload or name not in self._resident:
            return
        for a in self.anchors[name]:
            a.data = self._to_host(a.data)
        for st, k, _ in self._state_tensors(name):
            st[k] = self._to_host(st[k])
        self._resident.discard(name)

    def _sync_host(self) -> None:
        if self._pin:
            torch.cuda.synchronize()

    # ---------------------------------------------------------------- algorithm
    @torch.no_grad()
    def pseudo_grad(self, name: str) -> list[Tensor]:
        """``Δ = θ̄ − θ`` on the live params' devices, fp32 (or wider)."""
        out = []
        for a, p in zip(self.anchors[name], self.params[name]):
            out.append(a.to(p.device, non_blocking=True) - p.detach().to(a.dtype))
        return out

    @torch.no_grad()
    def step(self, name: str, delta: Sequence[Tensor]) -> None:
        """``θ̄.grad = Δ``; step this unit's outer optimizer. Does not touch the live params."""
        anchors = self.anchors[name]
        if len(delta) != len(anchors):
            raise ValueError(f"OuterState.step({name!r}): got {len(delta)} tensors, module has {len(anchors)}")
        own = self.cfg.offload and name not in self._resident
        if own:
            self.prefetch(name)
        try:
            for a, d in zip(anchors, delta):
                if d.shape != a.shape:
                    raise ValueError(
                        f"OuterState.step({name!r}): delta shape {tuple(d.shape)} != anchor {tuple(a.shape)}"
                    )
                a.grad = d.detach().to(device=a.device, dtype=a.dtype)
            opt = self.optimizers[name]
            if self.staleness is not None:
                self._correct(name)
            t = self._schedule(name) if self.cfg.scheduled else 0
            opt.step()
            if t:  # after the step: an optimizer that initialises empty state (Adam) must still find it empty
                opt.state[anchors[0]][self.COUNT] = torch.tensor(float(t), dtype=torch.float64)
            opt.zero_grad(set_to_none=True)
        finally:
            if own:
                self.release(name)

    def _correct(self, name: str) -> None:
        """The staleness correction of the grads about to step, against this unit's outer momentum."""
        anchors, opt = self.anchors[name], self.optimizers[name]
        momentum = [next((v for k, v in opt.state.get(a, {}).items() if k in MOMENTUM_KEYS), None) for a in anchors]
        assert self.staleness is not None
        dev, reduce = self.params[name][0].device, self.reduce
        on_params = (lambda t: reduce(t.to(dev))) if reduce is not None else None  # the collective's device
        fixed, self.cosines[name] = correct([a.grad for a in anchors], momentum, self.staleness, on_params)
        for a, g in zip(anchors, fixed):
            a.grad = g

    COUNT = "outer_syncs"  # the unit's outer steps so far, beside its optimizer state (checkpoints, heals, rollbacks)

    def _schedule(self, name: str) -> int:
        """This outer step's number t and its lr and momentum (``OuterConfig.lr_at`` / ``momentum_at``)."""
        opt = self.optimizers[name]
        st = opt.state.get(self.anchors[name][0], {})
        t = int(st[self.COUNT]) + 1 if self.COUNT in st else 1
        for g in opt.param_groups:
            g["lr"] = self.cfg.lr_at(t)
            if "momentum" in g:
                g["momentum"] = self.cfg.momentum_at(t)
        return t

    @torch.no_grad()
    def reset(self, name: str) -> None:
        """Live params ← anchor (cast to the params' dtype)."""
        for a, p in zip(self.anchors[name], self.params[name]):
            p.copy_(a, non_blocking=True)

    @torch.no_grad()
    def snapshot(self, name: str) -> tuple[list[Tensor], dict[int, dict[str, Any]], list[Tensor]]:
        """What `restore` needs to undo this unit's next outer step and reset (anchor, optimizer
        state, live params): a sync commits on every cluster or on none."""
        opt = self.optimizers[name]
        state = {i: {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in opt.state.get(a, {}).items()}
                 for i, a in enumerate(self.anchors[name])}
        return ([a.detach().clone() for a in self.anchors[name]], state,
                [p.detach().clone() for p in self.params[name]])

    @torch.no_grad()
    def restore(self, name: str, snap: tuple[list[Tensor], dict[int, dict[str, Any]], list[Tensor]]) -> None:
        anchors, state, params = snap
        opt = self.optimizers[name]
        for i, (a, saved) in enumerate(zip(self.anchors[name], anchors)):
            a.copy_(saved.to(a.device))
            opt.state[a] = dict(state.get(i, {}))
            if not opt.state[a]:
                del opt.state[a]
        for p, saved in zip(self.params[name], params):
            p.copy_(saved)

    def skip(self, name: str) -> None:
        """Every cluster anomalous: no outer step, live params ← anchor."""
        self.reset(name)

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Tensor]:
        """Flat ``{"<unit>/anchor/<i>", "<unit>/<state_key>/<i>": CPU tensor}`` (safetensors-ready)."""
        self._sync_host()
        sd: dict[str, Tensor] = {}
        for name, anchors in self.anchors.items():
            opt = self.optimizers[name]
            for i, a in enumerate(anchors):
                sd[f"{name}/anchor/{i}"] = a.detach().to("cpu", copy=True).contiguous()
                for k, v in opt.state.get(a, {}).items():
                    if v is None:
                        continue
                    t = v if isinstance(v, Tensor) else torch.tensor(v)
                    sd[f"{name}/{k}/{i}"] = t.detach().to("cpu", copy=True).contiguous()
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Restore anchors and optimizer state exactly (live params are not touched; call ``reset``)."""
        self._sync_host()
        per_mod: dict[str, list[tuple[str, int, Tensor]]] = {}
        for key, val in sd.items():
            parts = key.rsplit("/", 2)
            if len(parts) != 3 or not parts[2].isdigit():
                raise ValueError(f"outer state: unexpected key {key!r} (expected '<module>/<kind>/<index>')")
            name, kind, idx = parts[0], parts[1], int(parts[2])
            if name not in self.anchors:
                raise ValueError(f"outer state: key {key!r} names unknown module {name!r}")
            if idx >= len(self.anchors[name]):
                raise ValueError(f"outer state: key {key!r} index out of range")
            per_mod.setdefault(name, []).append((kind, idx, val))
        for name, anchors in self.anchors.items():
            got = {(k, i) for k, i, _ in per_mod.get(name, [])}
            missing = [i for i in range(len(anchors)) if ("anchor", i) not in got]
            if missing:
                raise ValueError(f"outer state: module {name!r} lacks anchor tensors {missing}")
        for name, entries in per_mod.items():
            anchors, opt = self.anchors[name], self.optimizers[name]
            opt.state.clear()
            for kind, i, val in entries:
                a = anchors[i]
                if kind == "anchor":
                    if tuple(val.shape) != tuple(a.shape):
                        raise ValueError(
                            f"outer state: {name}/anchor/{i} has shape {tuple(val.shape)}, "
                            f"expected {tuple(a.shape)}"
                        )
                    a.copy_(val)
                elif val.dim() > 0:
                    pin = self._pin and a.device.type == "cpu"
                    t = torch.empty(val.shape, dtype=val.dtype, device=a.device, pin_memory=pin)
                    t.copy_(val)
                    opt.state[a][kind] = t
                else:
                    opt.state[a][kind] = val.detach().clone()
