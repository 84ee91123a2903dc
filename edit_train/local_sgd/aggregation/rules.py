"""Aggregation rules by name, and the `algo.rule` config that picks one and holds each rule's parameters.

`algo.rule.name` names the rule: a built-in (`verified`, the default, in `verified.py`; `edit_norm`, EDiT's
rule; `uniform`) or ``"package.module:Class"`` for a rule defined outside this package (imported on first use).
Each built-in rule owns its parameters (`algo.rule.verified.*`, `algo.rule.edit_norm.*`); a rule of your
own gets `algo.rule.options` (a dict): built from its `Config` dataclass when it has one (an unknown key is
refused in one line), else handed over as the dict. The round's own parameters — clipping — sit beside them.

    @register_rule("my_rule")
    class MyRule:
        needs = Needs.SUM                   # or MEASUREMENTS / CONTRIBUTIONS (aggregator.py)
        def __init__(self, options) -> None: ...
        def decide(self, ev: Evidence) -> Decision: ...
        def state(self): return {}, {}
        def load(self, meta, tensors) -> None: ...

A rule keeps whatever statistics it needs per cluster *name* (an absent cluster's history is untouched) and
hands them over as JSON + tensors for checkpoints and healing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from edit_train.importpath import load
from edit_train.local_sgd.aggregator import Aggregator, Combiner, Decision, Evidence, Needs, needs_of, nobody, spread
from edit_train.local_sgd.penalty import NormTestConfig, check_fields, flag, per_step
from edit_train.local_sgd.penalty_stats import ClusterRows, EWMAStats
from edit_train.local_sgd.aggregation.verified import VerifiedConfig, VerifiedRule

__all__ = ["RuleConfig", "EditNormConfig", "register_rule", "make_rule", "refuse_mode", "rule_names",
           "EditNormRule", "UniformRule", "softmax_weights"]

_WEIGHTINGS = ("softmax", "uniform")


@dataclass
class EditNormConfig(NormTestConfig):
    """`edit_norm`: EDiT's norm test + softmax(−norm) weights."""

    weighting: str = "softmax"  # softmax | uniform
    temperature: float = 1.0  # relative to the median accepted per-step norm (scale-free)
    step_weight_ratio: float = 0.0  # blend in each cluster's share of the steps: w ← (1−r)w + r·sᵢ

    def validate(self, rule: str = "edit_norm") -> None:
        super().validate(rule)
        check_fields(self.weighting in _WEIGHTINGS, f"{rule}.weighting",
                     f"must be one of {_WEIGHTINGS}, got {self.weighting!r}")
        check_fields(self.temperature > 0 and math.isfinite(self.temperature), f"{rule}.temperature",
                     f"must be > 0, got {self.temperature}")
        check_fields(0.0 <= self.step_weight_ratio <= 1.0, f"{rule}.step_weight_ratio",
                     f"must be in [0, 1], got {self.step_weight_ratio}")


@dataclass
class RuleConfig:
    """`algo.rule`: which rule merges the clusters' pseudo-gradients, its parameters, and the round's clip."""

    name: str = "verified"  # the rule: a built-in or "package.module:Class"
    clip: bool = True
    clip_threshold: float = 10.0  # φ: the merged Δ of a unit is scaled to norm ≤ φ
    # from the first sync, whatever the rule: a contribution over this many times the quorum's median norm per
    # local step (penalty.interval_norm) counts as the median (clipped: scale.py, docs/sync_math.md); 0 = off
    scale_bound: float = 4.0
    # one between this and scale_bound times the median (every claimed step counted) counts as this many times it,
    # silently: no honest federation of benchmarks/false_positives.py went over it (scale.py); 0 = off
    scale_spread: float = 3.0
    verified: VerifiedConfig = field(default_factory=VerifiedConfig)
    edit_norm: EditNormConfig = field(default_factory=EditNormConfig)
    options: dict[str, Any] = field(default_factory=dict)  # a rule of your own: its parameters

    @property
    def clip_phi(self) -> float | None:
        """The clip threshold φ, or None when clipping is off."""
        return self.clip_threshold if self.clip else None

    def validate(self) -> None:
        check_fields(self.clip_threshold > 0, "clip_threshold", f"must be > 0, got {self.clip_threshold}")
        check_fields(self.scale_bound == 0 or self.scale_bound >= 1, "scale_bound",
                     f"must be 0 (off) or >= 1, got {self.scale_bound}")
        check_fields(self.scale_spread == 0 or self.scale_spread >= 1, "scale_spread",
                     f"must be 0 (off) or >= 1, got {self.scale_spread}")
        self.verified.validate()
        self.edit_norm.validate()


