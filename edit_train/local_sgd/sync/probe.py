"""Usefulness of every cluster's update, measured by this cluster on its own probe slice of validation
data: the relative change of the probe loss from θ̄ to θ̄ − Δᵢ (cluster i's model as it sent it),
(L(θ̄ − Δᵢ) − L(θ̄)) / L(θ̄). A helpful update lowers it. The scores ride along with this cluster's next exchange; each cluster is then judged on the
lower median of the scores at least two *other* clusters gave it (`evidence.probe_judgement`), so nobody
vouches for itself and no evaluator decides alone. `compare()` probes a received heal anchor the same way.

A round keeps, per unit, the old anchor and the gathered contributions (`keep`); once it committed, the
trainer's step boundary runs `score()` (the model's own forward: every rank of the cluster together). Cost:
one forward per *other* cluster plus one of the anchor on `algo.rule.verified.probe_tokens` tokens per sync (the
`probe` time bucket), and the contributions held until then.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.protocols import Contributions
from edit_train.local_sgd.sync.round import Unit

log = logging.getLogger(__name__)


class Probe:
    def __init__(self, units: list[Unit], loss: Callable[[], float] | None,
                 span: Callable[[str], AbstractContextManager[Any]] = lambda _n: nullcontext(), me: str = "") -> None:
        self.units, self.loss, self.span, self.me = units, loss, span, me
        self.kept: dict[str, tuple[list[Tensor], Contributions]] = {}
        self.names: list[str] = []  # clusters of the committed round waiting to be scored
        self.scores: dict[str, float] = {}  # name -> relative loss change its last update caused here

    @property
    def enabled(self) -> bool:
        return self.loss is not None

    def keep(self, unit: str, old_anchor: list[Tensor], got: Contributions) -> None:
        if self.enabled:
            self.kept[unit] = (old_anchor, got)

    def committed(self, names: list[str]) -> None:
        """The round these contributions came from committed: score them at the next step boundary."""
        for n in names:  # a score rides along only for the round it was measured on (retract.py trusts that)
            self.scores.pop(n, None)
        self.names = list(names) if len(self.kept) == len(self.units) else []
        if not self.names:
            self.kept.clear()

    def dropped(self) -> None:
        self.kept.clear()
        self.names = []

    def row(self, names: list[str]) -> list[float]:
        """This cluster's scores for the members of a quorum (NaN: not measured here)."""
        return [self.scores.get(n, float("nan")) for n in names]

    @torch.no_grad()
    def score(self) -> None:
        """Evaluate every kept cluster's update (restores the live parameters afterwards)."""
        if not self.names or self.loss is None:
            return
        with self.span("probe"):
            backup = {u.name: [t.detach().clone() for t in u.live()] for u in self.units}
            try:
                self._set(lambda name, old, parts: old)
                base = self.loss()
                for i, who in enumerate(self.names):
                    if who == self.me:  # nobody vouches for itself: its own score would never be read
                        continue
                    self._set(lambda name, old, parts, i=i:  # received parts may sit on another device
                              [a - p.to(a.device, a.dtype) for a, p in zip(old, parts.parts[i])])
                    self.scores[who] = (self.loss() - base) / max(abs(base), 1e-12)
                log.debug("probe: base %.4f, loss change %s", base,
                          {n: round(self.scores[n], 4) for n in self.names if n in self.scores})
            finally:
                for u in self.units:
                    for t, b in zip(u.live(), backup[u.name]):
                        t.copy_(b)
                self.dropped()

    @torch.no_grad()
    def compare(self, own: dict[str, list[Tensor]], theirs: dict[str, list[Tensor]], tolerance: float) -> str | None:
        """A received anchor (`theirs`, per unit) against this cluster's own on the probe slice: why it is worse
        (its loss more than `tolerance` above the own anchor's, relatively), or None. Restores the live
        parameters afterwards."""
        if self.loss is None:
            return None
        backup = {u.name: [t.detach().clone() for t in u.live()] for u in self.units}
        try:
            losses = []
            for anchor in (own, theirs):
                for u in self.units:
                    for t, v in zip(u.live(), anchor[u.name]):
                        t.copy_(v.to(t.device, t.dtype))
                losses.append(self.loss())
        finally:
            for u in self.units:
                for t, b in zip(u.live(), backup[u.name]):
                    t.copy_(b)
        mine, got = losses
        change = (got - mine) / max(abs(mine), 1e-12)
        if not math.isfinite(got) or change > tolerance:
            return f"its anchor's loss on this cluster's probe data is {change:+.0%} of its own ({got:.4g} vs {mine:.4g})"
        return None

    def _set(self, value: Callable[[str, list[Tensor], Contributions], list[Tensor]]) -> None:
        for u in self.units:
            old, got = self.kept[u.name]
            for t, v in zip(u.live(), value(u.name, old, got)):
                t.copy_(v.to(t.device, t.dtype))
