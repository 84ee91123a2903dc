"""The ORACLE aggregation rule of `benchmarks/penalty_faults.py`: the default `verified` rule, except that one
named cluster is dropped (weight 0; its token share a zero update under the default `left_out=zero`) for a
known window of syncs — what a perfect detector would do. Comparing a faulty run with the oracle run
separates what the fault cost through the detector's mistakes from what the lost tokens cost.

Select it with `algo.rule.name=_oracle_rule:OracleRule` (`benchmarks/` on PYTHONPATH) and
`EDIT_TRAIN_ORACLE="<cluster>:<first sync>:<last sync>"` (1-based `sync` indices of the `sync` events,
inclusive) in the environment of every process of the run. Its parameters are the `verified` rule's
(`VerifiedConfig`), given as `algo.rule.options` (a rule of one's own sees nothing else of `algo.rule`):
a run that sets `algo.rule.verified.warmup_syncs=5` gives the oracle `+algo.rule.options.warmup_syncs=5`.

A rule is not told the sync index: it sees every module once per sync, so a sync starts when a module it has
already seen in the current sync comes again (an aborted sync would shift the count by one; the benchmark
checks the dropped syncs against the events). Inside the window the cluster is passed to the inner rule as
a non-contributor, so it is neither judged nor learned from (its statistics stay frozen, the reference
direction follows the others only) and the weights are then set as if it had been judged and left out; its
usefulness score is hidden at the sync after the window too (it scores the update of the window's last
sync, already dropped).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.aggregator import Decision, Evidence
from edit_train.local_sgd.aggregation.verified import VerifiedConfig, VerifiedRule, claimed_tokens, token_weights

ENV = "EDIT_TRAIN_ORACLE"


def parse_window(spec: str | None) -> tuple[str, int, int]:
    """"c1:8:19" -> ("c1", 8, 19)."""
    try:
        name, first, last = (spec or "").rsplit(":", 2)
        window = (name, int(first), int(last))
    except ValueError:
        raise ValueError(f"{ENV} must be '<cluster>:<first sync>:<last sync>', got {spec!r}") from None
    if not name or not 1 <= window[1] <= window[2]:
        raise ValueError(f"{ENV}: need a cluster name and 1 <= first <= last, got {spec!r}")
    return window


class OracleRule:
    Config = VerifiedConfig  # built from `algo.rule.options` (rules._with_options)
    needs = VerifiedRule.needs  # measured on what was sent, as the inner rule decides

    def __init__(self, cfg: VerifiedConfig) -> None:
        self.inner = VerifiedRule(cfg)
        self.cfg, self.sketch_dim = cfg, self.inner.sketch_dim  # the round reads the rule's sketch size
        self.cluster, self.first, self.last = parse_window(os.environ.get(ENV))
        self.sync = 0  # 1-based index of the sync being decided
        self._seen: set[str] | None = None  # modules decided in this sync (None: the next one starts one)

    def _count(self, module: str) -> None:
        if self._seen is None or module in self._seen:
            self.sync += 1
            self._seen = set()
        self._seen.add(module)

    def decide(self, ev: Evidence) -> Decision:
        self._count(ev.module)
        if self.cluster not in ev.names or not self.first <= self.sync <= self.last + 1:
            return self.inner.decide(ev)
        me = ev.names.index(self.cluster)
        extra = dict(ev.extra)
        if "probe" in extra:  # its usefulness score is about a window update: not evidence
            probe = torch.as_tensor(extra["probe"], dtype=torch.float64).clone()
            probe[me] = math.nan
            extra["probe"] = probe
        if self.sync > self.last:
            return self.inner.decide(dataclasses.replace(ev, extra=extra))
        drop = ev.contributes[me]
        contributes = tuple(c and i != me for i, c in enumerate(ev.contributes))
        d = self.inner.decide(dataclasses.replace(ev, contributes=contributes, extra=extra))
        if drop:
            d.weights[me], d.left_out[me] = 0.0, True
            d.weights = self._backed(ev, d.weights)
            if d.evidence:
                d.evidence[me] = {"measured_norm": float(ev.norms[me]), "reasons": ["oracle"]}
        return d

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        meta, tensors = self.inner.state()
        return {**meta, "oracle_sync": self.sync}, tensors

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        self.inner.load(meta, tensors)
        self.sync, self._seen = int(meta.get("oracle_sync", self.sync)), None

    def _backed(self, ev: Evidence, weights: list[float]) -> list[float]:
        """The weights as the inner rule would set them with the dropped cluster judged and left out: its token
        share is a zero update under `left_out=zero` (the others' weights are renormalised without it above)."""
        idx = ev.contributors
        accepted = torch.tensor([weights[i] > 0 for i in idx], dtype=torch.bool)
        out = torch.zeros(len(weights), dtype=torch.float64)
        out[idx] = token_weights(claimed_tokens(ev, idx), accepted, self.cfg.max_token_ratio, self.cfg.left_out)
        return out.tolist()
