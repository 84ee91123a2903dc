"""A fixed set of n clusters, named c0..c{n-1}, that all contribute to every sync and decide with the `edit_norm`
rule from a vector of norms (the pure-math tests of EDiT's penalty), and the round's merge in one process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.aggregator import Decision, Evidence
from edit_train.local_sgd.penalty import clip_factor, weighted
from edit_train.local_sgd.penalty_stats import EWMAStats
from edit_train.local_sgd.aggregation.rules import EditNormConfig, EditNormRule


class FixedSet:
    """`EditNormRule` over the clusters c0..c{n-1}, every one contributing."""

    def __init__(self, cfg: EditNormConfig, n: int) -> None:
        if n < 1:
            raise ValueError(f"a fixed set needs at least one cluster, got {n}")
        self.rule = EditNormRule(cfg)
        self.names = tuple(f"c{i}" for i in range(n))

    @property
    def num_clusters(self) -> int:
        return len(self.names)

    @property
    def stats(self) -> dict[str, EWMAStats]:
        """The rule's statistics per module, one row per cluster (c0..c{n-1} in order once all have decided)."""
        return self.rule.stats

    def decide(self, module: str, norms: Tensor | Sequence[float],
               steps: Tensor | Sequence[float] | None = None) -> Decision:
        """The rule's decision on `norms` (one per cluster); `steps=None`: one local step each, so the test sees
        the norms themselves (a step-share blend, `step_weight_ratio` > 0, then gives every cluster the same
        share)."""
        g = torch.as_tensor(norms, dtype=torch.float64).detach().cpu().reshape(-1)
        if g.numel() != self.num_clusters:
            raise ValueError(f"decide({module!r}): expected {self.num_clusters} norms, got {g.numel()}")
        s = torch.ones_like(g) if steps is None else \
            torch.as_tensor(steps, dtype=torch.float64).detach().cpu().reshape(-1)
        return self.rule.decide(Evidence(module, self.names, g, s, (True,) * self.num_clusters))

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return self.rule.state()

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        self.rule.load(meta, tensors)


def merge(deltas: Sequence[Sequence[Tensor]], w: Sequence[float], phi: float | None) -> tuple[list[Tensor], float]:
    """`Σ wᵢΔᵢ` (a weight 0 ignores its Δ, non-finite or not), then clipped to norm φ (`None`: no clip) as the
    round clips a module; `deltas[i]` is cluster i's list of tensors. Returns the merged Δ and the clip factor."""
    if len(w) != len(deltas) or not deltas:
        raise ValueError(f"merge: {len(deltas)} clusters' deltas but {len(w)} weights")
    parts = [weighted(d, float(wi)) for wi, d in zip(w, deltas)]
    out = [sum(ts[1:], ts[0]) for ts in zip(*parts)]
    coef = clip_factor(sum(float(t.double().pow(2).sum()) for t in out), phi)
    return ([t * coef for t in out] if coef != 1.0 else out), coef