_RULES: dict[str, Callable[[RuleConfig], Aggregator]] = {}


def register_rule(name: str, build: Callable[[RuleConfig], Any] | None = None) -> Callable[[type], type]:
    """Class decorator: make a rule selectable as `algo.rule.name=<name>` (built from `algo.rule.options`,
    or by `build(penalty_config)`)."""
    def add(cls: type) -> type:
        _RULES[name] = build if build is not None else (lambda cfg: _with_options(cls, cfg.options, name))
        return cls
    return add


def rule_names() -> list[str]:
    return sorted(_RULES)


def _with_options(factory: Any, options: dict[str, Any], spec: str) -> Any:
    """`factory(Config(**options))` when the rule declares a `Config` dataclass, else `factory(options)`."""
    config = getattr(factory, "Config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return factory(dict(options))
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"algo.rule.options: {unknown} are not parameters of rule {spec!r} "
                         f"(it takes {sorted(known)})")
    return factory(config(**options))


def make_rule(cfg: RuleConfig) -> Aggregator:
    """The rule `cfg.name` names (a registered name or "module:attr"), built with its own parameters."""
    if cfg.name in _RULES:
        rule = _RULES[cfg.name](cfg)
    else:
        rule = _with_options(load(cfg.name, "algo.rule.name", "rule", rule_names()), cfg.options, cfg.name)
    if not isinstance(rule, Aggregator):
        raise ValueError(f"algo.rule.name: {cfg.name!r} does not build a rule (needs decide, state and load)")
    try:
        needs = needs_of(rule)
    except ValueError:
        raise ValueError(f"algo.rule.name: {cfg.name!r} says it needs {getattr(rule, 'needs')!r}; one of "
                         f"{[n.value for n in Needs]}") from None
    if isinstance(rule, Combiner) and needs is not Needs.CONTRIBUTIONS:
        raise ValueError(f"algo.rule.name: {cfg.name!r} combines contributions itself, so it needs "
                         f"Needs.CONTRIBUTIONS, not {needs.value!r}")
    return rule


def refuse_mode(rule: Aggregator, name: str, clusters: int, gather_max: int, keeps_unsent: bool) -> str:
    """Why `rule` cannot serve this federation ("" when it can): a rule that needs every contribution gathers
    them at every cluster count, which `sync.gather_max` (the most clusters each may receive every
    contribution from) must allow; a rule that merges by itself has no weight to keep top-k's unsent part by."""
    needs = needs_of(rule)
    if needs is Needs.CONTRIBUTIONS and clusters > gather_max:
        return (f"{name!r} needs every cluster's contribution, which sync.gather_max={gather_max} forbids at "
                f"{clusters} clusters: raise sync.gather_max to {clusters} or pick a rule that needs a SUM or "
                "measurements")
    if isinstance(rule, Combiner) and keeps_unsent:
        return f"{name!r} merges the contributions itself: sync.unsent=keep needs a weighted sum (use resend)"
    return ""


# ------------------------------------------------------------------------------------------- built-in rules
register_rule("verified", lambda cfg: VerifiedRule(cfg.verified))(VerifiedRule)


@register_rule("uniform", lambda cfg: UniformRule())
class UniformRule:
    """Every contributor weighs the same (DiLoCo, post-local SGD); a non-finite reported norm gets weight 0."""

    needs = Needs.SUM

    def decide(self, ev: Evidence) -> Decision:
        ok = [c and math.isfinite(float(g)) for c, g in zip(ev.contributes, ev.norms.tolist())]
        n_ok = sum(ok)
        w = [1.0 / n_ok if o else 0.0 for o in ok] if n_ok else [0.0] * len(ok)
        bad = [c and not o for c, o in zip(ev.contributes, ok)]
        return Decision(ev.module, ev.norms.tolist(), w, bad, n_ok == 0, [{} for _ in ok])

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return {}, {}

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        return None


