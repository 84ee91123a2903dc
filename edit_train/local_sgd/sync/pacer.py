"""When this cluster syncs, evaluates and stops: step or wall-clock (A-EDiT) intervals, the stop.

The stop. A step schedule ends at train.steps, each cluster's own count, whatever anyone votes. A time schedule
(A-EDiT) ends after a number of syncs every cluster counts itself: `run_syncs` = ⌈(train.steps − warm-up) /
algo.interval⌉ syncs of τ seconds each, so a cluster that takes `algo.interval` steps per interval takes
train.steps steps, a faster one more and a slower one fewer, and the run lasts about that many intervals of wall
time whatever the speeds. It ends at the exchange of that sync (the agreed sync index, `Membership.sync_index`),
on every member at once: nobody's vote or step count ends or extends it. A cluster cut off for good stops on its
own once its own intervals (syncs joined or missed) pass the run's syncs by a margin (`own_margin`).

A time budget (`train.time_budget_s`) is the one stop that is voted: it needs a strict majority of the quorum
(`stop_votes`), each vote counted only once this cluster's own clock is within an interval of the budget; and a
cluster whose own clock passed the budget by one interval stops on its own (a member that withholds its vote
holds nobody).

The pacer counts local steps and measures seconds per step (compute only: time blocked on other clusters
is not this cluster's speed). A step schedule syncs every `interval` steps; A-EDiT plans
`Hᵢ = ⌊τ / secs_per_stepᵢ⌋` from the speeds exchanged at the last sync (its first interval ends once τ has
been spent). What the exchange carries back (every cluster's steps, speed, total steps and stop vote) moves
the agreed global step (for display and the eval cadence) and the time budget's stop.

Checkpoints of a time schedule (`checkpoint_due`): each cluster at its own pace, right after a sync (the
trainer lands it before saving, so the anchor, outer state and sync index saved are a committed sync's).
A cluster saves at the last sync before its own steps would pass `checkpoint_every` since its last
checkpoint: its next sync is planned (`planned` local steps away), so if waiting for it would leave more
than `checkpoint_every` steps unsaved, it saves now. A crash then loses at most `checkpoint_every` of its
steps (one planned interval when that is longer, or when it ran longer than planned).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.aggregation.claims import time_bound
from edit_train.local_sgd.protocols import ClusterGroup
from edit_train.local_sgd.sync.schedule import ScheduleConfig, StepTimer, TimePlanner


@dataclass
class PaceConfig:
    schedule: ScheduleConfig
    local_sgd: bool = True
    total_steps: int = 0  # step schedule: every cluster stops here; time: sets the run's syncs (`run_syncs`)
    time_budget_s: float = 0.0  # stop at the exchange nearest to this many seconds (0 = off)
    eval_every: int = 0  # time schedule: evaluate when the agreed step crosses a multiple
    tokens_per_step: int = 0  # this cluster's tokens per local step (what its contribution is worth)
    checkpoint_every: int = 0  # time schedule: the most steps of this cluster a crash may lose (0 = no checkpoints)


def run_syncs(schedule: ScheduleConfig, total_steps: int) -> int:
    """A time schedule's length in syncs: ⌈(train.steps − warm-up) / algo.interval⌉ (0: no train.steps)."""
    if total_steps <= 0:
        return 0
    return max(1, math.ceil(max(total_steps - schedule.warmup_steps, 0) / max(schedule.interval, 1)))


