"""A rule defined outside the package that asks for the usefulness probe and its retraction through the seam's
`capabilities()` (tests select it with `algo.rule.name=probing_rule:ProbingMean`, this folder on PYTHONPATH):
nothing inside edit_train/ names it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from edit_train.local_sgd.aggregator import Capabilities, Decision, Evidence, Needs


class ProbingMean:
    """Every finite contribution weighs the same (1/n); the usefulness probe on `probe_tokens` tokens and, with
    `retract`, an admitted update the probe then shows harmful taken back one sync late."""

    needs = Needs.MEASUREMENTS

    @dataclass
    class Config:
        probe_tokens: int = 8
        retract: bool = True

    def __init__(self, cfg: ProbingMean.Config) -> None:
        self.cfg = cfg

    def capabilities(self) -> Capabilities:
        return Capabilities(probe_tokens=self.cfg.probe_tokens, probe_tolerance=0.1, retract=self.cfg.retract)

    def decide(self, ev: Evidence) -> Decision:
        finite = ev.extra["finite"].tolist() if "finite" in ev.extra else [math.isfinite(float(g)) for g in ev.norms]
        used = [c and bool(f) for c, f in zip(ev.contributes, finite)]
        n = sum(used)
        weights = [1.0 / n if u else 0.0 for u in used] if n else [0.0] * len(used)
        return Decision(ev.module, ev.norms.tolist(), weights, [c and not f for c, f in zip(ev.contributes, finite)],
                        skip=n == 0)

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        return {}, {}

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        pass
