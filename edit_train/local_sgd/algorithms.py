"""Algorithms as configurations of one core, wrapped around an unchanged training loop.

| algo            | cross-group traffic         | outer optimizer         | penalty        | sync     |
|-----------------|-----------------------------|-------------------------|----------------|----------|
| ddp             | gradients, every step       | —                       | —              | —        |
| post_local_sgd  | params every H steps        | SGD lr 1, no momentum   | off (uniform)  | at_end   |
| diloco          | pseudo-grads every H steps  | Nesterov SGD 0.7 / 0.9  | off (uniform)  | at_end   |
| edit            | pseudo-grads every H steps  | Nesterov SGD 0.7 / 0.8  | full           | layerwise|
| a_edit          | pseudo-grads every τ secs   | Nesterov SGD 0.7 / 0.8  | full           | layerwise|

The trainer calls `join()` once (heal from a live peer if the federation is ahead), `after_backward(step)`
(gradient all-reduce for ddp and the synchronous warm-up), `after_step(step, seconds)` (counts local steps,
starts syncs), `flush()` (finish a pending layer-wise sync before eval / checkpoint) and `finish()`.

Every sync first forms a quorum (torchft's Lighthouse, `FederationComm.form`): the clusters present take
part, the absent get weight 0 and keep training; a member whose anchor is older than the newest heals from
a live peer before the sync (θ ← θ̄_new + (θ − θ̄_old), so its local progress is kept) and a member with no
local step since its anchor takes part with weight 0. A cluster cut off from the federation counts a
missed sync and keeps training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from edit_train.federation.comm import FederationComm
from edit_train.federation.link import FederationError, FederationRefused
from edit_train.local_sgd.outer import OuterConfig, OuterState
from edit_train.local_sgd.gradients import average_grads, grads_allreduce
from edit_train.local_sgd.healing import Healer, apply_state, collect_state
from edit_train.local_sgd.joining import join_federation
from edit_train.local_sgd.penalty import PenaltyConfig
from edit_train.local_sgd.roster import RosterAggregator
from edit_train.local_sgd.overlap import OverlapSync
from edit_train.local_sgd.schedule import ScheduleConfig, StepSchedule, StepTimer, TimePlanner
from edit_train.local_sgd.sync import SyncAborted, SyncEngine, SyncReport, Unit, summarize

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
    fingerprint: str = ""  # hash of what must agree across clusters (model, algorithm, chunks)
    expected: tuple[str, ...] = ()  # the configured clusters: a fresh start waits (bounded) until all met
    start_timeout_s: float = 60.0
    regroup_s: float = 5.0  # a resumed cluster waits this long (the grace window) for the others to resume too
    shares_loss: bool = False  # ddp exchanges the loss with the gradients (the loss-spike guard is on)


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
    """Drives ddp / local SGD / EDiT / A-EDiT around a training loop, on one rank of one cluster."""

    def __init__(self, cfg: LocalSGDConfig, model: nn.Module, unit_modules: list[nn.Module],
                 comm: FederationComm, shard_pg: Any = None, shard_size: int = 1,
                 emit: EventFn | None = None, is_group_leader: bool = True, group_index: int = 0,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        import uuid

        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.comm = comm
        self.group_index = group_index
        self.shard_pg = shard_pg
        self.shard_size = shard_size
        self.emit = emit
        self.is_group_leader = is_group_leader
        self.incarnation = uuid.uuid4().hex[:12]
        self.schedule = StepSchedule(cfg.schedule)
        self.planner = TimePlanner(cfg.schedule, 1) if cfg.schedule.kind == "time" else None
        # local steps this group takes before its next sync; a time schedule's first interval is planned
        # from this group's own step times (nothing has been exchanged yet): sync once τ has been spent
        self.planned = cfg.schedule.interval if self.planner is None else 0
        self.timer = StepTimer()
        self.units = build_units(model, unit_modules)
        self.sync_index = 0
        self._sync_step = 0
        self.local_steps = 0
        self.total_steps = 0  # this cluster's steps so far
        self.global_step = 0  # max over clusters, as of the last exchange
        self.anomalies = 0
        self.syncs_done = 0
        self.syncs_missed = 0
        self.syncs_aborted = 0
        self.healed_from: list[str] = []
        self.adopt_step: int | None = None  # set by a heal on join: the trainer continues from this step
        self.history: list[int] = []  # local steps of each completed sync
        self.stopped = False  # every group agreed to stop (time schedule / time budget)
        # A-EDiT after the agreed stop: keep stepping until the final quorum is issued (then the final sync)
        self.finishing = False
        self._t0 = time.time()
        self._blocked_mark = 0.0
        self._last_exchange_t = self._t0
        self.shared_loss: float | None = None  # set by the trainer; world mean after a gradient all-reduce
        self._vote = False  # this group's agreed stop vote, refreshed every local step
        self.eval_due = False  # set when the agreed global step crosses a multiple of cfg.eval_every
        self.engine: SyncEngine | None = None
        self.overlap: OverlapSync | None = None
        self._joining = False
        self.aggregator = RosterAggregator(cfg.penalty)
        self.healer = Healer(comm, lambda: collect_state(self), lambda meta, t: apply_state(self, meta, t))
        # the trainer's time account (edit_train.timing): the layer-wise hooks charge their work to `sync`
        self.span: Callable[[str], AbstractContextManager] = lambda _name: nullcontext()
        if cfg.local_sgd and cfg.schedule.warmup_steps == 0:
            self._start_local_phase()

    # ------------------------------------------------------------- lifecycle
    def _start_local_phase(self) -> None:
        """Anchor θ̄ ← current params (identical across groups at init and after the warm-up)."""
        outer = OuterState({u.name: u.live() for u in self.units}, self.cfg.outer)
        self.engine = SyncEngine(self.units, outer, self.aggregator, self.comm, self.shard_pg,
                                 self.shard_size, prefetch=self.cfg.prefetch)
        self.engine.on_complete = self._on_sync_complete
        self.engine.on_abort = self._on_sync_abort
        self.engine.span = lambda name: self.span(name)
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
            return not self.finishing
        return self.lockstep and step >= self.cfg.total_steps

    # ------------------------------------------------------------ membership
    def _quorum_data(self, local_steps: int) -> dict[str, Any]:
        return {"local_steps": local_steps, "incarnation": self.incarnation, "fp": self.cfg.fingerprint,
                "total_steps": self.total_steps}

    def _quorum(self, local_steps: int) -> Any:
        """Form this sync's quorum and heal whoever is behind. None when cut off from the federation."""
        return self._admit(self.comm.form(self.sync_index, self._quorum_data(local_steps)))

    def _admit(self, m: Any) -> Any:
        """An issued quorum: check the configurations agree, heal whoever is behind."""
        if m is None:
            return None
        src = m.members[m.source]
        if src.data.get("fp") != self.cfg.fingerprint and m.me != m.source:
            raise FederationRefused(f"cluster {self.comm.name} runs another configuration than cluster {src.name} "
                                  "(model, algorithm or federation.chunks differ); start it with the federation's config")
        healed = self.healer.run(m)
        if healed is not None:
            self.healed_from.append(healed)
        if self.lockstep and self.cfg.local_sgd:
            # step schedules end at train.steps on every cluster: one that fell behind (joined late, lost a
            # quorum race) continues from the federation's step rather than syncing one interval late forever
            top = max(int(mm.data.get("total_steps", 0)) for mm in m.members)
            if top > self.total_steps:
                self.adopt_step = self.total_steps = top
        return m

    def join(self) -> None:
        """Before the first step: meet the federation (`local_sgd/joining.py`)."""
        join_federation(self)

    # ------------------------------------------------------------ ddp / warm-up
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
            grads_allreduce(self)

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
            if not self.overlap.dropped:
                self._after_exchange(self.overlap.gathered_extra)
        if self.comm.forming:
            self._poll_quorum(step + 1)
        elif self.finishing:
            self.start_sync(step + 1)
        first_timed = self.planned == 0 and self.timer.mean() * self.local_steps >= self.cfg.schedule.sync_time_s
        due = (self.planned > 0 and self.local_steps >= self.planned) or first_timed
        if due and not self.comm.forming:
            self.start_sync(step + 1)
        self._blocked_mark = self.comm.blocked_s

    @property
    def _background_quorum(self) -> bool:
        """A-EDiT + overlap: a cluster that reaches its sync point first asks for the quorum and keeps training
        until the others have asked too (the sync starts at its next step boundary), instead of waiting. In
        the blocking modes the norm exchange that follows is a rendezvous anyway, so asking in the background
        would only move the wait there (and add the late cluster's polling delay to it)."""
        return self.planner is not None and self.comm.federated and self.cfg.mode == "overlap"

    def start_sync(self, step: int, block: bool = False) -> None:
        assert self.engine is not None
        self.flush()
        self.comm.form_start(self.sync_index, self._quorum_data(self.local_steps))
        self._poll_quorum(step, block=block or not self._background_quorum)

    def _poll_quorum(self, step: int, block: bool = False) -> None:
        """Collect a quorum being formed in the background; run the sync once it is issued."""
        try:
            done, m = self.comm.form_poll(block)
            if not done:
                return
            m = self._admit(m)
        except SyncAborted:
            m = None
        except FederationRefused:
            raise
        except FederationError as exc:
            log.warning("cluster %s: sync skipped: %s", self.comm.name, exc)
            self.comm.abort()
            m = None
        self._synced(step, m)

    def _synced(self, step: int, m: Any) -> None:
        if self.finishing:  # the first quorum after the agreed stop is the final sync: blocking, then stop
            self.finishing = False
            if m is not None:
                with self._blocking():
                    self._run_sync(step, m)
                    self.flush()
                return
        if m is None:  # cut off: keep training from the local replica; try again after another interval
            self.syncs_missed += 1
            if self.emit is not None and self.is_group_leader:
                self.emit("missed", step=step, group=self.group_index, cluster=self.comm.name,
                          sync=self.sync_index + 1, local_steps=self.local_steps)
            self._last_exchange_t = time.time()
            base = self.cfg.schedule.interval if self.planner is None else max(self.planned, 1)
            self.planned = self.local_steps + base
            return
        self._run_sync(step, m)

    def _run_sync(self, step: int, m: Any) -> None:
        assert self.engine is not None
        contributors = any(mm.contributes for mm in m.members)
        self.sync_index = m.max_sync + (1 if contributors else 0)
        self._sync_step = step
        extra = [float(self.local_steps), self.timer.mean(), float(self.total_steps), float(self._vote)]
        self._last_exchange_t = time.time()
        self.local_steps = 0
        if self.planner is None:
            self.planned = self.cfg.schedule.interval
        self.timer.reset()
        if not contributors:
            self.comm.abort()
            return
        if self.overlap is not None:
            try:
                self.overlap.begin(self.sync_index, int(extra[0]), extra)
            except FederationError as exc:
                self._on_sync_abort(SyncReport(sync=self.sync_index, local_steps=int(extra[0])), str(exc))
            return
        try:
            self._after_exchange(self.engine.begin(self.sync_index, int(extra[0]), extra=extra))
            if self.cfg.mode != "layerwise":
                self.engine.sync_all()
        except SyncAborted:
            pass  # rolled back; local progress kept, next interval retries

    def _after_exchange(self, gathered: torch.Tensor | None) -> None:
        """Every participant now knows every participant's [local_steps, secs/step, total_steps, stop vote]."""
        if gathered is None:
            return
        secs = gathered[:, 1].tolist()
        if not self.lockstep:
            before = self.global_step
            self.global_step = int(gathered[:, 2].max().item())
            every = self.cfg.eval_every
            self.eval_due = self.eval_due or (every > 0 and self.global_step // every > before // every)
        if gathered[:, 3].max().item() > 0 and not self.stopped:
            self.stopped = True
            # ask for the final quorum in the background and keep training until every cluster has asked:
            # the cluster that learns of the stop first does not wait for the others to learn of it
            self.finishing = self._background_quorum and self.engine is not None
        if self.planner is not None:
            self.planned = self.planner.steps_for(secs[self.comm.position])

    def flush(self) -> None:
        """Finish any sync in flight (before eval, checkpoints and the next sync)."""
        if self.overlap is not None and self.overlap.pending:
            self.overlap.poll(block=True)
            if not self.overlap.dropped:
                self._after_exchange(self.overlap.gathered_extra)
        if self.engine is not None and self.engine.pending:
            try:
                self.engine.sync_all()
            except SyncAborted:
                pass

    def finish(self) -> None:
        """End of training: a final blocking sync if local steps are outstanding, so every group ends
        on θ̄ (all groups reach this point after the same number of syncs)."""
        if self.comm.forming:  # a quorum asked for in the background: this sync happens, then the final one
            self._poll_quorum(self.total_steps, block=True)
        self.flush()
        if self.engine is not None and self.local_steps > 0:
            with self._blocking():
                self.start_sync(self.total_steps, block=True)
                self.flush()

    @contextmanager
    def _blocking(self) -> Iterator[None]:
        """The final sync runs blocking even in overlap mode: every cluster must end on the same anchor."""
        overlap, self.overlap = self.overlap, None
        try:
            yield
        finally:
            self.overlap = overlap

    def _on_sync_complete(self, report: SyncReport) -> None:
        self.syncs_done += 1
        self.history.append(report.local_steps)
        record = summarize(report)
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
            self.emit("sync", step=self._sync_step, group=self.group_index, cluster=self.comm.name, **record)

    def _on_sync_abort(self, report: SyncReport, why: str) -> None:
        self.syncs_aborted += 1
        if self.emit is not None and self.is_group_leader:
            self.emit("sync_aborted", step=self._sync_step, group=self.group_index, cluster=self.comm.name,
                      sync=report.sync, participants=list(report.participants), reason=why)
        self.sync_index = max(self.sync_index - 1, 0)

    # ------------------------------------------------------------- reporting
    def group_stats(self) -> dict[str, Any]:
        """This rank's totals (the trainer gathers one per group)."""
        return {"bytes_sent": self.comm.bytes_sent, "blocked_s": self.comm.blocked_s,
                "syncs": self.syncs_done, "anomalies": self.anomalies, "local_steps_per_sync": self.history,
                "syncs_missed": self.syncs_missed, "syncs_aborted": self.syncs_aborted,
                "healed_from": list(self.healed_from)}

    # ------------------------------------------------------------ checkpoint
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.engine is None:
            return {}
        return {"outer": self.engine.outer.state_dict(), "penalty": self.aggregator.state_tensors(),
                "residual": self.comm.feedback.state_dict()}

    def state_json(self) -> dict[str, Any]:
        return {"sync_index": self.sync_index, "local_steps": self.local_steps, "anomalies": self.anomalies,
                "syncs_done": self.syncs_done, "history": self.history, "local_phase": self.engine is not None,
                "timer": self.timer.state_dict(), "bytes_sent": self.comm.bytes_sent, "planned": self.planned,
                "global_step": self.global_step, "blocked_s": self.comm.blocked_s,
                "roster": list(self.aggregator.roster), "syncs_missed": self.syncs_missed,
                "total_steps": self.total_steps}

    def load_state(self, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any]) -> None:
        self.sync_index = state["sync_index"]
        self.local_steps = state["local_steps"]
        self.anomalies = state["anomalies"]
        self.syncs_done = state["syncs_done"]
        self.syncs_missed = state.get("syncs_missed", 0)
        self.history = list(state.get("history", []))
        self.timer.load_state_dict(state["timer"])
        self.planned = state.get("planned", self.planned)
        self.global_step = state.get("global_step", 0)
        self.total_steps = int(state.get("total_steps", 0))  # the quorum compares it (lockstep step adoption)
        self.comm.clock.bytes_sent = state["bytes_sent"]
        self.comm.clock.blocked_s = state["blocked_s"]
        if state["local_phase"]:
            if self.engine is None:
                self._start_local_phase()
            assert self.engine is not None
            self.engine.outer.load_state_dict(tensors["outer"])
            self.aggregator.load(state.get("roster", []), tensors.get("penalty", {}))
            self.comm.feedback.load_state_dict(tensors.get("residual", {}))
