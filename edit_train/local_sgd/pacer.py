"""When this cluster syncs, evaluates and stops: step or wall-clock (A-EDiT) intervals, the agreed stop.

The stop: a step schedule ends at train.steps, each cluster's own count, whatever anyone votes. Under a time
schedule (A-EDiT) or a time budget a stop needs a strict majority of the quorum (`stop_votes`): A-EDiT's
train.steps is the federation's — the run ends once a strict majority of the quorum's step counts, this
cluster's own included, reached it (the lower median of the counts did): one member's claim ends nothing. A
cluster faster than most trains on meanwhile, syncing at its planned intervals, up to `claims.time_bound` (the
claims the others accept; it stops there on its own). A vote for the time budget counts once this cluster's own
clock is within an interval of it.

The pacer counts local steps and measures seconds per step (compute only: time blocked on other clusters
is not this cluster's speed). A step schedule syncs every `interval` steps; A-EDiT plans
`Hᵢ = ⌊τ / secs_per_stepᵢ⌋` from the speeds exchanged at the last sync (its first interval ends once τ has
been spent). What the exchange carries back (every cluster's steps, speed, total steps and stop vote) moves
the agreed global step, the eval cadence and the stop. A time schedule's cluster that reaches `total_steps`
syncs at once with its stop vote (`at_target`), so the run ends at train.steps, not an interval past it.

Checkpoints of a time schedule (`checkpoint_due`): each cluster at its own pace, right after a sync (the
trainer lands it before saving, so the anchor, outer state and sync index saved are a committed sync's).
A cluster saves at the last sync before its own steps would pass `checkpoint_every` since its last
checkpoint: its next sync is planned (`planned` local steps away), so if waiting for it would leave more
than `checkpoint_every` steps unsaved, it saves now. A crash then loses at most `checkpoint_every` of its
steps (one planned interval when that is longer, or when it ran longer than planned).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.claims import time_bound
from edit_train.local_sgd.protocols import ClusterGroup
from edit_train.local_sgd.schedule import ScheduleConfig, StepTimer, TimePlanner


@dataclass
class PaceConfig:
    schedule: ScheduleConfig
    local_sgd: bool = True
    total_steps: int = 0  # step schedule: every cluster stops here; time: once most clusters reached it
    time_budget_s: float = 0.0  # stop at the exchange nearest to this many seconds (0 = off)
    eval_every: int = 0  # time schedule: evaluate when the agreed step crosses a multiple
    tokens_per_step: int = 0  # this cluster's tokens per local step (what its contribution is worth)
    checkpoint_every: int = 0  # time schedule: the most steps of this cluster a crash may lose (0 = no checkpoints)


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
        # a time schedule's cluster past train.steps has synced its stop vote once (`at_target`); until most
        # clusters vote to stop it syncs at its planned intervals again, not at every step
        self.target_voted = False
        self.eval_due = False
        self.checkpoint_due = False  # time schedule: save now (a sync has just been exchanged or missed)
        self.checkpoint_step = 0  # time schedule: this cluster's total steps at its last checkpoint
        self.vote = False  # this cluster's agreed stop vote, refreshed every local step
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
        """This cluster's vote at an exchange. With a time budget, stop at the exchange nearest to it:
        when half an interval more would already pass the budget."""
        now = time.time()
        over = self.cfg.time_budget_s > 0 and \
            (now - self._t0) + 0.5 * (now - self.last_exchange_t) >= self.cfg.time_budget_s
        return over or (not self.lockstep and self.total_steps >= self.cfg.total_steps)

    def agreed_vote(self) -> bool:
        """`want_stop` agreed by every rank of the cluster (any rank's yes)."""
        return self.agree(0.0, self.want_stop())[1]

    def agree(self, seconds: float, vote: bool) -> tuple[float, bool]:
        """The slowest rank's step time and any rank's stop vote (one tiny all-reduce inside the cluster,
        only when the decisions depend on local clocks)."""
        if not self.clocked or self.cluster.size <= 1:
            return seconds, vote
        t = torch.tensor([seconds, 1.0 if vote else 0.0], dtype=torch.float64, device=self.cluster.device)
        self.cluster.max_(t)
        return float(t[0].item()), bool(t[1].item() > 0)

    def should_stop(self, step: int) -> bool:
        """Under a step schedule: at train.steps. Under a time schedule: at the agreed stop, or on its own where
        the others' bound on its claims is (`claims.time_bound`): a fast cluster waiting for most clusters to
        reach train.steps never outruns what they accept from it."""
        if self.stopped:
            return not self.finishing
        if self.lockstep:
            return step >= self.cfg.total_steps
        return self.cfg.total_steps > 0 and step >= time_bound(self.cfg.total_steps)

    def local_step(self, step: int, compute_s: float) -> None:
        """A local-SGD step was taken (`compute_s`: its seconds, minus any time blocked on other clusters)."""
        if self.lockstep:
            self.global_step = step + 1
        self.local_steps += 1
        # a step whose seconds were all spent blocked on other clusters says nothing about this cluster's speed:
        # recorded as ~0 s it would plan τ / 1e-6 local steps, and the cluster would never sync (nor stop) again
        secs, self.vote = self.agree(max(compute_s, 0.0), self.want_stop())
        if secs > 0:
            self.timer.record(secs)

    @property
    def due(self) -> bool:
        first_timed = self.planned == 0 and self.timer.mean() * self.local_steps >= self.cfg.schedule.sync_time_s
        return (self.planned > 0 and self.local_steps >= self.planned) or first_timed or self.at_target

    @property
    def at_target(self) -> bool:
        """A time schedule's cluster that has just taken its `total_steps`-th step syncs now, with its stop vote,
        instead of at the end of its planned interval: the run ends at train.steps, not up to one (fast
        cluster's) interval past it."""
        return (not self.lockstep and not self.stopped and self.cfg.total_steps > 0 and self.local_steps > 0
                and self.total_steps >= self.cfg.total_steps and not self.target_voted)

    def extra(self) -> list[float]:
        """What this cluster tells the others at a sync (round.EXTRA)."""
        tokens = self.local_steps * (self.cfg.tokens_per_step or 1)
        return [float(self.local_steps), self.timer.mean(), float(self.total_steps), float(self.vote), float(tokens)]

    def synced(self) -> None:
        """A sync started with the local steps taken so far."""
        self.last_exchange_t = time.time()
        self.local_steps = 0
        if self.planner is None:  # to the next boundary: every `interval` steps unless they follow the lr
            self.planned = self.cfg.schedule.interval_after(self.total_steps)
        self.timer.reset()

    def missed(self) -> None:
        """Cut off: keep training from the local replica; try again after another interval."""
        self.last_exchange_t = time.time()
        base = self.cfg.schedule.interval_after(self.total_steps) if self.planner is None else max(self.planned, 1)
        self.planned = self.local_steps + base
        self._plan_checkpoint()  # cut off for long: its local progress is saved too

    def exchanged(self, rows: Tensor, position: int, background_quorum: bool) -> dict[int, str]:
        """Every cluster's [local_steps, secs/step, total_steps, stop vote] from a committed exchange.
        Returns the stop votes not followed ({row: why}): nothing one member says stops the others (`stop_votes`)."""
        if not self.lockstep:
            before = self.global_step
            self.global_step = int(rows[:, 2].max().item())
            every = self.cfg.eval_every
            self.eval_due = self.eval_due or (every > 0 and self.global_step // every > before // every)
        stop, ignored = self.stop_votes(rows, position)
        self.target_voted = self.target_voted or (self.cfg.total_steps > 0 and self.total_steps >= self.cfg.total_steps)
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
        """(stop now?, the other members' yes votes not followed and why). A step schedule ends at train.steps,
        each cluster's own count: no vote stops it. Under a time schedule or a time budget the stop needs a
        strict majority of the quorum, each vote checked against this cluster's own clock and the terms: a vote
        for the budget counts once this cluster's own clock is within an interval of it, a vote for train.steps
        only from a member whose own count reached it (so the run ends once a strict majority of the counts did:
        their lower median). This cluster's own vote is its own clock's and count's."""
        yes = [i for i in range(rows.shape[0]) if float(rows[i, 3]) > 0 and i != position]
        if not self.clocked:
            return False, {i: "a step schedule ends at train.steps" for i in yes}
        now = time.time()
        near_budget = self.cfg.time_budget_s > 0 and \
            (now - self._t0) + (now - self.last_exchange_t) >= self.cfg.time_budget_s
        ignored: dict[int, str] = {}
        counted = 1 if float(rows[position, 3]) > 0 else 0
        for i in yes:
            if near_budget or (not self.lockstep and float(rows[i, 2]) >= self.cfg.total_steps > 0):
                counted += 1
            else:
                ignored[i] = "this cluster's own clock is not near the time budget and its step count is not " \
                    "past train.steps"
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
        """This cluster's step count after a step (`total_steps`: written here only; tests/test_layout.py)."""
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
                "checkpoint_step": self.checkpoint_step}

    def load(self, state: dict[str, Any]) -> None:
        self.local_steps = int(state["local_steps"])
        self.timer.load_state_dict(state["timer"])
        self.planned = int(state.get("planned", self.planned))
        self.global_step = int(state.get("global_step", 0))
        self.total_steps = int(state.get("total_steps", 0))  # the quorum compares it (lockstep step adoption)
        self.checkpoint_step = int(state.get("checkpoint_step", self.total_steps))
