"""Overlapped sync: the cross-group reduction of interval k runs while interval k+1's local steps go on.

At the sync point each rank snapshots its shard (θ_snap), sums Δ = θ̄ − θ_snap's squared norms inside
its group and starts the tiny cross-group norm exchange asynchronously; local steps continue. At each
later step boundary `poll()` advances the state machine without blocking:

  gathering → (norms landed) decide weights, launch the weighted SUM all-reduce of every module
  reducing  → (reduction landed) launch the commit vote (a one-value all-gather among the participants)
  voting    → (every participant voted yes) clip, outer step, θ ← θ̄_new + (θ − θ_snap)

so local progress made meanwhile is carried over exactly. Ranks of one group agree on "landed" with
a one-scalar MIN all-reduce over the group (intra-cluster), because the clip norm is a group collective.
Extra memory: the snapshot (one shard-sized buffer) plus the reduction buffer every sync needs.
Nothing is applied before every reduction landed and every participant voted to commit; a sync that
loses a participant is dropped whole (anchors untouched, local progress kept).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from edit_train.cluster.collectives import shard_sum_
from edit_train.federation.link import FederationError, Pending
from edit_train.local_sgd.penalty import clip_coef_from_sqnorm, weighted
from edit_train.local_sgd.sync import SyncEngine, SyncReport


class OverlapSync:
    def __init__(self, engine: SyncEngine) -> None:
        self.e = engine
        self.phase = "idle"  # idle | gathering | reducing | voting
        self._snap: dict[str, list[Tensor]] = {}
        self._gather: tuple[Pending, list[Tensor]] | None = None
        self._reduce: dict[str, tuple[Pending, list[Tensor]]] = {}
        self._vote: tuple[Pending, list[Tensor]] | None = None
        self._report: SyncReport | None = None
        self._extra_n = 0
        self.gathered_extra: Tensor | None = None

    @property
    def pending(self) -> bool:
        return self.phase != "idle"

    @torch.no_grad()
    def begin(self, sync_index: int, local_steps: int, extra: list[float]) -> None:
        e = self.e
        assert self.phase == "idle", "previous overlapped sync still in flight"
        self._report = SyncReport(sync=sync_index, local_steps=local_steps,
                                  participants=[m.name for m in e.comm.members], position=e.comm.position)
        sq = torch.zeros(len(e.units), dtype=torch.float64, device=e.comm.device)
        for i, unit in enumerate(e.units):
            live = unit.live()
            e.outer.params[unit.name] = live
            self._snap[unit.name] = [t.detach().clone() for t in live]
            sq[i] = sum(float(d.double().pow(2).sum()) for d in e.outer.pseudo_grad(unit.name))
        shard_sum_(sq, e.shard_pg, e.shard_size)
        vec = torch.cat([sq, torch.tensor(extra, dtype=torch.float64, device=sq.device)])
        bytes0 = e.comm.bytes_sent
        self._gather = e.comm.all_gather_async(vec)
        self._report.bytes += e.comm.bytes_sent - bytes0
        self._extra_n = len(extra)
        self.phase = "gathering"

    def _group_ready(self, ready: bool) -> bool:
        """All ranks of the group must take the same branch (the next steps are group collectives)."""
        e = self.e
        if e.shard_pg is None or e.shard_size <= 1:
            return ready
        flag = torch.tensor([1.0 if ready else 0.0], device=e.comm.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=e.shard_pg)
        return bool(flag.item() > 0)

    @torch.no_grad()
    def poll(self, block: bool = False) -> bool:
        """Advance without blocking (unless `block`). Returns True when the sync is over (applied or
        dropped: `self.dropped` says which)."""
        try:
            return self._poll(block)
        except FederationError as exc:
            self._drop(str(exc))
            return True

    def _drop(self, why: str) -> None:
        e, report = self.e, self._report
        for pending, _ in [*self._reduce.values(), *([self._vote] if self._vote else [])]:
            pending.done = True
        self._reduce.clear()
        self._vote = None
        self._snap.clear()
        self._gather = None
        self.phase = "idle"
        self._report = None
        self.dropped = True
        e.comm.abort()
        if report is not None and e.on_abort is not None:
            e.on_abort(report, why)

    def _poll(self, block: bool) -> bool:
        self.dropped = False
        if self.phase == "gathering":
            pending, out = self._gather  # type: ignore[misc]
            if not (block or self._group_ready(pending.ready())):
                return False
            self._report.blocked_s += pending.wait()  # type: ignore[union-attr]
            self._decide(torch.stack(out).cpu())
            if self.phase == "idle":
                return True
        if self.phase == "reducing":
            if not (block or self._group_ready(all(p.ready() for p, _ in self._reduce.values()))):
                return False
            self._start_vote()
        if self.phase == "voting":
            if not (block or self._group_ready(self._vote is None or self._vote[0].ready())):
                return False
            self._apply()
            return True
        return self.phase == "idle"

    def _decide(self, gathered: Tensor) -> None:
        e, report = self.e, self._report
        assert report is not None
        n = len(e.units)
        self.gathered_extra = gathered[:, n:]
        e.report = report
        e.decide_all(gathered, local_steps_col=0 if self._extra_n else None)
        e.report = None
        for unit in e.units:
            w = report.decisions[unit.name].weights[report.position]
            anchor = e.outer.anchors[unit.name]
            delta = weighted([a.to(s.device) - s.to(a.dtype) for a, s in zip(anchor, self._snap[unit.name])],
                             float(w))
            bytes0 = e.comm.bytes_sent
            self._reduce[unit.name] = (e.comm.all_reduce_(delta, async_op=True, params=unit.params, key=unit.name), delta)
            report.bytes += e.comm.bytes_sent - bytes0
        self.phase = "reducing"

    def _start_vote(self) -> None:
        """Every reduction landed here: vote to commit without waiting for the others to land theirs (a
        blocking vote would wait for the slowest participant's next step boundary)."""
        report = self._report
        assert report is not None
        for pending, _ in self._reduce.values():
            report.blocked_s += pending.wait()
        comm = self.e.comm
        self._vote = comm.all_gather_async(torch.ones(1, dtype=torch.float64), "commit vote") if comm.active else None
        self.phase = "voting"

    def _apply(self) -> None:
        e, report = self.e, self._report
        assert report is not None
        if self._vote is not None:
            pending, votes = self._vote
            report.blocked_s += pending.wait()
            self._vote = None
            if min(float(v.item()) for v in votes) <= 0:
                raise FederationError("a participant did not commit")
        for unit in e.units:
            _, delta = self._reduce.pop(unit.name)
            live = unit.live()
            e.outer.params[unit.name] = live
            decision = report.decisions[unit.name]
            if not decision.all_anomalous:
                sq = torch.tensor([sum(float(d.double().pow(2).sum()) for d in delta)], dtype=torch.float64,
                                  device=e.comm.device)
                coef = clip_coef_from_sqnorm(float(shard_sum_(sq, e.shard_pg, e.shard_size)), e.aggregator.cfg)
                if coef != 1.0:
                    delta = [d * coef for d in delta]
                e.outer.step(unit.name, delta)
                report.clip[unit.name] = coef
            else:
                report.clip[unit.name] = 0.0
            # θ ← θ̄_new + (θ − θ_snap): the local progress made while the reduction was in flight;
            # a non-finite (θ − θ_snap) (replica went NaN/inf before or after the snapshot) → θ ← θ̄_new
            for p, s in zip(live, self._snap[unit.name]):
                p.sub_(s)  # (θ − θ_snap) first: exact when no progress
            finite = all(bool(torch.isfinite(p).all()) for p in live)
            for p, a in zip(live, e.outer.anchors[unit.name]):
                p.add_(a.to(p.device, p.dtype)) if finite else p.copy_(a.to(p.device, p.dtype))
        self._snap.clear()
        self.phase = "idle"
        self._report = None
        if e.on_complete is not None:
            e.on_complete(report)

    def state_ok_for_checkpoint(self) -> bool:
        return self.phase == "idle"

