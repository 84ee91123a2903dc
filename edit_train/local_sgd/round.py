"""One sync round — the only place the EDiT sync sequence exists — and the one re-base.

    exchange   each rank sums ‖Δ‖² per unit over its cluster; the leaders all-gather one small vector
               ([‖Δ‖² per unit ‖ last committed round ‖ local steps, s/step, total steps, stop vote, tokens ‖
               probe scores]) across the quorum
    decide     the aggregation rule (`rules.py`) weighs every participant, module by module
    launch     w·Δ of a unit goes into the transport's SUM reduction, or Δ to every participant (gathered)
    land       wait for a unit's reduced Δ (gathered: judge every contribution, sum them here); a non-finite
               one can never be applied (the round votes no)
    apply      clip → (take back what the probe showed harmful, `retract.py`) → outer step → re-base the live
               parameters on the new anchor
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
from edit_train.local_sgd.penalty import Decision, clip_factor, weighted
from edit_train.local_sgd.evidence import buckets, measure, probe_medians, shard_positions, snap
from edit_train.local_sgd.protocols import Contributions, Handle, Transport
from edit_train.local_sgd.retract import NONE, Applied, Retraction, marker_of
from edit_train.local_sgd.rules import Aggregator, Evidence

log = logging.getLogger(__name__)

T = TypeVar("T")
EXTRA = ("local_steps", "secs_per_step", "total_steps", "stop_vote", "tokens")  # per-cluster scalars of the exchange


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
    gather_max: int = 4  # up to this many participants every one receives every contribution and judges it
    sketch_dim: int = 0  # count-sketch buckets per module for the rule's direction test (0: none)
    keep: Callable[[str, list[Tensor], Contributions], None] | None = None  # (unit, old anchor, contributions)
    kept: bool = False  # the last round left unsent parts in the live parameters (sync.unsent=keep)
    retract: Retraction | None = None  # gathered: take back an update the probe showed harmful (retract.py)

    def __post_init__(self) -> None:
        self.index = {u.name: i for i, u in enumerate(self.units)}
        self._hashed: dict[tuple[str, bool], tuple[Tensor, Tensor] | None] = {}

    def hashed(self, name: str, whole: bool) -> tuple[Tensor, Tensor] | None:
        """The count sketch's buckets and signs for unit `name`: its whole flat Δ, or this rank's shard
        (computed once)."""
        if self.sketch_dim <= 0:
            return None
        key = (name, whole)
        if key not in self._hashed:
            params, cluster = self.unit(name).params, self.transport.cluster
            if whole:
                pos = torch.arange(sum(p.numel() for p in params), dtype=torch.int64)
            else:
                pos = torch.cat(shard_positions(params, cluster.rank, cluster.size))
            self._hashed[key] = buckets(pos, self.sketch_dim)
        return self._hashed[key]

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
    sizes: dict[str, int] = field(default_factory=dict)  # parameters per unit (for the effective weight)
    nonfinite: list[str] = field(default_factory=list)  # units whose reduced Δ was non-finite
    retracted: dict[str, dict[str, Any]] = field(default_factory=dict)  # cluster -> {sync, probe}: taken back


class SyncRound:
    """One sync of one cluster: exchange → decide → (launch → land → apply) per unit → commit/roll back.

    `eager=True` applies each unit as soon as it lands and keeps an undo record until the vote (layer-wise:
    the next forward needs θ̄_new); `eager=False` applies nothing before the vote passed, re-basing on the
    snapshot taken at `exchange` (overlap: local steps go on meanwhile)."""

    def __init__(self, core: SyncCore, sync: int, local_steps: int, eager: bool) -> None:
        q = core.transport.quorum
        assert q is not None, "a round needs an issued quorum"
        self.core, self.eager, self.shared = core, eager, q.shared
        # judge what was sent: every participant receives every contribution (a few clusters), else a SUM of
        # w·Δ decided from the norms each one reported
        self.gather = q.shared and len(q.members) <= core.gather_max
        self.report = SyncReport(sync, local_steps, q.names, q.me, sizes={u: core.outer.numel(u) for u in core.index})
        self.meta: dict[str, Tensor] = {}  # per participant: reported norms, steps, tokens, probe scores
        self.todo = [u.name for u in core.units]  # in unit order
        self.snap: dict[str, list[Tensor]] = {}
        self.inflight: dict[str, tuple[Handle[Any], list[Tensor]]] = {}
        self.landed: dict[str, list[Tensor]] = {}
        self.undo: dict[str, Any] = {}
        self.sqnorm: dict[str, float] = {}  # gathered: ‖Σ wᵢΔᵢ‖² per unit, from the Gram matrix
        self.ok = True  # False once something makes this cluster vote no
        # what this round applies, for a later verdict (gathered rounds only); who of the last round to take back
        self.applied = Applied(sync, marker_of(q.nonce), q.names) if self.gather and core.retract else None
        self.taking: dict[str, float] = {}
        # error feedback: what a rolled-back round sent was never applied, so its residuals are forgotten
        _feedback(core, "mark")
        core.kept = False

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
        mark = c.retract.marker if c.retract is not None else NONE  # the round this cluster last committed
        vec = torch.cat([sq, torch.tensor([mark, *extra], dtype=torch.float64, device=sq.device)])
        return self._counted(lambda: c.transport.all_gather(vec, "norm exchange"))

    def gathered(self, handle: Handle[Tensor]) -> Tensor:
        """Wait for the exchange ([‖Δ‖² per unit ‖ last committed round ‖ EXTRA ‖ probe score of every
        participant's last update]); in SUM mode decide every module now. Returns the EXTRA columns
        [participants, len(EXTRA)]."""
        full = self._wait(handle).cpu()
        n, k = len(self.core.units), len(EXTRA)
        norms, marks = full[:, :n].clamp_min(0).sqrt(), full[:, n]
        rows = torch.cat([full[:, :n], full[:, n + 1:]], dim=1)  # without the marker column
        scores = rows[:, n + k:]
        if scores.shape[1] != rows.shape[0]:  # nobody sent probe scores for this quorum
            scores = torch.full((rows.shape[0], rows.shape[0]), math.nan, dtype=torch.float64)
        self.meta = {"reported": norms, "steps": rows[:, n].clone(), "tokens": rows[:, n + EXTRA.index("tokens")],
                     "probe": probe_medians(scores)}
        if self.core.retract is not None and self.gather:
            self.taking = self.core.retract.plan(self.report.participants, marks, self.meta["probe"])
            self.report.retracted = self.core.retract.described(self.taking)
        if not self.gather:
            for i, unit in enumerate(self.core.units):
                self.report.decisions[unit.name] = self.core.rule.decide(self._evidence(unit.name, norms[:, i], {}))
        self.report.cluster_norm = float(norms[self.report.position].pow(2).sum().sqrt())
        return rows[:, n:n + k]

    def _evidence(self, name: str, norms: Tensor, measured: dict[str, Tensor]) -> Evidence:
        steps = self.meta["steps"]
        i = self.core.index[name]
        extra = {"reported": self.meta["reported"][:, i].clone(), "tokens": self.meta["tokens"].clone(),
                 "probe": self.meta["probe"].clone(), "sync": torch.tensor(self.report.sync), **measured}
        return Evidence(name, tuple(self.report.participants), norms.clone(), steps.clone(),
                        tuple(bool(s > 0) for s in steps.tolist()), extra)

    # ------------------------------------------------------------------ per unit
    def _delta(self, name: str) -> list[Tensor]:
        outer = self.core.outer
        if name in self.snap:
            return [a.to(s.device) - s.to(a.dtype) for a, s in zip(outer.anchors[name], self.snap[name])]
        return outer.pseudo_grad(name)

    @torch.no_grad()
    def launch(self, name: str) -> None:
        """Start moving unit `name`'s contribution (once): Δ itself to be gathered, or w·Δ into a SUM."""
        if name in self.inflight or name in self.landed or name not in self.todo:
            return
        c = self.core
        unit = c.unit(name)
        c.outer.params[name] = unit.live()
        c.outer.prefetch(name)
        if self.gather:
            delta = self._delta(name)
            self.inflight[name] = (self._counted(lambda: c.transport.gather(delta, unit.params, name)), delta)
            return
        w = self.report.decisions[name].weights[self.report.position]
        delta = weighted(self._delta(name), float(w))
        self.inflight[name] = (self._counted(lambda: c.transport.reduce_(delta, unit.params, name)), delta)

    def ready(self, name: str) -> bool:
        return name in self.landed or (name in self.inflight and self.inflight[name][0].ready())

    @torch.no_grad()
    def land(self, name: str) -> None:
        """Wait for unit `name`'s contributions (raises FederationError when a participant was lost); gathered,
        judge them and sum them here. A non-finite result can never be applied: this cluster votes no."""
        self.launch(name)
        handle, delta = self.inflight.pop(name)
        got = self._wait(handle)
        if self.gather:
            delta = self._judge(name, got)
        if not all(bool(torch.isfinite(d).all()) for d in delta):
            self.report.nonfinite.append(name)
            self.ok = False
        self.landed[name] = delta

    def _judge(self, name: str, got: Contributions) -> list[Tensor]:
        """The rule decides on what every participant sent (its Gram matrix, finiteness, sketches); the
        weighted sum is taken here, in participant order, identically on every cluster."""
        c = self.core
        m = measure(got, c.transport.cluster, lambda whole: c.hashed(name, whole), c.sketch_dim)
        measured = {"gram": m.gram, "finite": torch.tensor(m.finite), "exact": torch.tensor(c.transport.exact)}
        if m.sketches is not None:
            measured["sketches"] = m.sketches
        decision = c.rule.decide(self._evidence(name, m.norms, measured))
        w = [snap(float(x)) if ok else 0.0 for x, ok in zip(decision.weights, m.finite)]
        decision.weights = w
        self.report.decisions[name] = decision
        if self.applied is not None:
            self.applied.add(name, got.parts, w)
        used = [i for i, x in enumerate(w) if x != 0.0]
        wt = torch.tensor([w[i] for i in used], dtype=torch.float64)
        self.sqnorm[name] = float(wt @ m.gram[used][:, used] @ wt) if used else 0.0
        if c.keep is not None:
            c.keep(name, [a.detach().clone() for a in c.outer.anchors[name]], got)
        total = [torch.zeros_like(d, dtype=torch.float32) for d in got.parts[self.report.position]]
        for i in used:  # participant order: the same sum on every cluster
            for t, part in zip(total, got.parts[i]):
                t.add_(part.to(t.dtype), alpha=w[i])
        return total

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
        back = c.retract.term(name, self.taking) if c.retract is not None and name not in report.nonfinite else None
        if decision.all_anomalous or name in report.nonfinite:
            report.clip[name] = 0.0  # no outer step; every cluster lands on the anchor it had
            if back is not None:  # ... except for taking back a harmful update of the last round
                c.outer.step(name, [-b for b in back])
        else:
            if name in self.sqnorm:  # gathered: wᵀGw from the Gram matrix, the same number on every cluster
                sq = self.sqnorm.pop(name)
            else:
                t = torch.tensor([sum(float(d.double().pow(2).sum()) for d in delta)], dtype=torch.float64,
                                 device=c.transport.cluster.device)
                sq = float(c.transport.cluster.sum_(t))
            coef = clip_factor(sq, c.clip)
            step = [d * coef for d in delta] if coef != 1.0 else delta
            c.outer.step(name, step if back is None else [d - b.to(d.device, d.dtype) for d, b in zip(step, back)])
            report.clip[name] = coef
            if self.applied is not None:
                self.applied.clipped(name, coef)
        rebase(live, c.outer.anchors[name], self.snap.pop(name, None))
        self._keep_unsent(name, live, decision)
        c.outer.release(name)
        self.todo.remove(name)

    def _keep_unsent(self, name: str, live: list[Tensor], decision: Decision) -> None:
        """`sync.unsent=keep`: θ ← θ̄_new − e, the part e of this cluster's Δ that top-k left out (a SUM
        carried w·Δ: e/w). A cluster whose contribution was left out lands on θ̄ and lets e go with it."""
        take = getattr(self.core.transport, "take_unsent", None)
        unsent = take(live, self.core.unit(name).params, name) if take is not None else None
        w = float(decision.weights[self.report.position])
        if unsent is None or w <= 0.0 or name in self.report.nonfinite or decision.all_anomalous:
            return
        scale = 1.0 if self.gather else 1.0 / w
        for p, u in zip(live, unsent):
            p.sub_(u.to(p.device, p.dtype), alpha=scale)  # θ = θ̄ − Δ: the part of Δ not sent stays here
        self.core.kept = True

    # ------------------------------------------------------------------ commit
    def vote(self) -> Handle[bool] | None:
        """This cluster's vote (None when alone: nothing to agree on)."""
        if not self.shared:
            return None
        return self._counted(lambda: self.core.transport.vote(self.ok))

    def voted(self, handle: Handle[bool] | None) -> bool:
        return (self._wait(handle) if handle is not None else True) and self.ok

    def committed(self) -> None:
        """The vote passed: this round is the one the next round's probe verdicts refer to."""
        if self.core.retract is not None:
            self.core.retract.committed(self.applied)

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
        _feedback(self.core, "restore")
        self.core.kept = False  # the live parameters are what they were before the round


@torch.no_grad()
def land_on_anchors(core: SyncCore) -> None:
    """At the end, after a sync that kept unsent parts in the live parameters (`sync.unsent=keep`) and no step
    since: θ ← θ̄ for every unit, so every cluster ends on the anchor (what was kept is let go)."""
    if core.kept:
        for unit in core.units:
            rebase(unit.live(), core.outer.anchors[unit.name])
        core.kept = False


def _feedback(core: SyncCore, what: str) -> None:
    """`mark` / `restore` the transport's error-feedback residuals (a transport without them: nothing)."""
    fn = getattr(getattr(core.transport, "feedback", None), what, None)
    if fn is not None:
        fn()
