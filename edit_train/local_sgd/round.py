"""One sync round — the only place the EDiT sync sequence exists — and the one re-base.

    exchange   each rank sums ‖Δ‖² per unit over its cluster; the leaders all-gather one small vector
               ([‖Δ‖² per unit ‖ local steps, s/step, total steps, stop vote]) across the quorum
    decide     the aggregation rule (`rules.py`) weighs every participant, module by module
    launch     w·Δ of a unit goes into the transport's SUM reduction (asynchronously)
    land       wait for a unit's reduced Δ; a non-finite one can never be applied (the round votes no)
    apply      clip → outer step → re-base the live parameters on the new anchor
    commit     every participant votes; a "no" or a lost participant rolls every applied unit back

How and when units are launched, landed and applied is the drivers' business (`drivers.py`): layer-wise
inside the next forward pass, all at once (at_end), or in the background while training goes on (overlap).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from edit_train.local_sgd.outer import OuterState
from edit_train.local_sgd.penalty import Decision, anomaly_details, clip_factor, weighted
from edit_train.local_sgd.protocols import Handle, Transport
from edit_train.local_sgd.rules import Aggregator, Evidence

log = logging.getLogger(__name__)

T = TypeVar("T")
EXTRA = ("local_steps", "secs_per_step", "total_steps", "stop_vote")  # per-cluster scalars of the exchange


@dataclass
class Unit:
    """A synchronization unit (= an FSDP unit): a module and the parameters it owns."""

    name: str
    module: nn.Module
    params: list[nn.Parameter]

    def live(self) -> list[Tensor]:
        """The rank-local shards of the parameters (fresh views: FSDP may re-point them)."""
        return [p.data.to_local() if hasattr(p.data, "to_local") else p.data for p in self.params]


def build_units(model: nn.Module, unit_modules: list[nn.Module]) -> list[Unit]:
    """Units in forward order: the root (what no sub-unit owns) first, then `unit_modules` in order."""
    names = {id(m): n for n, m in model.named_modules()}
    owned: set[int] = set()
    subs = []
    for m in unit_modules:
        params = [p for p in m.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        subs.append(Unit(names[id(m)], m, params))
    root_params = [p for p in model.parameters() if id(p) not in owned]
    units = [Unit("root", model, root_params)] if root_params else []
    return units + [u for u in subs if u.params]


@torch.no_grad()
def rebase(live: list[Tensor], anchor: list[Tensor], base: list[Tensor] | None = None) -> None:
    """θ ← θ̄ + (θ − base): a cluster keeps the progress it made since `base` (its snapshot when an overlapped
    sync started, or its old anchor when it heals); `base=None` is plain θ ← θ̄. One rule for non-finite
    progress: a unit whose (θ − base) is non-finite anywhere lands on θ̄."""
    if base is not None:
        for p, b in zip(live, base):
            p.sub_(b.to(p.device, p.dtype))  # (θ − base) first: exact when there was no progress
        if all(bool(torch.isfinite(p).all()) for p in live):
            for p, a in zip(live, anchor):
                p.add_(a.to(p.device, p.dtype))
            return
    for p, a in zip(live, anchor):
        p.copy_(a.to(p.device, p.dtype), non_blocking=True)


@dataclass
class SyncCore:
    """What every round of one cluster works with."""

    units: list[Unit]
    outer: OuterState
    rule: Aggregator
    transport: Transport
    clip: float | None  # φ (None: no clipping)
    span: Callable[[str], AbstractContextManager[Any]] = lambda _name: nullcontext()

    def __post_init__(self) -> None:
        self.index = {u.name: i for i, u in enumerate(self.units)}

    def unit(self, name: str) -> Unit:
        return self.units[self.index[name]]


@dataclass
class SyncReport:
    """What one sync did on this rank (the `sync` event is made from it)."""

    sync: int
    local_steps: int
    participants: list[str]
    position: int  # this cluster's row in the decisions
    decisions: dict[str, Decision] = field(default_factory=dict)
    clip: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    blocked_s: float = 0.0
    cluster_norm: float = 0.0  # this cluster's whole-model ‖Δ‖
    nonfinite: list[str] = field(default_factory=list)  # units whose reduced Δ was non-finite


class SyncRound:
    """One sync of one cluster: exchange → decide → (launch → land → apply) per unit → commit/roll back.

    `eager=True` applies each unit as soon as it lands and keeps an undo record until the vote (layer-wise:
    the next forward needs θ̄_new); `eager=False` applies nothing before the vote passed, re-basing on the
    snapshot taken at `exchange` (overlap: local steps go on meanwhile)."""

    def __init__(self, core: SyncCore, sync: int, local_steps: int, eager: bool) -> None:
        q = core.transport.quorum
        assert q is not None, "a round needs an issued quorum"
        self.core, self.eager, self.shared = core, eager, q.shared
        self.report = SyncReport(sync, local_steps, q.names, q.me)
        self.todo = [u.name for u in core.units]  # in unit order
        self.snap: dict[str, list[Tensor]] = {}
        self.inflight: dict[str, tuple[Handle[None], list[Tensor]]] = {}
        self.landed: dict[str, list[Tensor]] = {}
        self.undo: dict[str, Any] = {}
        self.ok = True  # False once something makes this cluster vote no

    def _wait(self, handle: Handle[T]) -> T:
        try:
            return handle.wait()
        finally:
            self.report.blocked_s += handle.blocked_s

    def _counted(self, fn: Callable[[], T]) -> T:
        before = self.core.transport.bytes_sent
        out = fn()
        self.report.bytes += self.core.transport.bytes_sent - before
        return out

    # ------------------------------------------------------------------ exchange + decide
    @torch.no_grad()
    def exchange(self, extra: list[float]) -> Handle[Tensor]:
        """Start the norm exchange (asynchronous); `extra` rides along (EXTRA, in that order)."""
        c, outer = self.core, self.core.outer
        sq = torch.zeros(len(c.units), dtype=torch.float64, device=c.transport.cluster.device)
        for i, unit in enumerate(c.units):
            live = unit.live()
            outer.params[unit.name] = live
            if not self.eager:
                self.snap[unit.name] = [t.detach().clone() for t in live]
            sq[i] = sum(float(d.double().pow(2).sum()) for d in outer.pseudo_grad(unit.name))
        c.transport.cluster.sum_(sq)
        vec = torch.cat([sq, torch.tensor(extra, dtype=torch.float64, device=sq.device)])
        return self._counted(lambda: c.transport.all_gather(vec, "norm exchange"))

    def gathered(self, handle: Handle[Tensor]) -> Tensor:
        """Wait for the exchange; decide every module. Returns the EXTRA columns [participants, 4]."""
        rows = self._wait(handle).cpu()
        n = len(self.core.units)
        norms = rows[:, :n].clamp_min(0).sqrt()
        steps = rows[:, n]
        names = tuple(self.report.participants)
        contributes = tuple(bool(s > 0) for s in steps.tolist())
        for i, unit in enumerate(self.core.units):
            ev = Evidence(unit.name, names, norms[:, i].clone(), steps.clone(), contributes)
            self.report.decisions[unit.name] = self.core.rule.decide(ev)
        self.report.cluster_norm = float(norms[self.report.position].pow(2).sum().sqrt())
        return rows[:, n:]

    # ------------------------------------------------------------------ per unit
    def _delta(self, name: str) -> list[Tensor]:
        outer = self.core.outer
        if name in self.snap:
            return [a.to(s.device) - s.to(a.dtype) for a, s in zip(outer.anchors[name], self.snap[name])]
        return outer.pseudo_grad(name)

    @torch.no_grad()
    def launch(self, name: str) -> None:
        """Start the reduction of w·Δ of unit `name` (once)."""
        if name in self.inflight or name in self.landed or name not in self.todo:
            return
        c = self.core
        unit = c.unit(name)
        c.outer.params[name] = unit.live()
        c.outer.prefetch(name)
        w = self.report.decisions[name].weights[self.report.position]
        delta = weighted(self._delta(name), float(w))
        handle = self._counted(lambda: c.transport.reduce_(delta, unit.params, name))
        self.inflight[name] = (handle, delta)

    def ready(self, name: str) -> bool:
        return name in self.landed or (name in self.inflight and self.inflight[name][0].ready())

    @torch.no_grad()
    def land(self, name: str) -> None:
        """Wait for unit `name`'s reduced Δ (raises FederationError when a participant was lost)."""
        self.launch(name)
        handle, delta = self.inflight.pop(name)
        self._wait(handle)
        if not all(bool(torch.isfinite(d).all()) for d in delta):
            self.report.nonfinite.append(name)
            self.ok = False
        self.landed[name] = delta

    @torch.no_grad()
    def apply(self, name: str) -> None:
        """Clip → outer step → re-base the live parameters of unit `name` (the one place this happens)."""
        c, report = self.core, self.report
        delta = self.landed.pop(name)
        live = c.unit(name).live()
        c.outer.params[name] = live
        if self.eager and self.shared:
            self.undo[name] = c.outer.snapshot(name)
        decision = report.decisions[name]
        if decision.all_anomalous or name in report.nonfinite:
            report.clip[name] = 0.0  # no outer step; every cluster lands on the anchor it had
        else:
            sq = torch.tensor([sum(float(d.double().pow(2).sum()) for d in delta)], dtype=torch.float64,
                              device=c.transport.cluster.device)
            coef = clip_factor(float(c.transport.cluster.sum_(sq)), c.clip)
            c.outer.step(name, [d * coef for d in delta] if coef != 1.0 else delta)
            report.clip[name] = coef
        rebase(live, c.outer.anchors[name], self.snap.pop(name, None))
        c.outer.release(name)
        self.todo.remove(name)

    # ------------------------------------------------------------------ commit
    def vote(self) -> Handle[bool] | None:
        """This cluster's vote (None when alone: nothing to agree on)."""
        if not self.shared:
            return None
        return self._counted(lambda: self.core.transport.vote(self.ok))

    def voted(self, handle: Handle[bool] | None) -> bool:
        return (self._wait(handle) if handle is not None else True) and self.ok

    @torch.no_grad()
    def rollback(self) -> None:
        """Undo every applied unit (anchor, outer state, live parameters); forget what is in flight."""
        for name, snap in self.undo.items():
            self.core.outer.restore(name, snap)
        self.undo.clear()
        self.inflight.clear()
        self.landed.clear()
        self.snap.clear()
        self.todo.clear()
        self.core.transport.abort()


def summarize(report: SyncReport) -> dict[str, Any]:
    """The `sync` event fields for this cluster (docs/architecture.md §5)."""
    me = report.position
    decisions = list(report.decisions.values())
    weights = [d.weights[me] for d in decisions]
    anomalous = [d.module for d in decisions if d.anomalous[me]]
    clips = [c for c in report.clip.values() if c > 0] or [0.0]
    return {
        "sync": report.sync,
        "local_steps": report.local_steps,
        "pseudo_grad_norm": report.cluster_norm if math.isfinite(report.cluster_norm) else None,
        "weight": sum(weights) / max(len(weights), 1),
        "anomalous": bool(anomalous),
        "anomalous_modules": anomalous,
        "anomaly_details": anomaly_details(report.decisions, me),  # {module: {z, threshold}} of flagged ones
        "clip_coef": min(clips),
        "bytes": report.bytes,
        "blocked_s": report.blocked_s,
        "participants": list(report.participants),
    }
