"""A coordinate-wise median written outside the package: it needs every contribution and merges them itself
(tests select it with `algo.rule.name=median_rule:CoordinateMedian`, this folder on PYTHONPATH)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.aggregator import Decision, Evidence, Needs


class CoordinateMedian:
    """Every element of the merged Δ is the median of the finite contributions' elements (the mean of the two
    middle ones for an even count); a non-finite contribution is left out. The weights are nominal (1/n each):
    the median is not a weighted sum."""

    needs = Needs.CONTRIBUTIONS

    def __init__(self, options: dict[str, Any]) -> None:
        self.calls = 0

    def decide(self, ev: Evidence) -> Decision:
        finite = ev.extra["finite"].tolist() if "finite" in ev.extra else [math.isfinite(float(g)) for g in ev.norms]
        used = [c and f for c, f in zip(ev.contributes, finite)]
        n = sum(used)
        weights = [1.0 / n if u else 0.0 for u in used] if n else [0.0] * len(used)
        left_out = [c and not f for c, f in zip(ev.contributes, finite)]
        return Decision(ev.module, ev.norms.tolist(), weights, left_out, skip=n == 0)

    def combine(self, ev: Evidence, decision: Decision, parts: list[list[Tensor]]) -> list[Tensor]:
        self.calls += 1
        used = [i for i, w in enumerate(decision.weights) if w > 0]
        out = []
        for k in range(len(parts[0])):
            stacked = torch.stack([parts[i][k].float() for i in used]).sort(dim=0).values
            lo, hi = (len(used) - 1) // 2, len(used) // 2
            out.append((stacked[lo] + stacked[hi]) / 2)
        return out

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return {"calls": self.calls}, {}

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        self.calls = int(meta.get("calls", 0))
