"""A rule that needs only a SUM and weighs experts by routed tokens (`algo.rule.name=expert_sum_rule:TokenSum`):
every contributor 1/n of the module, each expert's rows by the tokens it routed to that expert. It records the
routed tokens it was shown, per decision (tests/local_sgd/test_expert_sync.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.aggregator import Decision, Evidence, Needs
from edit_train.local_sgd.moe.experts import expert_weights
from edit_train.local_sgd.aggregation.rules import UniformRule


class TokenSum(UniformRule):
    needs = Needs.SUM

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.seen: list[Tensor] = []

    def decide(self, ev: Evidence) -> Decision:
        d = UniformRule.decide(self, ev)
        if "expert_tokens" in ev.extra:
            counts = ev.extra["expert_tokens"]
            self.seen.append(counts.clone())
            ok = torch.tensor([w > 0 for w in d.weights], dtype=torch.float64)
            d.expert_weights = expert_weights(counts, ev.extra["expert_sent"], ok, torch.zeros_like(ok)).tolist()
        return d
