"""The aggregation seam: rules that turn what a sync gathered about each participant into weights.

A rule sees one module at a time (`Evidence`: the participants' names, their pseudo-gradient norms, their
local steps, whether they contribute at all, and `extra` for anything a round gathers beyond that) and
returns a `Decision` (weights, anomalous flags, the score and the bound each flag came from). Every
participant runs the same rule on the same evidence, so every cluster takes the same decision without more
communication. A rule owns whatever statistics it keeps (per cluster *name*, so an absent cluster's history
is untouched), and hands them over as JSON + tensors for checkpoints and healing.

Rules are chosen by `algo.penalty.rule`: a built-in name (`verified`, the default, in `verified.py`;
`edit_norm`, EDiT's rule; `uniform`) or
``"package.module:Class"`` for a rule defined outside this package (imported on first use). Adding one:

    @register_rule("my_rule")
    class MyRule:
        def __init__(self, cfg: PenaltyConfig) -> None: ...
        def decide(self, ev: Evidence) -> Decision: ...
        def state(self) -> tuple[dict, dict[str, Tensor]]: return {}, {}
        def load(self, meta: dict, tensors: dict[str, Tensor]) -> None: ...

A rule that wants count sketches of the gathered contributions in `extra["sketches"]` says how many buckets
with a `sketch_dim` attribute (the round reads it once; a rule that wraps another must pass it on).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from edit_train.local_sgd.penalty import Decision, PenaltyConfig, decide_with
from edit_train.local_sgd.penalty_stats import EWMAStats

__all__ = ["Evidence", "Decision", "Aggregator", "register_rule", "make_rule", "rule_names", "EditNormRule",
           "UniformRule", "spread"]


@dataclass(frozen=True)
class Evidence:
    """What a round gathered about every participant for one module (rows in quorum order)."""

    module: str
    names: tuple[str, ...]
    norms: Tensor  # float64 [P]: ‖Δᵢ‖ over the whole module
    steps: Tensor  # float64 [P]: local steps since the anchor
    contributes: tuple[bool, ...]  # False: no local step since its anchor (weight 0, not judged)
    extra: Mapping[str, Tensor] = field(default_factory=dict)  # room for more evidence (e.g. cosines)

    @property
    def contributors(self) -> list[int]:
        return [i for i, c in enumerate(self.contributes) if c]


@runtime_checkable
class Aggregator(Protocol):
    """An aggregation rule (module by module; the same answer on every participant)."""

    def decide(self, ev: Evidence) -> Decision: ...

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]: ...

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None: ...


_RULES: dict[str, Callable[[PenaltyConfig], Aggregator]] = {}
# built-in rules in modules of their own, by import path (resolved on first use, like a user's rule)
_BUILTIN = {"verified": "edit_train.local_sgd.verified:VerifiedRule"}


def register_rule(name: str) -> Callable[[type], type]:
    """Class decorator: make a rule selectable as `algo.penalty.rule=<name>`."""
    def add(cls: type) -> type:
        _RULES[name] = cls
        return cls
    return add


def rule_names() -> list[str]:
    return sorted({*_RULES, *_BUILTIN})


def make_rule(cfg: PenaltyConfig) -> Aggregator:
    """The rule `cfg.rule` names (a registered name or "module:attr"), built from `cfg`."""
    spec = _BUILTIN.get(cfg.rule, cfg.rule)
    if spec in _RULES:
        return _RULES[spec](cfg)
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"algo.penalty.rule: unknown rule {spec!r}; choose one of {rule_names()} or name your own "
                         "class as 'package.module:Class'")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"algo.penalty.rule: cannot load {spec!r} ({exc}); is its module on PYTHONPATH?") from None
    rule = factory(cfg)
    if not isinstance(rule, Aggregator):
        raise ValueError(f"algo.penalty.rule: {spec!r} does not build a rule (needs decide, state and load)")
    return rule


def spread(d: Decision, idx: list[int], n: int, norms: Tensor) -> Decision:
    """A decision over the contributors `idx` spread to all `n` participants (the others: weight 0, not
    anomalous, no score)."""
    def full(values: list[Any], default: Any) -> list[Any]:
        out = [default] * n
        for j, i in enumerate(idx):
            out[i] = values[j]
        return out
    return Decision(module=d.module, norms=norms.tolist(), weights=full(d.weights, 0.0),
                    anomalous=full(d.anomalous, False), z=full(d.z, 0.0) if d.z else [0.0] * n,
                    all_anomalous=d.all_anomalous, threshold=full(d.threshold, math.inf) if d.threshold else [])


def nobody(ev: Evidence) -> Decision:
    """No participant contributes: no outer step for this module."""
    n = len(ev.names)
    return Decision(module=ev.module, norms=ev.norms.tolist(), weights=[0.0] * n, anomalous=[False] * n,
                    z=[0.0] * n, all_anomalous=True, threshold=[math.inf] * n)


@register_rule("uniform")
class UniformRule:
    """Every contributor weighs the same (DiLoCo, post-local SGD); a non-finite norm gets weight 0."""

    def __init__(self, cfg: PenaltyConfig) -> None:
        self.cfg = cfg

    def decide(self, ev: Evidence) -> Decision:
        ok = [c and math.isfinite(float(g)) for c, g in zip(ev.contributes, ev.norms.tolist())]
        n_ok = sum(ok)
        w = [1.0 / n_ok if o else 0.0 for o in ok] if n_ok else [0.0] * len(ok)
        bad = [c and not o for c, o in zip(ev.contributes, ok)]
        return Decision(module=ev.module, norms=ev.norms.tolist(), weights=w, anomalous=bad,
                        z=[0.0] * len(ok), all_anomalous=n_ok == 0, threshold=[math.inf] * len(ok))

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return {}, {}

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        return None


@register_rule("edit_norm")
class EditNormRule:
    """EDiT's rule (docs/sync_math.md): per-cluster EWMA of the per-step norm, a one-sided test, regime
    rescale and re-admission, softmax(−x/(T·m)) over the accepted clusters. Statistics are kept per cluster
    name (a roster slot each, in order of first appearance, the same on every cluster because a cluster
    that missed a quorum heals the roster before it takes part again)."""

    def __init__(self, cfg: PenaltyConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.roster: list[str] = []
        self.stats: dict[str, EWMAStats] = {}  # module -> one row per roster slot

    def _rows(self, module: str, names: list[str]) -> Tensor:
        new = [n for n in names if n not in self.roster]
        if new:
            self.roster.extend(new)
            for st in self.stats.values():
                st.grow(len(new))
        if module not in self.stats:
            self.stats[module] = EWMAStats(len(self.roster), self.cfg.ewma_alpha)
        return torch.tensor([self.roster.index(n) for n in names], dtype=torch.long)

    def decide(self, ev: Evidence) -> Decision:
        idx = ev.contributors
        if not idx:
            return nobody(ev)
        g = torch.as_tensor(ev.norms, dtype=torch.float64).reshape(-1)
        rows = self._rows(ev.module, [ev.names[i] for i in idx])
        full = self.stats[ev.module]
        sub = full.select(rows)
        d = decide_with(sub, ev.module, g[idx], torch.as_tensor(ev.steps, dtype=torch.float64)[idx], self.cfg)
        full.assign(rows, sub)
        return spread(d, idx, len(ev.names), g)

    # ------------------------------------------------------------- state
    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """{"roster": names}, {"<module>/<field>": [len(roster)] tensor}."""
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
        self.roster, self.stats = roster, stats
