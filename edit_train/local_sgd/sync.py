"""The EDiT sync engine: layer-wise pseudo-gradient synchronization inside the next forward pass.

At a sync point the engine computes, per module, the squared norm of this rank's shard of
Δ = θ̄ − θ, sums it over the worker group, and exchanges one small vector across groups (the only
up-front cross-group traffic). Every rank then takes the same per-module decisions (anomalies, weights).
The heavy work — scaling Δ by this worker's weight, the cross-group SUM all-reduce, clipping, the outer
step and θ ← θ̄ — happens per module in a forward pre-hook registered *before* FSDP's own, so it runs on
the local shard before FSDP gathers it; the next module's reduction is launched asynchronously while
the current one computes (prefetch). `sync_all()` does the same for every module at once (`at_end`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from edit_train.dist.comm import CrossGroupComm, Pending, shard_sum_
from edit_train.local_sgd.outer import OuterState
from edit_train.local_sgd.penalty import Decision, PseudoGradAggregator, clip_coef_from_sqnorm, weighted

log = logging.getLogger(__name__)


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


class SyncEngine:
    def __init__(self, units: list[Unit], outer: OuterState, aggregator: PseudoGradAggregator,
                 comm: CrossGroupComm, group_index: int, shard_pg: Any = None, shard_size: int = 1,
                 prefetch: bool = True) -> None:
        self.units = units
        self.index = {u.name: i for i, u in enumerate(units)}
        self.outer = outer
        self.aggregator = aggregator
        self.comm = comm
        self.group_index = group_index
        self.shard_pg = shard_pg
        self.shard_size = shard_size
        self.prefetch = prefetch
        self.report: SyncReport | None = None  # the sync in progress
        self._todo: set[str] = set()
        self._inflight: dict[str, tuple[Pending, list[Tensor]]] = {}
        self._hooks: list[Any] = []
        self.on_complete: Callable[[SyncReport], None] | None = None

    # ----------------------------------------------------------------- hooks
    def install_hooks(self) -> None:
        """Register the per-unit forward pre-hooks (prepended: they run before FSDP's all-gather)."""
        for unit in self.units:
            def hook(_module: nn.Module, _args: Any, _name: str = unit.name) -> None:
                if _name in self._todo:
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
        self.report = SyncReport(sync=sync_index, local_steps=local_steps)
        blocked0, bytes0 = self.comm.blocked_s, self.comm.bytes_sent
        sq = torch.zeros(len(self.units), dtype=torch.float64, device=self.comm.device)
        for i, unit in enumerate(self.units):
            self.outer.params[unit.name] = unit.live()
            sq[i] = sum(float(d.double().pow(2).sum()) for d in self.outer.pseudo_grad(unit.name))
        shard_sum_(sq, self.shard_pg, self.shard_size)
        vec = torch.cat([sq, torch.tensor(extra, dtype=torch.float64, device=sq.device)])
        gathered = self.comm.all_gather(vec).cpu()  # [groups, units + extra]
        norms = gathered[:, : len(self.units)].clamp_min(0).sqrt()
        steps = gathered[:, len(self.units)] if extra else None
        for i, unit in enumerate(self.units):
            self.report.decisions[unit.name] = self.aggregator.decide(unit.name, norms[:, i], steps)
        self.report.group_norm = float(norms[self.group_index].pow(2).sum().sqrt())
        self.report.blocked_s += self.comm.blocked_s - blocked0
        self.report.bytes += self.comm.bytes_sent - bytes0
        self._todo = {u.name for u in self.units}
        return gathered[:, len(self.units):]

    # ------------------------------------------------------------ per module
    def _launch(self, name: str) -> None:
        """Scale this worker's Δ by its weight and start the cross-group SUM all-reduce."""
        if name in self._inflight or name not in self._todo:
            return
        assert self.report is not None
        self.outer.params[name] = self.units[self.index[name]].live()
        self.outer.prefetch(name)
        w = self.report.decisions[name].weights[self.group_index]
        delta = weighted(self.outer.pseudo_grad(name), float(w))
        bytes0 = self.comm.bytes_sent
        pending = self.comm.all_reduce_(delta, async_op=True)
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
        self.report.blocked_s += pending.wait()
        decision = self.report.decisions[name]
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
        report, self.report = self.report, None
        if report is not None and self.on_complete is not None:
            self.on_complete(report)

    def sync_all(self) -> None:
        """Synchronize every remaining module now, in unit order (at_end mode, eval, checkpoints)."""
        for unit in self.units:
            if unit.name in self._todo:
                self._sync_unit(unit.name)


def summarize(report: SyncReport, group_index: int) -> dict[str, Any]:
    """The `sync` event fields for one group (DESIGN.md §5)."""
    decisions = list(report.decisions.values())
    weights = [d.weights[group_index] for d in decisions]
    anomalous = [d.module for d in decisions if d.anomalous[group_index]]
    clips = [c for c in report.clip.values() if c > 0] or [0.0]
    return {
        "sync": report.sync,
        "local_steps": report.local_steps,
        "pseudo_grad_norm": report.group_norm if math.isfinite(report.group_norm) else None,
        "weight": sum(weights) / max(len(weights), 1),
        "anomalous": bool(anomalous),
        "anomalous_modules": anomalous,
        "clip_coef": min(clips),
        "bytes": report.bytes,
        "blocked_s": report.blocked_s,
    }
