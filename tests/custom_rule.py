"""An aggregation rule defined outside the package (tests select it with
`algo.penalty.rule=custom_rule:FirstClusterOnly`, this folder on PYTHONPATH)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from edit_train.local_sgd.penalty import Decision, PenaltyConfig
from edit_train.local_sgd.rules import Evidence


class FirstClusterOnly:
    """All the weight to the first cluster (by name) that contributes; the others are left out."""

    def __init__(self, cfg: PenaltyConfig) -> None:
        self.calls = 0

    def decide(self, ev: Evidence) -> Decision:
        self.calls += 1
        first = ev.contributors[0] if ev.contributors else -1
        n = len(ev.names)
        w = [1.0 if i == first else 0.0 for i in range(n)]
        return Decision(module=ev.module, norms=ev.norms.tolist(), weights=w, anomalous=[False] * n, z=[0.0] * n,
                        all_anomalous=first < 0, threshold=[])

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return {"calls": self.calls}, {}

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        self.calls = int(meta.get("calls", 0))
