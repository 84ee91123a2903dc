"""Taking back an update the probe showed to be harmful, one sync late.

The usefulness probe (`probe.py`) can only score an update after it was applied: in the layer-wise mode each
unit's merged Δ is applied inside the next forward, before the whole model's contribution exists to be
evaluated. So a cluster whose update passed every size and direction test at sync t, and is then shown by the
others' probes to have hurt (median relative probe-loss change above `probe_tolerance`), has already moved
the anchor. At sync t+1 every cluster takes that part back: the outer step of unit u at t+1 uses

    Δᵤ(t+1) = clip(Σⱼ wⱼ Δⱼ(t+1)) − Σ_{i harmful} cᵤ(t) · wᵢᵤ(t) · Δᵢᵤ(t)

— the term cluster i added at t (clip coefficient c, weight w, contribution Δ exactly as gathered), with the
opposite sign. With outer SGD without momentum the anchor lands where it would have been had i weighed 0 at
t; with momentum the two terms cancel in the momentum buffer over the following steps (the sum of the
parameter updates a pseudo-gradient causes is linear in it).

Only a gathered round (every cluster holds every contribution) can do this, and every cluster must
hold the same record: each one sends the identity of the round it last committed (`marker`, from the
quorum's nonce) in the exchange, and a retraction happens only where every cluster names the same round.
A cluster that missed it, restarted or healed since names another round (or none): nothing is taken back
then, on any cluster. Cost: the last round's kept contributions stay in memory until the next round (the
probe holds them anyway until it has scored them); `algo.rule.verified.retract=false` turns it off.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

NONE = -1.0  # the marker of "no round recorded"


def marker_of(nonce: str) -> float:
    """A round's identity as an exact float64 (52 bits of the quorum nonce's digest): the nonce is unique per
    issued quorum, and one quorum runs one round."""
    return float(int.from_bytes(hashlib.sha256(nonce.encode()).digest()[:8], "big") >> 12)


@dataclass
class Applied:
    """What one gathered round applied, per unit: each cluster's contribution (None where it weighed 0),
    the weights and the clip coefficient (0: no outer step)."""

    sync: int
    marker: float
    names: list[str]
    units: dict[str, tuple[list[list[Tensor] | None], list[float], float]] = field(default_factory=dict)

    def add(self, unit: str, parts: list[list[Tensor]], weights: list[float]) -> None:
        kept: list[list[Tensor] | None] = [p if w != 0.0 else None for p, w in zip(parts, weights)]
        self.units[unit] = (kept, list(weights), 0.0)

    def clipped(self, unit: str, coef: float) -> None:
        if unit in self.units:
            kept, weights, _ = self.units[unit]
            self.units[unit] = (kept, weights, coef)

    def weighed(self, name: str) -> bool:
        """Did cluster `name` move the anchor in any unit?"""
        i = self.names.index(name)
        return any(w[i] != 0.0 and c != 0.0 for _, w, c in self.units.values())


class Retraction:
    """The last committed gathered round of this cluster, and which of its contributions to take back."""

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance
        self.last: Applied | None = None

    @property
    def marker(self) -> float:
        return self.last.marker if self.last is not None else NONE

    def committed(self, applied: Applied | None) -> None:
        """A round committed: it is the one a later verdict refers to (None: it kept nothing to take back)."""
        self.last = applied

    def plan(self, names: list[str], markers: Tensor, probe: Tensor) -> dict[str, float]:
        """Who to take back this round: clusters of the recorded round that are in this quorum too, moved
        the anchor then, and whose update the others' probes now judge harmful (`probe`: median per member of
        `names`). Empty unless every member recorded the same round. {name: its probe score}."""
        last = self.last
        if last is None or markers.numel() != len(names) or not bool((markers == last.marker).all()):
            return {}
        out = {}
        for j, name in enumerate(names):
            p = float(probe[j])
            if name in last.names and math.isfinite(p) and p > self.tolerance and last.weighed(name):
                out[name] = p
        return out

    def described(self, who: dict[str, float]) -> dict[str, dict[str, Any]]:
        """What the `sync` event says of a plan: {cluster: {"sync": the recorded round, "probe": its score}}."""
        return {name: {"sync": self.last.sync, "probe": p} for name, p in who.items()} if self.last else {}

    def term(self, unit: str, who: dict[str, float]) -> list[Tensor] | None:
        """Σ over `who` of c·w·Δ for `unit` (in the recorded round's cluster order: the same sum on every
        cluster), or None when nothing of it is taken back."""
        last = self.last
        if last is None or not who or unit not in last.units:
            return None
        kept, weights, coef = last.units[unit]
        total: list[Tensor] | None = None
        for name, parts, w in zip(last.names, kept, weights):
            if name not in who or parts is None or coef == 0.0:
                continue
            if total is None:
                total = [torch.zeros_like(p, dtype=torch.float32) for p in parts]
            for t, p in zip(total, parts):
                t.add_(p.to(t.dtype), alpha=coef * w)
        return total


class Taking:
    """One round's side of the retraction (the round's one hook for it): the marker it sends, who it takes back
    (a gathered round: `plan`), the term it subtracts per unit, and — a gathered round of a rule that does not
    combine by itself — what it applies, for a later verdict. Without a `Retraction` it does nothing."""

    def __init__(self, retraction: Retraction | None, applied: Applied | None) -> None:
        self.retraction = retraction
        self.applied = applied if retraction is not None else None
        self.who: dict[str, float] = {}

    @property
    def marker(self) -> float:
        """The round this cluster last committed (NONE: none recorded)."""
        return self.retraction.marker if self.retraction is not None else NONE

    @property
    def recording(self) -> bool:
        return self.applied is not None

    def plan(self, names: list[str], markers: Tensor, probe: Tensor) -> dict[str, dict[str, Any]]:
        """Who this round takes back (`Retraction.plan`), as the `sync` event says it."""
        if self.retraction is None:
            return {}
        self.who = self.retraction.plan(names, markers, probe)
        return self.retraction.described(self.who)

    def add(self, unit: str, parts: list[list[Tensor]], weights: list[float]) -> None:
        if self.applied is not None:
            self.applied.add(unit, parts, weights)

    def clipped(self, unit: str, coef: float) -> None:
        if self.applied is not None:
            self.applied.clipped(unit, coef)

    def term(self, unit: str) -> list[Tensor] | None:
        """What unit `unit`'s outer step takes back (None: nothing)."""
        return self.retraction.term(unit, self.who) if self.retraction is not None else None

    def committed(self) -> None:
        if self.retraction is not None:
            self.retraction.committed(self.applied)
