"""Algorithms as configurations of one core, wrapped around an unchanged training loop.

| algo            | cross-group traffic         | outer optimizer         | penalty        | sync     |
|-----------------|-----------------------------|-------------------------|----------------|----------|
| ddp             | gradients, every step       | —                       | —              | —        |
| post_local_sgd  | params every H steps        | SGD lr 1, no momentum   | off (uniform)  | at_end   |
| diloco          | pseudo-grads every H steps  | Nesterov SGD 0.7 / 0.9  | off (uniform)  | at_end   |
| edit            | pseudo-grads every H steps  | Nesterov SGD 0.7 / 0.8  | full           | layerwise|
| a_edit          | pseudo-grads every τ secs   | Nesterov SGD 0.7 / 0.8  | full           | layerwise|

The trainer calls `after_backward(step)` (gradient all-reduce for ddp and the synchronous warm-up),
`after_step(step, seconds)` (counts local steps, starts syncs), `flush()` (finish a pending layer-wise
sync before eval / checkpoint) and `finish()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from edit_train.dist.comm import CrossGroupComm
from edit_train.local_sgd.outer import OuterConfig, OuterState
from edit_train.local_sgd.penalty import PenaltyConfig, PseudoGradAggregator
from edit_train.local_sgd.schedule import ScheduleConfig, StepSchedule, StepTimer
from edit_train.local_sgd.sync import SyncEngine, SyncReport, Unit, summarize

log = logging.getLogger(__name__)

EventFn = Callable[..., None]


@dataclass
class LocalSGDConfig:
    local_sgd: bool = True  # False: every step all-reduces gradients across groups (ddp)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    penalty: PenaltyConfig = field(default_factory=PenaltyConfig)
    mode: str = "layerwise"  # layerwise | at_end | overlap
    prefetch: bool = True


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


class LocalSGD:
    """Drives ddp / local SGD / EDiT around a training loop, on one rank."""

    def __init__(self, cfg: LocalSGDConfig, model: nn.Module, unit_modules: list[nn.Module],
                 comm: CrossGroupComm, group_index: int, shard_pg: Any = None, shard_size: int = 1,
                 emit: EventFn | None = None, is_group_leader: bool = True) -> None:
        self.cfg = cfg
        self.model = model
        self.comm = comm
        self.group_index = group_index
        self.shard_pg = shard_pg
        self.shard_size = shard_size
        self.emit = emit
        self.is_group_leader = is_group_leader
        self.schedule = StepSchedule(cfg.schedule)
        self.timer = StepTimer()
        self.units = build_units(model, unit_modules)
        self.sync_index = 0
        self._sync_step = 0
        self._last_step = 0
        self.local_steps = 0
        self.anomalies = 0
        self.syncs_done = 0
        self.engine: SyncEngine | None = None
        if cfg.local_sgd and cfg.schedule.warmup_steps == 0:
            self._start_local_phase()

    # ------------------------------------------------------------- lifecycle
    def _start_local_phase(self) -> None:
        """Anchor θ̄ ← current params (identical across groups at init and after the warm-up)."""
        outer = OuterState({u.name: u.live() for u in self.units}, self.cfg.outer)
        aggregator = PseudoGradAggregator(self.cfg.penalty, self.comm.num_groups)
        self.engine = SyncEngine(self.units, outer, aggregator, self.comm, self.group_index, self.shard_pg,
                                 self.shard_size, prefetch=self.cfg.prefetch)
        self.engine.on_complete = self._on_sync_complete
        if self.cfg.mode == "layerwise":
            self.engine.install_hooks()

    def _grads_allreduce(self) -> None:
        grads = []
        for p in self.model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grads.append(g)
        self.comm.all_reduce_(grads)
        if self.comm.active:
            for g in grads:
                g.div_(self.comm.num_groups)

    def after_backward(self, step: int) -> None:
        if not self.cfg.local_sgd or self.schedule.is_warmup(step):
            self._grads_allreduce()

    def after_step(self, step: int, seconds: float, *_: Any) -> None:
        if not self.cfg.local_sgd:
            return
        if self.schedule.is_warmup(step):
            if step + 1 == self.cfg.schedule.warmup_steps:
                self._start_local_phase()
            return
        self._last_step = step + 1
        self.local_steps += 1
        self.timer.record(seconds)
        if self.schedule.should_sync(self.local_steps):
            self.start_sync(step + 1)

    def start_sync(self, step: int) -> None:
        assert self.engine is not None
        self.flush()  # a previous layer-wise sync must have finished (it has, after a forward)
        self.sync_index += 1
        self._sync_step = step
        self.engine.begin(self.sync_index, self.local_steps, extra=[float(self.local_steps), self.timer.mean()])
        self.local_steps = 0
        self.timer.reset()
        if self.cfg.mode != "layerwise":
            self.engine.sync_all()

    def flush(self) -> None:
        if self.engine is not None and self.engine.pending:
            self.engine.sync_all()

    def finish(self) -> None:
        """End of training: a final sync if local steps are outstanding, so every group ends on θ̄."""
        if self.engine is not None and self.local_steps > 0:
            self.start_sync(self._last_step)
        self.flush()

    def _on_sync_complete(self, report: SyncReport) -> None:
        self.syncs_done += 1
        record = summarize(report, self.group_index)
        # the group's bytes are every rank's own shard traffic; blocked time is the slowest rank's
        t = torch.tensor([float(record["bytes"]), record["blocked_s"]], dtype=torch.float64, device=self.comm.device)
        if self.shard_pg is not None and self.shard_size > 1:
            import torch.distributed as dist

            b = t[:1].clone()
            dist.all_reduce(b, group=self.shard_pg)
            m = t[1:].clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.shard_pg)
            t = torch.cat([b, m])
        record["bytes"], record["blocked_s"] = int(t[0].item()), float(t[1].item())
        if record["anomalous"]:
            self.anomalies += 1
        if self.emit is not None and self.is_group_leader:
            self.emit("sync", step=self._sync_step, group=self.group_index, **record)

    # ------------------------------------------------------------- reporting
    def group_stats(self) -> dict[str, Any]:
        """This rank's totals (the trainer gathers one per group)."""
        return {"bytes_sent": self.comm.bytes_sent, "blocked_s": self.comm.blocked_s,
                "syncs": self.syncs_done, "anomalies": self.anomalies}

    # ------------------------------------------------------------ checkpoint
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.engine is None:
            return {}
        return {"outer": self.engine.outer.state_dict(), "penalty": self.engine.aggregator.state_dict()}

    def state_json(self) -> dict[str, Any]:
        return {"sync_index": self.sync_index, "local_steps": self.local_steps, "anomalies": self.anomalies,
                "syncs_done": self.syncs_done, "local_phase": self.engine is not None,
                "timer": self.timer.state_dict(), "bytes_sent": self.comm.bytes_sent,
                "blocked_s": self.comm.blocked_s}

    def load_state(self, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any]) -> None:
        self.sync_index = state["sync_index"]
        self.local_steps = state["local_steps"]
        self.anomalies = state["anomalies"]
        self.syncs_done = state["syncs_done"]
        self.timer.load_state_dict(state["timer"])
        self.comm.bytes_sent = state["bytes_sent"]
        self.comm.blocked_s = state["blocked_s"]
        if state["local_phase"]:
            if self.engine is None:
                self._start_local_phase()
            assert self.engine is not None
            self.engine.outer.load_state_dict(tensors["outer"])
            self.engine.aggregator.load_state_dict(tensors.get("penalty", {}))
