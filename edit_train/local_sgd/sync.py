"""The EDiT sync engine: layer-wise pseudo-gradient synchronization inside the next forward pass.

At a sync point the engine computes, per module, the squared norm of this rank's shard of
Δ = θ̄ − θ, sums it over the worker group, and exchanges one small vector across groups (the only
up-front cross-group traffic). Every rank then takes the same per-module decisions (anomalies, weights).
The heavy work — scaling Δ by this worker's weight, the cross-group SUM all-reduce, clipping, the outer
step and θ ← θ̄ — happens per module in a forward pre-hook registered *before* FSDP's own, so it runs on
the local shard before FSDP gathers it; the next module's reduction is launched asynchronously while
the current one computes (prefetch). `sync_all()` does the same for every module at once (`at_end`).

A sync commits on every participant or on none (torchft's should_commit): each module's outer step keeps
an undo record until the last module is done and every participant voted yes; a participant lost in the
middle (a reduction fails) rolls every applied module back and raises `SyncAborted`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from edit_train.cluster.collectives import shard_sum_
from edit_train.federation.comm import FederationComm
from edit_train.federation.link import FederationError, Pending
from edit_train.local_sgd.outer import OuterState
from edit_train.local_sgd.penalty import Decision, anomaly_details, clip_coef_from_sqnorm, weighted
from edit_train.local_sgd.roster import RosterAggregator

log = logging.getLogger(__name__)


class SyncAborted(RuntimeError):
    """A participant was lost mid-sync: every module was rolled back; the caller retries its step."""


@dataclass
class Unit:
    """A synchronization unit (= an FSDP unit): a module and the parameters it owns."""

    name: str
    module: nn.Module
    params: list[nn.Parameter]

    def live(self) -> list[Tensor]:
        """The rank-local shards of the parameters (fresh views: FSDP may re-point them)."""
        return [p.data.to_local() if hasattr(p.data, "to_local") else p.data for p in self.params]


@dataclass
class SyncReport:
    """What one sync did on this rank (the trainer turns it into a `sync` event)."""

    sync: int
    local_steps: int
    decisions: dict[str, Decision] = field(default_factory=dict)
    clip: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    blocked_s: float = 0.0
    group_norm: float = 0.0  # this group's whole-model ‖Δ‖
    participants: list[str] = field(default_factory=list)
    position: int = 0  # this cluster's row in the decisions


class SyncEngine:
    def __init__(self, units: list[Unit], outer: OuterState, aggregator: RosterAggregator,
                 comm: FederationComm, shard_pg: Any = None, shard_size: int = 1,
                 prefetch: bool = True) -> None:
        self.units = units
        self.index = {u.name: i for i, u in enumerate(units)}
        self.outer = outer
        self.aggregator = aggregator
        self.comm = comm
        self.shard_pg = shard_pg
        self.shard_size = shard_size
        self.prefetch = prefetch
        self.report: SyncReport | None = None  # the sync in progress
        self._todo: set[str] = set()
        self._inflight: dict[str, tuple[Pending, list[Tensor]]] = {}
        self._undo: dict[str, Any] = {}
        self._hooks: list[Any] = []
        self.on_complete: Callable[[SyncReport], None] | None = None
        self.on_abort: Callable[[SyncReport, str], None] | None = None
        # the caller's time account: the hooks' work inside the forward pass is charged to `sync`
        self.span: Callable[[str], AbstractContextManager] = lambda _name: nullcontext()

    # ----------------------------------------------------------------- hooks
    def install_hooks(self) -> None:
        """Register the per-unit forward pre-hooks (prepended: they run before FSDP's all-gather)."""
        for unit in self.units:
            def hook(_module: nn.Module, _args: Any, _name: str = unit.name) -> None:
                if _name in self._todo:
                    with self.span("sync"):
                        self._sync_unit(_name)
            self._hooks.append(unit.module.register_forward_pre_hook(hook, prepend=True))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @property
    def pending(self) -> bool:
        return bool(self._todo)

    # ------------------------------------------------------------ sync start
    @torch.no_grad()
    def begin(self, sync_index: int, local_steps: int, extra: list[float] | None = None) -> Tensor:
        """Start a sync: exchange norms (and `extra` per-group scalars), decide every module.

        Returns the gathered `extra` values as a [groups, len(extra)] tensor.
        """
        extra = list(extra or [])
        members = self.comm.members
        me = self.comm.position
        self.report = SyncReport(sync=sync_index, local_steps=local_steps, participants=[m.name for m in members],
                                 position=me)
        blocked0, bytes0 = self.comm.blocked_s, self.comm.bytes_sent
        sq = torch.zeros(len(self.units), dtype=torch.float64, device=self.comm.device)
        for i, unit in enumerate(self.units):
            self.outer.params[unit.name] = unit.live()
            sq[i] = sum(float(d.double().pow(2).sum()) for d in self.outer.pseudo_grad(unit.name))
        shard_sum_(sq, self.shard_pg, self.shard_size)
        vec = torch.cat([sq, torch.tensor(extra, dtype=torch.float64, device=sq.device)])
        try:
            gathered = self.comm.all_gather(vec).cpu()  # [participants, units + extra]
        except FederationError as exc:
            self._abort(str(exc), raise_=False)
            raise SyncAborted(str(exc)) from None
        self.decide_all(gathered, local_steps_col=0 if extra else None)
        self.report.blocked_s += self.comm.blocked_s - blocked0
        self.report.bytes += self.comm.bytes_sent - bytes0
        self._todo = {u.name for u in self.units}
        return gathered[:, len(self.units):]

    def decide_all(self, gathered: Tensor, local_steps_col: int | None) -> None:
        """Every module's decision from the gathered [participants, units + extra] rows."""
        assert self.report is not None
        n = len(self.units)
        norms = gathered[:, :n].clamp_min(0).sqrt()
        steps = gathered[:, n + local_steps_col] if local_steps_col is not None else None
        names = self.report.participants or [self.comm.name]
        contributes = [bool(steps[i] > 0) if steps is not None else True for i in range(len(names))]
        for i, unit in enumerate(self.units):
            self.report.decisions[unit.name] = self.aggregator.decide(unit.name, norms[:, i], names, contributes,
                                                                      steps)
        self.report.group_norm = float(norms[self.report.position].pow(2).sum().sqrt())

    # ------------------------------------------------------------ per module
    def _launch(self, name: str) -> None:
        """Scale this worker's Δ by its weight and start the cross-group SUM all-reduce."""
        if name in self._inflight or name not in self._todo:
            return
        assert self.report is not None
        self.outer.params[name] = self.units[self.index[name]].live()
        self.outer.prefetch(name)
        w = self.report.decisions[name].weights[self.report.position]
        delta = weighted(self.outer.pseudo_grad(name), float(w))
        bytes0 = self.comm.bytes_sent
        pending = self.comm.all_reduce_(delta, async_op=True, params=self.units[self.index[name]].params, key=name)
        self.report.bytes += self.comm.bytes_sent - bytes0
        self._inflight[name] = (pending, delta)

    @torch.no_grad()
    def _sync_unit(self, name: str) -> None:
        assert self.report is not None
        self._launch(name)
        if self.prefetch:
            nxt = self.index[name] + 1
            if nxt < len(self.units):
                self._launch(self.units[nxt].name)
        pending, delta = self._inflight.pop(name)
        try:
            self.report.blocked_s += pending.wait()
        except FederationError as exc:
            self._abort(str(exc))
        decision = self.report.decisions[name]
        if self.comm.active:
            self._undo[name] = self.outer.snapshot(name)
        if decision.all_anomalous:
            self.outer.skip(name)
            self.report.clip[name] = 0.0
        else:
            sq = torch.tensor([sum(float(d.double().pow(2).sum()) for d in delta)], dtype=torch.float64,
                              device=self.comm.device)
            coef = clip_coef_from_sqnorm(float(shard_sum_(sq, self.shard_pg, self.shard_size)), self.aggregator.cfg)
            if coef != 1.0:
                delta = [d * coef for d in delta]
            self.outer.step(name, delta)
            self.outer.reset(name)
            self.report.clip[name] = coef
        self.outer.release(name)
        self._todo.discard(name)
        if not self._todo:
            self._complete()

    def _complete(self) -> None:
        if self.comm.active and not self.comm.vote(True):
            self._abort("a participant did not commit")
        self._undo.clear()
        report, self.report = self.report, None
        if report is not None and self.on_complete is not None:
            self.on_complete(report)

    def _abort(self, why: str, raise_: bool = True) -> None:
        """Roll every applied module back (anchor, outer state, live params); forget the sync."""
        for name, snap in self._undo.items():
            self.outer.restore(name, snap)
        self._undo.clear()
        for pending, _ in self._inflight.values():
            pending.done = True
        self._inflight.clear()
        self._todo.clear()
        self.comm.abort()
        report, self.report = self.report, None
        log.warning("sync %s aborted and rolled back: %s", report.sync if report else "?", why)
        if report is not None and self.on_abort is not None:
            self.on_abort(report, why)
        if raise_:
            raise SyncAborted(why)

    def sync_all(self) -> None:
        """Synchronize every remaining module now, in unit order (at_end mode, eval, checkpoints)."""
        for unit in self.units:
            if unit.name in self._todo:
                self._sync_unit(unit.name)


def summarize(report: SyncReport) -> dict[str, Any]:
    """The `sync` event fields for this cluster (DESIGN.md §5)."""
    me = report.position
    decisions = list(report.decisions.values())
    weights = [d.weights[me] for d in decisions]
    anomalous = [d.module for d in decisions if d.anomalous[me]]
    clips = [c for c in report.clip.values() if c > 0] or [0.0]
    return {
        "sync": report.sync,
        "local_steps": report.local_steps,
        "pseudo_grad_norm": report.group_norm if math.isfinite(report.group_norm) else None,
        "weight": sum(weights) / max(len(weights), 1),
        "anomalous": bool(anomalous),
        "anomalous_modules": anomalous,
        "anomaly_details": anomaly_details(report.decisions, me),  # {module: {z, threshold}} of flagged ones
        "clip_coef": min(clips),
        "bytes": report.bytes,
        "blocked_s": report.blocked_s,
        "participants": list(report.participants),
    }