def own_margin(syncs: int) -> int:
    """How many intervals past the run's syncs a cluster that never learns of the end (cut off) keeps trying."""
    return max(2, syncs // 10)


class Pacer:
    def __init__(self, cfg: PaceConfig, cluster: ClusterGroup) -> None:
        self.cfg, self.cluster = cfg, cluster
        self.planner = TimePlanner(cfg.schedule) if cfg.schedule.kind == "time" else None
        # local steps before the next sync; a time schedule's first interval is planned from this cluster's
        # own step times (nothing has been exchanged yet): sync once τ has been spent
        self.planned = cfg.schedule.interval_after(cfg.schedule.warmup_steps) if self.planner is None else 0
        self.timer = StepTimer()
        self.local_steps = 0
        self.total_steps = 0  # this cluster's steps so far
        self.global_step = 0  # max over clusters, as of the last exchange
        self.stopped = False  # every cluster agreed to stop (time schedule / time budget)
        self.finishing = False  # A-EDiT + overlap after the agreed stop: step until the final quorum is issued
        self.eval_due = False
        self.checkpoint_due = False  # time schedule: save now (a sync has just been exchanged or missed)
        self.checkpoint_step = 0  # time schedule: this cluster's total steps at its last checkpoint
        self.intervals = 0  # time schedule: intervals this cluster ended (syncs joined or missed)
        self.missed_since = 0  # intervals missed since the last sync began (said in its quorum record)
        self.syncs = run_syncs(cfg.schedule, cfg.total_steps) if self.planner is not None else 0
        self.vote = False  # this cluster's agreed stop vote, refreshed every local step
        self.overdue = False  # a time budget passed by an interval on this cluster's clock (agreed by its ranks)
        self._t0 = self.last_exchange_t = time.time()

    @property
    def lockstep(self) -> bool:
        """Do all clusters take the same number of steps (so step-based stop/eval is agreed)?"""
        return not (self.cfg.local_sgd and self.cfg.schedule.kind == "time")

    @property
    def clocked(self) -> bool:
        """Do decisions depend on local clocks (so the ranks of a cluster must agree on them)?"""
        return not self.lockstep or self.cfg.time_budget_s > 0

    def want_stop(self) -> bool:
        """This cluster's vote at an exchange: with a time budget, stop at the exchange nearest to it (when half
        an interval more would already pass the budget). Nothing else is voted."""
        now = time.time()
        return self.cfg.time_budget_s > 0 and \
            (now - self._t0) + 0.5 * (now - self.last_exchange_t) >= self.cfg.time_budget_s

    def agreed_vote(self) -> bool:
        """`want_stop` agreed by every rank of the cluster (any rank's yes)."""
        return self.agree(0.0, self.want_stop())[1]

    def agree(self, seconds: float, vote: bool, overdue: bool = False) -> tuple[float, bool, bool]:
        """The slowest rank's step time, any rank's stop vote and any rank's `overdue` (one tiny all-reduce
        inside the cluster, only when the decisions depend on local clocks)."""
        if not self.clocked or self.cluster.size <= 1:
            return seconds, vote, overdue
        t = torch.tensor([seconds, float(vote), float(overdue)], dtype=torch.float64, device=self.cluster.device)
        self.cluster.max_(t)
        return float(t[0].item()), bool(t[1].item() > 0), bool(t[2].item() > 0)

    def _overdue(self) -> bool:
        """A time schedule's own clock past a time budget by one interval (the cluster stops on its own)."""
        budget = self.cfg.time_budget_s
        return not self.lockstep and budget > 0 and \
            time.time() - self._t0 >= budget + self.cfg.schedule.sync_time_s

    def should_stop(self, step: int) -> bool:
        """Under a step schedule: at train.steps. Under a time schedule: at the run's last sync (`exchanged`), or
        on its own — its own intervals past the run's syncs by `own_margin` (cut off, it never heard of the end),
        its own clock past a time budget by one interval (a member withholding its vote holds nobody), or where
        the others' bound on its claims is (`claims.time_bound`)."""
        if self.stopped:
            return not self.finishing
        if self.lockstep:
            return step >= self.cfg.total_steps
        if self.syncs > 0 and self.intervals >= self.syncs + own_margin(self.syncs):
            return True
        if self.overdue:
            return True
        return self.cfg.total_steps > 0 and step >= time_bound(self.cfg.total_steps)

    def local_step(self, step: int, compute_s: float) -> None:
        """A local-SGD step was taken (`compute_s`: its seconds, minus any time blocked on other clusters)."""
        if self.lockstep:
            self.global_step = step + 1
        self.local_steps += 1
        # a step whose seconds were all spent blocked on other clusters says nothing about this cluster's speed:
        # recorded as ~0 s it would plan τ / 1e-6 local steps, and the cluster would never sync (nor stop) again
        secs, self.vote, self.overdue = self.agree(max(compute_s, 0.0), self.want_stop(), self._overdue())
        if secs > 0:
            self.timer.record(secs)

    @property
    def due(self) -> bool:
        first_timed = self.planned == 0 and self.timer.mean() * self.local_steps >= self.cfg.schedule.sync_time_s
        return (self.planned > 0 and self.local_steps >= self.planned) or first_timed

    def extra(self) -> list[float]:
        """What this cluster tells the others at a sync (round.EXTRA)."""
        tokens = self.local_steps * (self.cfg.tokens_per_step or 1)
        return [float(self.local_steps), self.timer.mean(), float(self.total_steps), float(self.vote), float(tokens)]

    def synced(self) -> None:
        """A sync started with the local steps taken so far."""
        self.last_exchange_t = time.time()
        self.local_steps = 0
        self.intervals += 1
        self.missed_since = 0
        if self.planner is None:  # to the next boundary: every `interval` steps unless they follow the lr
            self.planned = self.cfg.schedule.interval_after(self.total_steps)
        self.timer.reset()

    def missed(self, counted: bool = True) -> None:
        """Cut off: keep training from the local replica; try again after another interval. Not `counted` toward
        the run's syncs: a fresh start still waiting for the configured clusters (`Membership.holding_start`)."""
        self.last_exchange_t = time.time()
        self.intervals += 1 if counted else 0
        self.missed_since += 1
        base = self.cfg.schedule.interval_after(self.total_steps) if self.planner is None else max(self.planned, 1)
        self.planned = self.local_steps + base
        self._plan_checkpoint()  # cut off for long: its local progress is saved too

    def exchanged(self, rows: Tensor, position: int, background_quorum: bool, sync: int = 0) -> dict[int, str]:
        """Every cluster's [local_steps, secs/step, total_steps, stop vote] from the exchange of sync `sync` (the
        agreed version it makes). Returns the stop votes not followed ({row: why}): nothing one member says stops
        the others (`stop_votes`). A time schedule ends here once `sync` reaches the run's syncs."""
        if not self.lockstep:
            before = self.global_step
            self.global_step = int(rows[:, 2].max().item())
            every = self.cfg.eval_every
            self.eval_due = self.eval_due or (every > 0 and self.global_step // every > before // every)
        stop, ignored = self.stop_votes(rows, position)
        stop = stop or (self.syncs > 0 and sync >= self.syncs)
        if stop and not self.stopped:
            self.stopped = True
            # ask for the final quorum in the background and keep training until every cluster has asked:
            # the cluster that learns of the stop first does not wait for the others to learn of it
            self.finishing = background_quorum
        if self.planner is not None:
            self.planned = self.planner.steps_for(float(rows[position, 1]))
            self._plan_checkpoint()
        return ignored

    def stop_votes(self, rows: Tensor, position: int) -> tuple[bool, dict[int, str]]:
        """(stop now?, the other members' yes votes not followed and why). Only a time budget is voted: a step
        schedule ends at train.steps and a time schedule at its run's syncs, each counted by every cluster itself.
        With a time budget the stop needs a strict majority of the quorum, a vote counted once this cluster's own
        clock is within an interval of the budget. This cluster's own vote is its own clock's."""
        yes = [i for i in range(rows.shape[0]) if float(rows[i, 3]) > 0 and i != position]
        if self.cfg.time_budget_s <= 0:
            why = "a step schedule ends at train.steps" if self.lockstep else \
                "a time schedule ends at its run's syncs, which every cluster counts itself"
            return False, {i: why for i in yes}
        now = time.time()
        near_budget = (now - self._t0) + (now - self.last_exchange_t) >= self.cfg.time_budget_s
        ignored: dict[int, str] = {}
        counted = 1 if float(rows[position, 3]) > 0 else 0
        for i in yes:
            if near_budget:
                counted += 1
            else:
                ignored[i] = "this cluster's own clock is not near the time budget"
        stop = 2 * counted > rows.shape[0]
        if not stop:
            for i in yes:
                ignored.setdefault(i, f"{counted} of {rows.shape[0]} votes to stop count: not a strict majority")
        return stop, ignored

    def take_due(self) -> tuple[bool, bool]:
        """(eval due, checkpoint due) once each, since the last call; neither after the agreed stop."""
        due = (self.eval_due and not self.stopped, self.checkpoint_due and not self.stopped)
        self.eval_due = self.checkpoint_due = False
        return due

    def _plan_checkpoint(self) -> None:
        """Time schedule: save now if waiting for the next planned sync would leave more than
        `checkpoint_every` of this cluster's steps unsaved (see the module docstring)."""
        every = self.cfg.checkpoint_every
        if every <= 0 or self.planner is None or self.stopped:
            return
        next_sync = self.total_steps + max(self.planned - self.local_steps, 0)
        if next_sync - self.checkpoint_step > every and self.total_steps > self.checkpoint_step:
            self.checkpoint_due = True
            self.checkpoint_step = self.total_steps

    # ------------------------------------------------------------ the one writer of the step count and the stop
    def stepped(self, total: int) -> None:
        """This cluster's step count after a step (`total_steps`: written here only; tests/docs/test_code_layout.py)."""
        self.total_steps = total

    def adopt(self, total: int) -> int:
        """The federation's step count, taken on (healed, admitted behind); returns it."""
        self.total_steps = total
        return total

    def stop_agreed(self, stop: bool) -> None:
        """ddp / warm-up: the gradient exchange agreed to stop (`stopped`: written here only)."""
        self.stopped = self.stopped or stop

    def take_finishing(self) -> bool:
        """After the agreed stop: whether this is the last sync (once)."""
        finishing, self.finishing = self.finishing, False
        return finishing

    # ------------------------------------------------------------ checkpoint
    def state_json(self) -> dict[str, Any]:
        return {"local_steps": self.local_steps, "timer": self.timer.state_dict(),
                "planned": self.planned, "global_step": self.global_step, "total_steps": self.total_steps,
                "checkpoint_step": self.checkpoint_step, "intervals": self.intervals}

    def load(self, state: dict[str, Any]) -> None:
        self.local_steps = int(state["local_steps"])
        self.timer.load_state_dict(state["timer"])
        self.planned = int(state.get("planned", self.planned))
        self.global_step = int(state.get("global_step", 0))
        self.total_steps = int(state.get("total_steps", 0))  # the quorum compares it (lockstep step adoption)
        self.checkpoint_step = int(state.get("checkpoint_step", self.total_steps))
        self.intervals = int(state.get("intervals", 0))
