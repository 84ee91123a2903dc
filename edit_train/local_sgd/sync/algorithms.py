"""`LocalSGD`: the algorithm wrapped around an unchanged training loop (ddp, post-local SGD, DiLoCo, EDiT and
A-EDiT are configurations of it).

The loop calls `join()` once, `after_backward(step, loss)` (gradient averaging for ddp and the synchronous
warm-up), `after_step(step, seconds)` (counts local steps, starts syncs; returns a `StepOutcome`), `flush()`
before eval / checkpoints and `finish()` at the end. Its collaborators: `Pacer` (when), `Membership` (who,
and healing), a driver (`drivers.py`) that runs the one sync round (`round.py`) over the `Transport`, the
aggregation rule (`rules.py`), `GradientExchange` (ddp), `Records` (events, counters), `SyncState`
(checkpoint and heal state).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from edit_train.local_sgd.aggregator import capabilities_of
from edit_train.local_sgd.moe.assignment import RoutedAssignment
from edit_train.local_sgd.sync.drivers import BlockingDriver, Driver, OverlapDriver
from edit_train.local_sgd.moe.expert_bias import BiasHook, BiasSync
from edit_train.local_sgd.errors import FederationError, FederationRefused, SyncAborted
from edit_train.local_sgd.moe.experts import Experts, RoutedCounts
from edit_train.local_sgd.sync.gradients import GradientExchange
from edit_train.local_sgd.sync.healing import Decode, Encode, Healer, Replica
from edit_train.local_sgd.sync.membership import Membership, MembershipConfig
from edit_train.local_sgd.sync.outer import OuterConfig, OuterState
from edit_train.local_sgd.sync.pacer import PaceConfig, Pacer
from edit_train.local_sgd.sync.probe import Probe
from edit_train.local_sgd.protocols import Quorum, Transport
from edit_train.local_sgd.sync.records import Records
from edit_train.local_sgd.aggregation.retract import Retraction
from edit_train.local_sgd.sync.round import SyncCore, SyncReport, build_units, land_on_anchors
from edit_train.local_sgd.aggregation.rules import RuleConfig, make_rule
from edit_train.local_sgd.sync.schedule import ScheduleConfig, StepSchedule
from edit_train.local_sgd.sync.state import SyncState
from edit_train.local_sgd.aggregation.suspects import Suspects
from edit_train.local_sgd.aggregation.scale import LrShape

log = logging.getLogger(__name__)


@dataclass
class LocalSGDConfig:
    local_sgd: bool = True  # False: every step all-reduces gradients across clusters (ddp)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    rule: RuleConfig = field(default_factory=RuleConfig)
    mode: str = "layerwise"  # layerwise | at_end | overlap
    prefetch: bool = True
    total_steps: int = 0  # step schedule: every cluster stops here; time: sets the run's syncs (pacer.run_syncs)
    time_budget_s: float = 0.0  # stop at the exchange nearest to this many seconds (0 = off)
    eval_every: int = 0  # time schedule: ask for a global eval when the agreed step crosses a multiple
    checkpoint_every: int = 0  # time schedule: a crash loses at most this many of a cluster's steps (Pacer)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    shares_loss: bool = False  # ddp exchanges the loss with the gradients (the loss-spike guard is on)
    tokens_per_step: int = 0  # this cluster's tokens per step (weights by tokens); 0: count steps
    max_tokens_per_step: int = 0  # the most tokens any configured cluster takes per step (0: tokens_per_step):
    # what another cluster's claimed tokens are bounded by (local steps x this)
    gather_max: int = 4  # a rule that needs measurements gathers up to this many clusters, sketches above
    lr_shape: LrShape | None = None  # the run's lr schedule relative to its peak (the scale bound's lr-weighted steps)
    expert_bias: str = "global"  # mean | global | local: what a sync does to the routers' expert bias (expert_bias.py)


@dataclass(frozen=True)
class StepOutcome:
    adopt_step: int | None = None  # healed / behind: the loop continues from this step
    eval_due: bool = False  # time schedule: the agreed step crossed an eval boundary (every cluster evals)
    checkpoint_due: bool = False  # time schedule: this cluster saves now (Pacer: at its own pace, after a sync)


class LocalSGD:
    """Drives ddp / local SGD / EDiT / A-EDiT around a training loop, on one rank of one cluster."""

    def __init__(self, cfg: LocalSGDConfig, model: nn.Module, unit_modules: list[nn.Module], transport: Transport,
                 codec: tuple[Encode, Decode], emit: Callable[..., None] | None = None, cluster_index: int = 0,
                 optimizer: torch.optim.Optimizer | None = None,
                 span: Callable[[str], AbstractContextManager[Any]] = lambda _n: nullcontext(),
                 probe_loss: Callable[[], float] | None = None, routed_counts: RoutedCounts | None = None,
                 bias_hook: BiasHook | None = None) -> None:
        self.cfg, self.t, self.span, self.routed = cfg, transport, span, routed_counts  # MoE: experts.py
        self.warmup = StepSchedule(cfg.schedule)
        self.pacer = Pacer(PaceConfig(cfg.schedule, cfg.local_sgd, cfg.total_steps, cfg.time_budget_s, cfg.eval_every,
                                      cfg.tokens_per_step, cfg.checkpoint_every), transport.cluster)
        self.rule = make_rule(cfg.rule)
        self.caps = capabilities_of(self.rule)  # what the rule asks beyond its decisions (aggregator.py)
        self.replica = Replica(model, optimizer, build_units(model, unit_modules))
        self.suspects = Suspects(transport.name)  # the liars this cluster names (log + `sync` events)
        self.records = Records(transport, emit, cluster_index, self.suspects)
        self.probe = Probe(self.replica.units, probe_loss, span, transport.name)  # usefulness (the rule's probe)
        self.driver: Driver | None = None
        outer = lambda: self.driver.core.outer if self.driver is not None else None  # noqa: E731
        healer = Healer(transport, lambda: self.state.heal_out(), lambda m, t: self.state.heal_in(m, t), *codec,
                        judge=self._judge_anchor if self.probe.enabled else None)
        self.membership = Membership(cfg.membership, transport, healer, self.pacer,
                                     digest=lambda: self.state.anchor_digest(), suspects=self.suspects)
        # expert_subsets=routed: the map the warm-up's committed exchanges decide (checkpointed and healed)
        self.assignment = RoutedAssignment(self.caps.expert_subsets_syncs) \
            if self.caps.expert_subsets == "routed" and routed_counts is not None else None
        # a model with an expert bias (Ling 2.0): what each sync does to it (algo.expert_bias)
        self.bias = BiasSync(cfg.expert_bias, bias_hook) if bias_hook is not None and cfg.local_sgd else None
        self.state = SyncState(self.replica, self.rule, self.pacer, self.membership, self.records, transport, outer,
                               self.start_local_phase, self.assignment, self.bias)
        self.grads = GradientExchange(transport, self.membership)
        self._blocked_mark = 0.0
        if cfg.local_sgd and cfg.schedule.warmup_steps == 0:
            self.start_local_phase()

    def start_local_phase(self) -> None:
        """Anchor θ̄ ← current params (identical across clusters at init and after the warm-up)."""
        units, pen, caps, probing = self.replica.units, self.cfg.rule, self.caps, self.probe.enabled
        experts = Experts(self.routed, [(u.name, u.module, u.params) for u in units], caps.expert_min_tokens,
                          caps.weighs_experts, self.assignment) if self.routed is not None else None
        outer = OuterState({u.name: u.live() for u in units}, self.cfg.outer, self.t.cluster.sum_)
        core = SyncCore(units=units, outer=outer,
                        rule=self.rule, transport=self.t, clip=pen.clip_phi, span=self.span,
                        gather_max=self.cfg.gather_max, sketch_dim=caps.sketch_dim,
                        keep=self.probe.keep if probing else None,
                        retract=Retraction(caps.probe_tolerance) if probing and caps.retract else None,
                        experts=experts, scale_bound=pen.scale_bound, suspects=self.suspects,
                        scale_spread=pen.scale_spread, lr_shape=self.cfg.lr_shape,
                        max_tokens_per_step=max(self.cfg.max_tokens_per_step, self.cfg.tokens_per_step, 1),
                        probe_tolerance=caps.probe_tolerance, probe_offset=caps.probe_offset,
                        expert_bias=self.bias)
        if self.bias is not None:
            self.bias.start()  # every cluster holds the same bias here: the anchor's
        self.driver = OverlapDriver(core, self._completed, self._aborted) if self.cfg.mode == "overlap" else \
            BlockingDriver(core, self._completed, self._aborted, self.cfg.mode == "layerwise", self.cfg.prefetch)

    def owned_experts(self, experts: int) -> tuple[tuple[bool, ...], ...] | None:
        """Under `expert_subsets=routed`, per MoE layer the experts this cluster trains and sends now (None: every
        one — the warm-up, another spec, or a cluster the decided map does not name)."""
        return self.assignment.owned(self.t.name, experts) if self.assignment is not None else None

    def to_anchor(self) -> int:
        """Under a decided routed map, the rows of the experts this cluster does not own take the anchor's values:
        the trainer's call where the map first reaches it (decided, healed, resumed), between a backward and the
        optimizer step — what they made since the last sync is let go, and frozen from there they carry no Δ
        (every later sync lands them on θ̄_new itself: `ExpertRows.unowned_to_anchor`). Elements reset here."""
        core = self.driver.core if self.driver is not None else None
        if core is None or core.experts is None or not core.experts.units:
            return 0
        owned = self.owned_experts(next(iter(core.experts.units.values())).count)
        if owned is None:
            return 0
        units = [(u.name, u.live(), core.outer.anchors[u.name], u.params) for u in core.units]
        return core.experts.to_anchor(units, owned, *core.where)

    def _judge_anchor(self, tensors: dict[str, Tensor]) -> str | None:
        """A received anchor on this cluster's probe slice against its own (why not to adopt it, or None)."""
        outer = self.driver.core.outer if self.driver is not None else None
        if outer is None:
            return None
        theirs = {u.name: [tensors.get(f"outer/{u.name}/anchor/{i}") for i in range(len(u.params))]
                  for u in self.replica.units}
        if any(t is None for ts in theirs.values() for t in ts):
            return None  # check_payload refuses a payload without the anchor
        return self.probe.compare({u.name: outer.anchors[u.name] for u in self.replica.units},
                                  theirs, self.caps.probe_tolerance)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ the loop's calls
    def join(self) -> int | None:
        """Before the first step: meet the federation. The step to continue from if healed or behind, else None."""
        if not self.t.federated:
            return None
        q = self.membership.meet()
        if q is not None and not any(m.contributes for m in q.members):
            self.membership.syncing(q)  # nobody contributes: the agreed version
            self.t.abort()
        elif q is not None and self.driver is None:  # ddp / warm-up: the others are averaging gradients
            self.grads.join(q, self.replica.model, int(self.cfg.shares_loss) + int(self.cfg.time_budget_s > 0))
        elif q is not None:  # the others are mid-sync: take part with weight 0
            self._run_sync(q)
        return self.membership.take_adopted()

    def after_backward(self, step: int, loss: float | Tensor | None = None) -> float | Tensor | None:
        """ddp / warm-up: average the gradients over the quorum. Returns the loss every cluster agrees on."""
        if self.cfg.local_sgd and not self.warmup.is_warmup(step):
            return loss
        vote = self.pacer.agreed_vote() if self.cfg.time_budget_s > 0 else None
        agreed, stop = self.grads.exchange(self.replica.model, step, loss if self.cfg.shares_loss else None, vote)
        if vote is not None:
            self.pacer.last_exchange_t = time.time()
        self.pacer.stop_agreed(stop)
        return agreed if agreed is not None else loss

    def after_step(self, step: int, seconds: float) -> StepOutcome:
        p = self.pacer
        p.stepped(step + 1)
        if not self.cfg.local_sgd or self.warmup.is_warmup(step):
            p.global_step = step + 1
            if self.cfg.local_sgd and step + 1 == self.cfg.schedule.warmup_steps:
                self.start_local_phase()
            return StepOutcome(self.membership.take_adopted())
        p.local_step(step, seconds - (self.t.blocked_s - self._blocked_mark))
        self.probe.score()  # the last committed round's updates, on this cluster's probe slice
        if self.driver is not None and self.driver.pending:
            self._exchanged(self.driver.poll())
        if self.t.forming:
            self._poll_quorum()
        elif p.finishing:
            self._start_sync()
        if p.due and not self.t.forming:
            self._start_sync()
        self._blocked_mark = self.t.blocked_s
        return StepOutcome(self.membership.take_adopted(), *p.take_due())

    def flush(self) -> None:
        """Finish any sync in flight (the loop's call, between steps: before eval and checkpoints). The time it
        blocks belongs to no step: subtracted from the next one, A-EDiT would plan τ / ~0 s steps and never sync."""
        before = self.t.blocked_s
        self._flush()
        self._blocked_mark += self.t.blocked_s - before

    def _flush(self) -> None:  # any sync in flight, finished (before the next sync too)
        if self.driver is not None and self.driver.pending:
            with suppress(SyncAborted):  # rolled back; local progress kept, the next interval retries
                self._exchanged(self.driver.flush())

    def finish(self) -> None:
        """A final blocking sync if local steps are outstanding, so every cluster ends on θ̄."""
        if self.t.forming:  # a quorum asked for in the background: this sync happens, then the final one
            self._poll_quorum(block=True)
        self._flush()
        if self.driver is not None and self.pacer.local_steps > 0:
            self._start_sync(final=True)
        if self.driver is not None and self.pacer.local_steps == 0:
            land_on_anchors(self.driver.core)  # every cluster ends on θ̄ (sync.unsent=keep: what it kept is let go)
            if self.bias is not None:
                self.bias.to_anchor()  # ... and on the anchor's expert bias (algo.expert_bias=local: the global one)

    def bias_load(self, step: int, reduce: Callable[[Tensor], Tensor] | None = None
                  ) -> Callable[[Tensor], Tensor] | None:
        """What the model's per-step expert-bias update reads its load through (`CausalLM.update_expert_bias`):
        `reduce` (the sum over the cluster's ranks), and under algo.expert_bias=global in the local phase then the
        federation's load estimated from it (`BiasSync.step_load`, expert_bias.py)."""
        fed = self.bias.step_load() if self.bias is not None and not self.warmup.is_warmup(step) else None
        if fed is None:
            return reduce
        return lambda load: fed(reduce(load) if reduce is not None else load)

    def should_stop(self, step: int) -> bool:
        return self.pacer.should_stop(step)

    # ------------------------------------------------------------------ syncs
    @property
    def _background_quorum(self) -> bool:
        """A-EDiT + overlap: the cluster that reaches its sync point first asks for the quorum and keeps
        training until the others have asked too. In the blocking modes the norm exchange that follows is a
        rendezvous anyway, so asking in the background would only move the wait there."""
        return self.pacer.planner is not None and self.t.federated and self.cfg.mode == "overlap"

    def _start_sync(self, final: bool = False) -> None:
        self._flush()
        self.membership.start(self.pacer.local_steps)
        self._poll_quorum(block=final or not self._background_quorum, final=final)

    def _poll_quorum(self, block: bool = False, final: bool = False) -> None:
        """Collect a quorum being formed in the background; run the sync once it is issued."""
        try:
            done, q = self.membership.poll(block)
            if not done:
                return
        except FederationRefused:
            raise
        except (FederationError, SyncAborted) as exc:
            if isinstance(exc, FederationError):
                log.warning("cluster %s: sync skipped: %s", self.t.name, exc)
            self.t.abort()
            q = None
        final = self.pacer.take_finishing() or final  # after the agreed stop: the last sync
        holding = q is not None and not q.shared and not final and self.membership.holding_start(q)
        if holding:  # alone before the first shared sync: keep the first anchor for those still coming
            self.t.abort()
            q = None
        if q is None:  # cut off: keep training from the local replica; try again after another interval
            self.records.missed(self.membership.sync_index + 1, self.pacer.local_steps, self.pacer.total_steps)
            self.pacer.missed(counted=not holding)
        else:
            self._run_sync(q, final)

    def _run_sync(self, q: Quorum, final: bool = False) -> None:
        assert self.driver is not None
        contributors = any(m.contributes for m in q.members)
        self.membership.syncing(q)
        self.records.step = self.pacer.total_steps
        extra, local_steps = self.pacer.extra() + self.probe.row(q.names), self.pacer.local_steps
        self.pacer.synced()
        if not contributors:
            self.t.abort()
            return
        if self.pacer.lockstep:  # what each member can have taken since the anchor it holds (judge.py)
            sched, top = self.cfg.schedule, self.cfg.schedule.steps_at(q.agreed_sync + 1)
            self.driver.core.steps_bound = [max(top - sched.steps_at(min(m.sync, q.agreed_sync)), 1)
                                            for m in q.members]
        else:  # a time schedule: the intervals since the anchor each holds (judge.time_caps)
            self.driver.core.sync_time_s, self.driver.core.min_steps = self.cfg.schedule.sync_time_s, \
                self.cfg.schedule.min_steps
            self.driver.core.missed = [bool(m.data.get("missed", 0)) for m in q.members]
            self.driver.core.first_sync = q.agreed_sync == 0
            self.driver.core.declared = [m.speed for m in q.members]
            self.driver.core.intervals_bound = [max(q.agreed_sync + 1 - min(m.sync, q.agreed_sync), 1)
                                                for m in q.members]
        self.driver.core.not_counted = [i for i, m in enumerate(q.members) if m.name in self.membership.rolled_back]
        driver = self.driver  # the final sync runs blocking in every mode: every cluster ends on θ̄
        if final and isinstance(driver, OverlapDriver):
            driver = BlockingDriver(driver.core, driver.on_complete, driver.on_abort, False, True)
        with suppress(SyncAborted):  # rolled back; local progress kept, the next interval retries
            self._exchanged(driver.begin(self.membership.sync_index, local_steps, extra))
            if final or self.cfg.mode == "at_end":
                driver.flush()

    def _exchanged(self, rows: Tensor | None) -> None:
        if rows is not None and (q := self.t.quorum) is not None:
            ignored = self.pacer.exchanged(rows, q.me, self._background_quorum and self.driver is not None,
                                           self.membership.sync_index)
            for i, why in ignored.items():
                self.suspects.name(q, i, f"voted to stop at sync {self.membership.sync_index}, not followed: {why}",
                                   kind="stop vote")

    def _completed(self, report: SyncReport) -> None:
        self.records.completed(report)
        self.probe.committed(report.quorum)
        self.membership.committed(report.sync)

    def _aborted(self, report: SyncReport, why: str) -> None:
        self.probe.dropped()
        q = self.t.quorum
        stalled = getattr(self.t, "take_stalled", lambda: [])()  # who never came to an exchange (transport.py)
        if q is not None:
            for i, m in enumerate(q.members):
                if m.name in stalled:
                    self.suspects.name(q, i, f"never came to an exchange of sync {report.sync} (the sync was lost): "
                                       "left out of the next quorums", kind="stalled")
        self.records.aborted(report, why)
        self.membership.aborted()

    # ------------------------------------------------------------------ the loop reads
    @property
    def blocked_s(self) -> float:
        return self.t.blocked_s

    @property
    def lockstep(self) -> bool:
        return self.pacer.lockstep

    def saves_at(self, step: int, every: int) -> bool:
        """Lockstep: is `step` where the checkpoint every `every` steps is taken (a sync boundary)?"""
        return self.cfg.schedule.saves_at(step, every)

    @property
    def global_step(self) -> int:
        return self.pacer.global_step

    @property
    def local_steps(self) -> int:
        """Steps since this cluster's last sync."""
        return self.pacer.local_steps

    @property
    def syncs_done(self) -> int:
        return self.records.syncs_done

    def stats(self) -> dict[str, Any]:
        return {**self.records.stats(), "healed_from": list(self.membership.healed_from)}

    def partition(self, seconds: float) -> None:
        self.t.partition(seconds)

    def close(self) -> None:
        self.t.close()
