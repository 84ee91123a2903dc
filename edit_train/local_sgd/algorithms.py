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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from edit_train.dist.comm import CrossGroupComm
from edit_train.local_sgd.outer import OuterConfig, OuterState
from edit_train.local_sgd.penalty import PenaltyConfig, PseudoGradAggregator
from edit_train.local_sgd.overlap import OverlapSync
from edit_train.local_sgd.schedule import ScheduleConfig, StepSchedule, StepTimer, TimePlanner
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
    total_steps: int = 0  # step schedule: every group stops here; time schedule: first group to reach it ends the run
    time_budget_s: float = 0.0  # stop at the exchange nearest to this many seconds (0 = off)
    eval_every: int = 0  # time schedule: ask for a global eval when the agreed step crosses a multiple


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
    """Drives ddp / local SGD / EDiT / A-EDiT around a training loop, on one rank."""

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
        self.planner = TimePlanner(cfg.schedule, comm.num_groups) if cfg.schedule.kind == "time" else None
        # local steps this group takes before its next sync; a time schedule's first interval is planned
        # from this group's own step times (nothing has been exchanged yet): sync once τ has been spent
        self.planned = cfg.schedule.interval if self.planner is None else 0
        self.timer = StepTimer()
        self.units = build_units(model, unit_modules)
        self.sync_index = 0
        self._sync_step = 0
        self.local_steps = 0
        self.total_steps = 0  # this group's steps so far
        self.global_step = 0  # max over groups, as of the last exchange
        self.anomalies = 0
        self.syncs_done = 0
        self.history: list[int] = []  # local steps of each completed sync
        self.stopped = False  # every group agreed to stop (time schedule / time budget)
        self._t0 = time.time()
        self._blocked_mark = 0.0
        self._last_exchange_t = self._t0
        self.shared_loss: float | None = None  # set by the trainer; world mean after a gradient all-reduce
        self._vote = False  # this group's agreed stop vote, refreshed every local step
        self.eval_due = False  # set when the agreed global step crosses a multiple of cfg.eval_every
        self.engine: SyncEngine | None = None
        self.overlap: OverlapSync | None = None
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
        if self.cfg.mode == "overlap":
            self.overlap = OverlapSync(self.engine)

    @property
    def lockstep(self) -> bool:
        """Do all groups take the same number of steps (so step-based stop/eval is agreed)?"""
        return not (self.cfg.local_sgd and self.cfg.schedule.kind == "time")

    def _want_stop(self) -> bool:
        """This group's vote at an exchange. With a time budget, stop at the exchange nearest to it:
        when half an interval more would already pass the budget."""
        now = time.time()
        interval_s = now - self._last_exchange_t
        over_budget = self.cfg.time_budget_s > 0 and (now - self._t0) + 0.5 * interval_s >= self.cfg.time_budget_s
        return over_budget or (not self.lockstep and self.total_steps >= self.cfg.total_steps)

    def should_stop(self, step: int) -> bool:
        if self.stopped:
            return True
        return self.lockstep and step >= self.cfg.total_steps

    def _grads_allreduce(self) -> None:
        grads = []
        for p in self.model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grads.append(g)
        vote = None
        loss = None
        if self.shared_loss is not None:  # ddp: the loss-spike decision must be the same on every group
            loss = torch.tensor([self.shared_loss], dtype=torch.float32, device=self.comm.device)
            grads.append(loss)
        if self.cfg.time_budget_s > 0:
            _, agreed = self._group_agree(0.0, self._want_stop())
            vote = torch.tensor([1.0 if agreed else 0.0], device=self.comm.device)
            grads.append(vote)
            self._last_exchange_t = time.time()
        self.comm.all_reduce_(grads)
        if self.comm.active:
            for g in grads:
                g.div_(self.comm.num_groups)
        if vote is not None and float(vote.item()) > 0:
            self.stopped = True
        if loss is not None:
            self.shared_loss = float(loss.item())

    def _group_agree(self, seconds: float, vote: bool) -> tuple[float, bool]:
        """Ranks of one group must take the same decisions (plan, first sync, stop): agree on the slowest
        rank's step time and on any rank's stop vote (one tiny intra-group all-reduce, only when the
        decisions depend on local clocks)."""
        clocked = not self.lockstep or self.cfg.time_budget_s > 0
        if not clocked or self.shard_pg is None or self.shard_size <= 1:
            return seconds, vote
        import torch.distributed as dist

        t = torch.tensor([seconds, 1.0 if vote else 0.0], dtype=torch.float64, device=self.comm.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.shard_pg)
        return float(t[0].item()), bool(t[1].item() > 0)

    def after_backward(self, step: int) -> None:
        if not self.cfg.local_sgd or self.schedule.is_warmup(step):
            self._grads_allreduce()

    def after_step(self, step: int, seconds: float, *_: Any) -> None:
        self.total_steps = step + 1
        if not self.cfg.local_sgd:
            self.global_step = step + 1
            return
        if self.schedule.is_warmup(step):
            self.global_step = step + 1
            if step + 1 == self.cfg.schedule.warmup_steps:
                self._start_local_phase()
            return
        if self.lockstep:
            self.global_step = step + 1
        self.local_steps += 1
        # compute speed only: time spent blocked on other groups / the link is not this group's speed
        secs, self._vote = self._group_agree(max(seconds - (self.comm.blocked_s - self._blocked_mark), 1e-6),
                                             self._want_stop())
        self.timer.record(secs)
        if self.overlap is not None and self.overlap.pending and self.overlap.poll():
            self._after_exchange(self.overlap.gathered_extra)
        first_timed = self.planned == 0 and self.timer.mean() * self.local_steps >= self.cfg.schedule.sync_time_s
        if (self.planned > 0 and self.local_steps >= self.planned) or first_timed:
            self.start_sync(step + 1)
        self._blocked_mark = self.comm.blocked_s

    def start_sync(self, step: int) -> None:
        assert self.engine is not None
        self.flush()
        self.sync_index += 1
        self._sync_step = step
        extra = [float(self.local_steps), self.timer.mean(), float(self.total_steps), float(self._vote)]
        self._last_exchange_t = time.time()
        self.local_steps = 0
        self.timer.reset()
        if self.overlap is not None:
            self.overlap.begin(self.sync_index, int(extra[0]), extra)
            return
        self._after_exchange(self.engine.begin(self.sync_index, int(extra[0]), extra=extra))
        if self.cfg.mode != "layerwise":
            self.engine.sync_all()

    def _after_exchange(self, gathered: torch.Tensor | None) -> None:
        """Every group now knows every group's [local_steps, secs/step, total_steps, stop vote]."""
        if gathered is None:
            return
        secs = gathered[:, 1].tolist()
        if not self.lockstep:
            before = self.global_step
            self.global_step = int(gathered[:, 2].max().item())
            every = self.cfg.eval_every
            self.eval_due = self.eval_due or (every > 0 and self.global_step // every > before // every)
        if gathered[:, 3].max().item() > 0:
            self.stopped = True
        if self.planner is not None:
            self.planned = self.planner.plan(secs)[self.group_index]

    def flush(self) -> None:
        """Finish any sync in flight (before eval, checkpoints and the next sync)."""
        if self.overlap is not None and self.overlap.pending:
            self.overlap.poll(block=True)
            self._after_exchange(self.overlap.gathered_extra)
        if self.engine is not None and self.engine.pending:
            self.engine.sync_all()

    def finish(self) -> None:
        """End of training: a final blocking sync if local steps are outstanding, so every group ends
        on θ̄ (all groups reach this point after the same number of syncs)."""
        self.flush()
        if self.engine is not None and self.local_steps > 0:
            overlap, self.overlap = self.overlap, None
            self.start_sync(self.total_steps)
            self.flush()
            self.overlap = overlap

    def _on_sync_complete(self, report: SyncReport) -> None:
        self.syncs_done += 1
        self.history.append(report.local_steps)
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
                "syncs": self.syncs_done, "anomalies": self.anomalies, "local_steps_per_sync": self.history}

    # ------------------------------------------------------------ checkpoint
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.engine is None:
            return {}
        return {"outer": self.engine.outer.state_dict(), "penalty": self.engine.aggregator.state_dict()}

    def state_json(self) -> dict[str, Any]:
        return {"sync_index": self.sync_index, "local_steps": self.local_steps, "anomalies": self.anomalies,
                "syncs_done": self.syncs_done, "history": self.history, "local_phase": self.engine is not None,
                "timer": self.timer.state_dict(), "bytes_sent": self.comm.bytes_sent, "planned": self.planned,
                "planner": self.planner.state_dict() if self.planner else None, "global_step": self.global_step,
                "blocked_s": self.comm.blocked_s}

    def load_state(self, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any]) -> None:
        self.sync_index = state["sync_index"]
        self.local_steps = state["local_steps"]
        self.anomalies = state["anomalies"]
        self.syncs_done = state["syncs_done"]
        self.history = list(state.get("history", []))
        self.timer.load_state_dict(state["timer"])
        self.planned = state.get("planned", self.planned)
        self.global_step = state.get("global_step", 0)
        if self.planner is not None and state.get("planner"):
            self.planner.load_state_dict(state["planner"])
        self.comm.bytes_sent = state["bytes_sent"]
        self.comm.blocked_s = state["blocked_s"]
        if state["local_phase"]:
            if self.engine is None:
                self._start_local_phase()
            assert self.engine is not None
            self.engine.outer.load_state_dict(tensors["outer"])
            self.engine.aggregator.load_state_dict(tensors.get("penalty", {}))
