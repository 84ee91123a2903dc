"""An aggregation rule defined outside the package (tests select it with
`algo.rule.name=custom_rule:FirstClusterOnly`, this folder on PYTHONPATH)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from edit_train.local_sgd.aggregator import Decision, Evidence


class FirstClusterOnly:
    """All the weight to the first cluster (by name) that contributes; the others are left out."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.calls = 0

    def decide(self, ev: Evidence) -> Decision:
        self.calls += 1
        first = ev.contributors[0] if ev.contributors else -1
        n = len(ev.names)
        w = [1.0 if i == first else 0.0 for i in range(n)]
        return Decision(ev.module, ev.norms.tolist(), w, [False] * n, skip=first < 0)

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return {"calls": self.calls}, {}

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        self.calls = int(meta.get("calls", 0))


class WithConfig(FirstClusterOnly):
    """The same rule with parameters of its own (`algo.rule.options.favourite=...`)."""

    @dataclass
    class Config:
        favourite: int = 0

    def __init__(self, cfg: WithConfig.Config) -> None:
        super().__init__({})
        self.favourite = cfg.favourite