def softmax_weights(norms: Tensor, left_out: Tensor, cfg: EditNormConfig,
                    steps: Tensor | Sequence[float] | None = None) -> Tensor:
    """EDiT's weights (float64, sum 1 over the accepted clusters; all zeros if none): `softmax(−xᵢ/(T·m))`,
    `xᵢ = Gᵢ/sᵢ` the per-step norm and `m` the (lower) median accepted `x` — invariant to the scale of the norms,
    exactly the paper's `softmax(−G/T)` when `m = 1` — or uniform; then the optional blend with each cluster's
    share of the steps."""
    g = torch.as_tensor(norms, dtype=torch.float64).reshape(-1)
    x = per_step(g, steps)
    ok = ~torch.as_tensor(left_out, dtype=torch.bool).reshape(-1) & torch.isfinite(x)
    zeros = torch.zeros_like(g)
    n_ok = int(ok.sum())
    if n_ok == 0:
        return zeros
    w = torch.where(ok, torch.full_like(g, 1.0 / n_ok), zeros)
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


@register_rule("edit_norm", lambda cfg: EditNormRule(cfg.edit_norm))
class EditNormRule:
    """EDiT's rule (docs/sync_math.md): per-cluster EWMA of the per-step norm, a one-sided test, regime rescale
    and re-admission, softmax(−x/(T·m)) over the accepted clusters. Statistics are kept per cluster name (a
    roster slot each, in order of first appearance — the same on every cluster, because a cluster that missed a
    quorum heals the roster before it takes part again)."""

    needs = Needs.SUM

    def __init__(self, cfg: EditNormConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.clusters = ClusterRows()
        self.stats: dict[str, EWMAStats] = {}  # unit -> one row per cluster

    @property
    def roster(self) -> list[str]:
        return self.clusters.names

    def _rows(self, module: str, names: list[str]) -> Tensor:
        grown = self.clusters.add(names)
        for st in self.stats.values() if grown else ():
            st.grow(grown)
        if module not in self.stats:
            self.stats[module] = EWMAStats(len(self.clusters), self.cfg.ewma_alpha)
        return self.clusters.rows(names)

    def decide(self, ev: Evidence) -> Decision:
        idx = ev.contributors
        if not idx:
            return nobody(ev)
        g = torch.as_tensor(ev.norms, dtype=torch.float64).reshape(-1)
        rows = self._rows(ev.module, [ev.names[i] for i in idx])
        full = self.stats[ev.module]
        st = full.select(rows)
        steps = torch.as_tensor(ev.steps, dtype=torch.float64)[idx]
        x = per_step(g[idx], steps)
        left_out, z, thr, readmit = flag(st, x, self.cfg)
        st.update(x, ~left_out & ~readmit)
        full.assign(rows, st)
        w = softmax_weights(g[idx], left_out, self.cfg, steps)
        evidence = [{"z": float(zi), "threshold": float(ti)} for zi, ti in zip(z.tolist(), thr.tolist())]
        d = Decision(ev.module, g[idx].tolist(), w.tolist(), left_out.tolist(), bool(left_out.all()), evidence)
        return spread(d, idx, len(ev.names), g)

    # ------------------------------------------------------------- state
    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """{"roster": names}, {"<unit>/<field>": [len(roster)] tensor}."""
        tensors = {f"{m}/{f}": getattr(st, f).clone().contiguous()
                   for m, st in self.stats.items() for f in EWMAStats.FIELDS}
        return {"roster": list(self.roster)}, tensors

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        roster = [str(n) for n in meta.get("roster", [])]
        stats: dict[str, EWMAStats] = {}
        for key, val in tensors.items():
            module, _, fname = key.rpartition("/")
            if fname not in EWMAStats.FIELDS or val.dim() != 1 or val.shape[0] != len(roster):
                raise ValueError(f"penalty state: {key!r} does not fit a roster of {len(roster)} clusters")
            st = stats.setdefault(module, EWMAStats(len(roster), self.cfg.ewma_alpha))
            dtype = torch.int64 if fname in ("count", "streak") else torch.float64
            setattr(st, fname, val.detach().cpu().to(dtype).clone())
        self.clusters, self.stats = ClusterRows(roster), stats
