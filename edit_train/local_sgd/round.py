"""One sync round — the only place the EDiT sync sequence exists — and the one re-base.

    exchange   each rank sums ‖Δ‖² per unit over its cluster; the leaders all-gather one small vector
               ([‖Δ‖² per unit ‖ last committed round ‖ routed tokens per expert (an MoE model, `experts.py`) ‖
               local steps, s/step, total steps, stop vote, tokens ‖ probe scores]) across the quorum
    decide     the aggregation rule (`rules.py`, `aggregator.py`) weighs every cluster, module by module
    launch     w·Δ of a unit goes into the transport's SUM reduction, or Δ to every cluster (gathered)
    land       wait for a unit's reduced Δ (gathered: judge every contribution, merge them here); a non-finite
               one can never be applied (the round votes no)
    apply      clip → (take back what the probe showed harmful, `retract.py`) → outer step → re-base the live
               parameters on the new anchor, less what this cluster did not send and keeps (top-k's `sync.unsent=
               keep`; the rows of experts it did not send)
    commit     every cluster votes; a "no" or a lost cluster rolls every applied unit back

What moves is what the rule needs (`Needs`): a SUM decided from the reported norms (`sum`); every contribution
(`gathered`: up to `gather_max` clusters for a rule that needs measurements, always for one that needs the
contributions); or, above `gather_max` for a rule that needs measurements, a SUM checked against sketches at
the vote (`sketched`, `sketch_check.py`) — a check that fails gathers the same sync instead (`regather`).

How and when units are launched, landed and applied is the drivers' business (`drivers.py`): layer-wise
inside the next forward pass, all at once (at_end), or in the background while training goes on (overlap).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from edit_train.local_sgd.aggregator import Aggregator, Combiner, Decision, Evidence, Needs, needs_of
from edit_train.local_sgd.evidence import Groups, buckets, measure, probe_judgement, shard_positions, snap
from edit_train.local_sgd.experts import Experts, Held, UnitExperts, merged_sqnorm, pin, unsent_rows
from edit_train.local_sgd.outer import OuterState
from edit_train.local_sgd.penalty import clip_factor, weighted
from edit_train.local_sgd.protocols import Contributions, Handle, Quorum, Transport
from edit_train.local_sgd.retract import NONE, Applied, Retraction, marker_of
from edit_train.local_sgd.scale import bound_scale
from edit_train.local_sgd.sketch_check import DIGEST_DIM, EXACT_TOLERANCE, SketchCheck
from edit_train.local_sgd.suspects import Suspects

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
    gather_max: int = 4  # a rule that needs measurements: up to this many clusters, gather; above, sketch
    sketch_dim: int = 0  # count-sketch buckets per module (the rule's direction test; the sketched check)
    keep: Callable[[str, list[Tensor], Contributions], None] | None = None  # (unit, old anchor, contributions)
    kept: bool = False  # the last round left unsent parts in the live parameters (sync.unsent=keep, unsent experts)
    retract: Retraction | None = None  # gathered: take back an update the probe showed harmful (retract.py)
    experts: Experts | None = None  # an MoE model: routed tokens per expert, which rows are whose (experts.py)
    scale_bound: float = 0.0  # a contribution counts for at most this many times the quorum's median (scale.py)
    max_tokens_per_step: int = 0  # a cluster's claimed tokens are bounded by its local steps x this (0: unbounded)
    suspects: Suspects | None = None  # who this cluster names (suspects.py)
    probe_tolerance: float = 0.1  # an evaluator this far from the others' probe scores is suspected (evidence.py)

    def __post_init__(self) -> None:
        self.index = {u.name: i for i, u in enumerate(self.units)}
        self.needs = needs_of(self.rule)
        self._hashed: dict[tuple[str, bool, int], tuple[Tensor, Tensor]] = {}
        self._positions: dict[str, Tensor] = {}

    def mode(self, q: Quorum) -> str:
        """How this quorum's contributions move: "sum", "gathered" or "sketched" (module docstring)."""
        if not q.shared or self.needs is Needs.SUM:
            return "sum"
        if self.needs is Needs.CONTRIBUTIONS or len(q.members) <= self.gather_max or self.sketch_dim <= 0 \
                or self.transport.gathers_sums:
            return "gathered"
        return "sketched"

    def positions(self, name: str) -> Tensor:
        """Where this rank's elements of unit `name` sit in the module's flat Δ (computed once)."""
        if name not in self._positions:
            cluster = self.transport.cluster
            self._positions[name] = torch.cat(shard_positions(self.unit(name).params, cluster.rank, cluster.size))
        return self._positions[name]

    def hashed(self, name: str, whole: bool, dim: int | None = None) -> tuple[Tensor, Tensor] | None:
        """The fixed count sketch's buckets and signs for unit `name` (`dim` buckets, default `sketch_dim`): its
        whole flat Δ, or this rank's shard (computed once)."""
        dim = self.sketch_dim if dim is None else dim
        if dim <= 0:
            return None
        key = (name, whole, dim)
        if key not in self._hashed:
            numel = sum(p.numel() for p in self.unit(name).params)
            pos = torch.arange(numel, dtype=torch.int64) if whole else self.positions(name)
            self._hashed[key] = buckets(pos, dim)
        return self._hashed[key]

    def unit(self, name: str) -> Unit:
        return self.units[self.index[name]]

    def unit_experts(self, name: str) -> UnitExperts | None:
        return self.experts.units.get(name) if self.experts is not None else None


@dataclass
class SyncReport:
    """What one sync did on this rank (the `sync` event is made from it)."""

    sync: int
    local_steps: int
    quorum: list[str]  # the clusters in this sync, by name, in the order the decisions use
    position: int  # this cluster's row in the decisions
    decisions: dict[str, Decision] = field(default_factory=dict)
    clip: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    blocked_s: float = 0.0
    cluster_norm: float = 0.0  # this cluster's whole-model ‖Δ‖
    sizes: dict[str, int] = field(default_factory=dict)  # parameters per unit (for the effective weight)
    nonfinite: list[str] = field(default_factory=list)  # units whose reduced Δ was non-finite
    retracted: dict[str, dict[str, Any]] = field(default_factory=dict)  # cluster -> {sync, probe}: taken back
    mode: str = "sum"  # how the contributions moved: sum | gathered | sketched
    regathered: str = ""  # sketched, then gathered: why the sketches did not check out
    unsent: int = 0  # elements of this cluster's Δ it did not send (rows of experts it or nobody touched)
    expert_shares: dict[str, list[float]] = field(default_factory=dict)  # unit -> each expert's share of it
    probe_suspects: dict[str, str] = field(default_factory=dict)  # evaluator -> why its probe scores did not count


class SyncRound:
    """One sync of one cluster: exchange → decide → (launch → land → apply) per unit → commit/roll back.

    `eager=True` applies each unit as soon as it lands and keeps an undo record until the vote (layer-wise:
    the next forward needs θ̄_new); `eager=False` applies nothing before the vote passed, re-basing on the
    snapshot taken at `exchange` (overlap: local steps go on meanwhile)."""

    def __init__(self, core: SyncCore, sync: int, local_steps: int, eager: bool) -> None:
        q = core.transport.quorum
        assert q is not None, "a round needs an issued quorum"
        self.core, self.eager, self.shared, self.nonce = core, eager, q.shared, q.nonce
        self.report = SyncReport(sync, local_steps, q.names, q.me, sizes={u: core.outer.numel(u) for u in core.index},
                                 mode=core.mode(q), expert_shares=dict(core.experts.shares) if core.experts else {})
        self.meta: dict[str, Tensor] = {}  # per cluster: reported norms, steps, tokens, probe scores
        self.todo = [u.name for u in core.units]  # in unit order
        self.snap: dict[str, list[Tensor]] = {}
        self.inflight: dict[str, tuple[Handle[Any], list[Tensor]]] = {}
        self.landed: dict[str, list[Tensor]] = {}
        self.held: dict[str, Held] = {}  # per unit: the rows of this cluster's Δ it did not send (experts), to keep
        self.undo: dict[str, Any] = {}
        self.sqnorm: dict[str, float] = {}  # gathered: ‖Σ wᵢΔᵢ‖² per unit, from the Gram matrix
        self.ok = True  # False once something makes this cluster vote no
        self.check: SketchCheck | None = None  # sketched: this cluster's proofs and the verdict
        self.provisional: tuple[dict[str, Any], dict[str, Tensor]] | None = None  # sketched: the rule's state before
        # what this round applies, for a later verdict (gathered rounds only); who of the last round to take back
        self.applied = Applied(sync, marker_of(q.nonce), q.names) \
            if self.gather and core.retract and not isinstance(core.rule, Combiner) else None
        self.taking: dict[str, float] = {}
        # error feedback: what a rolled-back round sent was never applied, so its residuals are forgotten
        core.transport.feedback.mark()
        core.kept = False

    @property
    def gather(self) -> bool:
        return self.report.mode == "gathered"

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
        counts = c.experts.take() if c.experts is not None else []  # kept until this round commits
        sq = torch.zeros(len(c.units), dtype=torch.float64, device=c.transport.cluster.device)
        for i, unit in enumerate(c.units):
            live = unit.live()
            outer.params[unit.name] = live
            if not self.eager:
                self.snap[unit.name] = [t.detach().clone() for t in live]
            delta = outer.pseudo_grad(unit.name)
            if c.experts is not None:  # what it reports is what it sends
                delta = c.experts.sending(unit.name, delta, unit.params, *_where(c))
            sq[i] = sum(float(d.double().pow(2).sum()) for d in delta)
        c.transport.cluster.sum_(sq)
        mark = c.retract.marker if c.retract is not None else NONE  # the round this cluster last committed
        vec = torch.cat([sq, torch.tensor([mark, *counts, *extra], dtype=torch.float64, device=sq.device)])
        return self._counted(lambda: c.transport.all_gather(vec, "norm exchange"))

    def gathered(self, handle: Handle[Tensor]) -> Tensor:
        """Wait for the exchange ([‖Δ‖² per unit ‖ last committed round ‖ routed tokens ‖ EXTRA ‖ probe score of
        every cluster's last update]); unless gathering, decide every module now (sketched: provisionally, the
        rule's state kept to decide again at the vote; a rule that weighs experts gathers instead: the sketch
        check cannot check weights per expert). Returns the EXTRA columns [clusters, len(EXTRA)]."""
        full = self._wait(handle).cpu()
        experts = self.core.experts
        n, k, m = len(self.core.units), len(EXTRA), experts.width if experts is not None else 0
        norms, marks = full[:, :n].clamp_min(0).sqrt(), full[:, n]
        rows = torch.cat([full[:, :n], full[:, n + 1 + m:]], dim=1)  # without the marker and the routed tokens
        scores = rows[:, n + k:]
        if scores.shape[1] != rows.shape[0]:  # nobody sent probe scores for this quorum
            scores = torch.full((rows.shape[0], rows.shape[0]), math.nan, dtype=torch.float64)
        probe, probe_suspects = probe_judgement(scores, self.core.probe_tolerance)
        self.meta = {"reported": norms, "steps": rows[:, n].clone(), "tokens": self._tokens(rows[:, n].clone(),
                     rows[:, n + EXTRA.index("tokens")].clone()), "probe": probe}
        self._suspected(probe_suspects)
        if experts is not None and experts.pending is not None:  # [P, MoE layers, experts]
            self.meta["expert_tokens"] = full[:, n + 1:n + 1 + m].reshape(full.shape[0], *experts.pending.shape)
        if self.core.retract is not None and self.gather:
            self.taking = self.core.retract.plan(self.report.quorum, marks, self.meta["probe"])
            self.report.retracted = self.core.retract.described(self.taking)
        if self.report.mode == "sketched":
            self.provisional = _copy_state(self.core.rule.state())
            tolerance = EXACT_TOLERANCE if self.core.transport.exact else self.core.transport.payload_error
            self.check = SketchCheck([u.name for u in self.core.units], self.core.sketch_dim, tolerance,
                                     f"{self.nonce}/{self.report.sync}")
        if not self.gather:
            for i, unit in enumerate(self.core.units):
                self.report.decisions[unit.name] = self._pin(
                    self._decide(self._evidence(unit.name, norms[:, i], {})), None)
        if self.provisional is not None:
            self.core.rule.load(*_copy_state(self.provisional))
            if any(d.expert_weights is not None for d in self.report.decisions.values()):
                self.report.mode, self.check, self.provisional = "gathered", None, None
                self.report.decisions.clear()
        self.report.cluster_norm = float(norms[self.report.position].pow(2).sum().sqrt())
        return rows[:, n:n + k]

    def _tokens(self, steps: Tensor, claimed: Tensor) -> Tensor:
        """The claimed tokens, each bounded by the cluster's local steps x the most tokens per step any configured
        cluster takes (a claim of 10^12 tokens weighs what its steps can hold); those over it are named."""
        cap = self.core.max_tokens_per_step
        if cap <= 0:
            return claimed
        most = steps.clamp_min(0) * cap
        over = ~(claimed <= most)  # NaN is over too
        for i in over.nonzero().flatten().tolist():
            self._name(i, f"claims {float(claimed[i]):.4g} tokens for {float(steps[i]):.0f} local steps, more than "
                          f"{cap} per step (bounded to {float(most[i]):.4g})", "tokens")
        return torch.where(over, most, claimed)

    def _name(self, i: int, what: str, kind: str) -> None:
        q = self.core.transport.quorum
        if self.core.suspects is not None and q is not None and i != self.report.position:
            self.core.suspects.name(q, i, what, kind)

    def _decide(self, ev: Evidence) -> Decision:
        """The rule's decision, every contribution then bounded by the quorum's median scale (scale.py)."""
        d = self.core.rule.decide(ev)
        if isinstance(self.core.rule, Combiner):
            return d
        for i, f in bound_scale(d, ev, self.core.scale_bound).items():
            if len(d.evidence) == len(ev.names):
                d.evidence[i] = {**d.evidence[i], "scale_clip": f}
            self._name(i, f"sent a pseudo-gradient over {self.core.scale_bound:g} times the quorum's median norm "
                          f"per √step at sync {self.report.sync} (clipped to the median)", "scale")
        return d

    def _suspected(self, who: dict[int, str]) -> None:
        """Evaluators whose probe scores were not counted: in the `sync` event (`probe_suspects`), and named
        (suspects.py: one line with the roster key that signed its records, and the event's `suspects`)."""
        self.report.probe_suspects = {self.report.quorum[i]: why for i, why in who.items()}
        for i, why in who.items():
            what = "disagree with the other evaluators'" if why == "disagrees" else \
                "flag an update no other evaluator measured (one evaluator decides nothing)"
            self._name(i, f"sent probe scores that {what} (sync {self.report.sync}): not counted", f"probe {why}")

    def _evidence(self, name: str, norms: Tensor, measured: dict[str, Tensor]) -> Evidence:
        steps = self.meta["steps"]
        i = self.core.index[name]
        extra = {"reported": self.meta["reported"][:, i].clone(), "tokens": self.meta["tokens"].clone(),
                 "probe": self.meta["probe"].clone(), "sync": torch.tensor(self.report.sync), **measured}
        if self.core.experts is not None and name in self.core.experts.units and "expert_tokens" in self.meta:
            extra["expert_tokens"] = self.core.experts.tokens(name, self.meta["expert_tokens"])
            extra["expert_sent"] = self._sent(name)
        return Evidence(name, tuple(self.report.quorum), norms.clone(), steps.clone(),
                        tuple(bool(s > 0) for s in steps.tolist()), extra)

    def _sent(self, name: str) -> Tensor:
        """bool [P, E]: which of unit `name`'s experts each cluster sends."""
        assert self.core.experts is not None
        return self.core.experts.sent_by(name, self.meta.get("expert_tokens"), len(self.report.quorum))

    def _pin(self, d: Decision, finite: list[bool] | None) -> Decision:
        """The expert weights this round applies (`experts.pin`); none for a unit without experts."""
        if d.expert_weights is None or self.core.unit_experts(d.module) is None:
            d.expert_weights = None
            return d
        return pin(d, self._sent(d.module), finite)

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
        experts, me, rows, unsent = c.experts if c.unit_experts(name) else None, self.report.position, None, 0
        raw, mine = self._delta(name), None  # mine: the rows of each parameter this cluster sends (None: all)
        if self.gather:
            delta = raw
            if experts is not None:  # each cluster sends only the experts it touched
                rows, unsent = experts.gathered(name, self._sent(name), unit.params, me)
                mine = rows[me] if rows is not None else None
        elif experts is None or self.report.decisions[name].expert_weights is None:
            delta = weighted(raw, float(self.report.decisions[name].weights[me]))
        else:  # each expert's rows by its own weight; the rows of experts nobody weighs do not go at all
            delta, rows, unsent = experts.summed(name, raw, unit.params, *_where(c), self.report.decisions[name], me)
            mine = rows
        if mine is not None:  # what it does not send stays with it (`_keep_experts`): a copy of those rows only
            self.held[name] = unsent_rows(raw, mine, unit.params, *_where(c))
        self.report.unsent += unsent
        kw = {"rows": rows} if rows is not None else {}  # (a transport that predates `rows` is never asked)
        move = c.transport.gather if self.gather else c.transport.reduce_
        self.inflight[name] = (self._counted(lambda: move(delta, unit.params, name, **kw)), delta)

    def ready(self, name: str) -> bool:
        return name in self.landed or (name in self.inflight and self.inflight[name][0].ready())

    @torch.no_grad()
    def land(self, name: str) -> None:
        """Wait for unit `name`'s contributions (raises FederationError when a cluster was lost); gathered,
        judge them and merge them here; sketched, sketch the sum and this cluster's part for the vote. A
        non-finite result can never be applied: this cluster votes no."""
        self.launch(name)
        handle, delta = self.inflight.pop(name)
        got = self._wait(handle)
        if self.gather:
            delta = self._judge(name, got)
        finite = all(bool(torch.isfinite(d).all()) for d in delta)
        if not finite:
            self.report.nonfinite.append(name)
            self.ok = False
        if self.check is not None and finite:
            c = self.core
            fixed = c.hashed(name, False, DIGEST_DIM)
            assert fixed is not None
            self.check.landed(name, delta, self._delta(name), c.positions(name), fixed, c.transport.cluster)
        self.landed[name] = delta

    def _judge(self, name: str, got: Contributions) -> list[Tensor]:
        """The rule decides on what every cluster sent (its Gram matrix, finiteness, sketches); the merge —
        the weighted sum, or the rule's own `combine` — is taken here, in quorum order, identically on every
        cluster."""
        c, ue, params = self.core, self.core.unit_experts(name), self.core.unit(name).params
        groups: Groups | None = None
        if ue is not None and c.experts is not None and c.experts.weighs:
            groups = lambda whole: (ue.grams(params, *_where(c), whole), ue.count)  # noqa: E731
        m = measure(got, c.transport.cluster, lambda whole: c.hashed(name, whole), c.sketch_dim, groups)
        measured = {"gram": m.gram, "finite": torch.tensor(m.finite), "exact": torch.tensor(c.transport.exact)}
        if m.sketches is not None:
            measured["sketches"] = m.sketches
        ev = self._evidence(name, m.norms, measured)
        decision = self._decide(ev)
        w = [snap(float(x)) if ok else 0.0 for x, ok in zip(decision.weights, m.finite)]
        decision.weights = w
        ew = self._pin(decision, m.finite).expert_weights
        self.report.decisions[name] = decision
        if c.keep is not None:
            c.keep(name, [a.detach().clone() for a in c.outer.anchors[name]], got)
        if isinstance(c.rule, Combiner):
            if decision.skip:
                return [torch.zeros_like(d, dtype=torch.float32) for d in got.parts[self.report.position]]
            kept = [p if ok and not out else [torch.zeros_like(t) for t in p]
                    for p, ok, out in zip(got.parts, m.finite, decision.left_out)]
            return [t.to(torch.float32) for t in c.rule.combine(ev, decision, kept)]
        if ue is not None and ew is not None and m.grams is not None:
            return self._merge_experts(name, got, m.gram, m.grams, w, ew, ue)
        if self.applied is not None:
            self.applied.add(name, got.parts, w)
        used = [i for i, x in enumerate(w) if x != 0.0]
        wt = torch.tensor([w[i] for i in used], dtype=torch.float64)
        self.sqnorm[name] = float(wt @ m.gram[used][:, used] @ wt) if used else 0.0
        total = [torch.zeros_like(d, dtype=torch.float32) for d in got.parts[self.report.position]]
        for i in used:  # quorum order: the same sum on every cluster
            for t, part in zip(total, got.parts[i]):
                t.add_(part.to(t.dtype), alpha=w[i])
        return total

    def _merge_experts(self, name: str, got: Contributions, gram: Tensor, grams: Tensor, w: list[float],
                       ew: list[list[float]], ue: UnitExperts) -> list[Tensor]:
        """Σᵢ Wᵢ∘Δᵢ with each expert's rows weighted by its own weights, in quorum order; ‖·‖² from the Gram
        matrices of the rest of the unit and of each expert (the same number on every cluster)."""
        where, params = _where(self.core), self.core.unit(name).params
        used = [i for i in range(len(w)) if w[i] != 0.0 or any(row[i] != 0.0 for row in ew)]
        mine = [[row[i] for row in ew] for i in range(len(w))]
        if self.applied is not None:  # what each one added, for a later retraction: its parts as weighted
            self.applied.add(name, [ue.scaled(p, params, *where, w[i], mine[i]) if i in used else p
                                    for i, p in enumerate(got.parts)], [float(i in used) for i in range(len(w))])
        self.sqnorm[name] = merged_sqnorm(gram, grams, used, w, ew)
        total = [torch.zeros_like(d, dtype=torch.float32) for d in got.parts[self.report.position]]
        for i in used:  # quorum order: the same sum on every cluster
            ue.accumulate(total, got.parts[i], params, *where, w[i], mine[i])
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
        if decision.skip or name in report.nonfinite:
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
        self._keep_experts(name, live, decision)
        c.outer.release(name)
        self.todo.remove(name)

    def _keep_unsent(self, name: str, live: list[Tensor], decision: Decision) -> None:
        """`sync.unsent=keep`: θ ← θ̄_new − e, the part e of this cluster's Δ that top-k left out (a SUM
        carried w·Δ: e/w). A cluster whose contribution was left out lands on θ̄ and lets e go with it."""
        unsent = self.core.transport.take_unsent(live, self.core.unit(name).params, name)
        w = float(decision.weights[self.report.position])
        if unsent is None or w <= 0.0 or name in self.report.nonfinite or decision.skip:
            return
        scale = 1.0 if self.gather else 1.0 / w
        for p, u in zip(live, unsent):
            p.sub_(u.to(p.device, p.dtype), alpha=scale)  # θ = θ̄ − Δ: the part of Δ not sent stays here
        self.core.kept = True

    def _keep_experts(self, name: str, live: list[Tensor], decision: Decision) -> None:
        """The rows of experts this cluster did not send (it routed them fewer than `expert_min_tokens` tokens, or
        nobody weighs them in a SUM): θ ← θ̄_new − Δₑ there, its own raw Δ (overlap: plus its progress since the
        snapshot, which the re-base kept), so its next Δ on them carries it and goes when it sends the expert
        again. A cluster left out of the unit (weight 0), a non-finite Δ, or a skipped unit lands on θ̄ and lets
        it go."""
        held = self.held.pop(name, None)
        if not held or float(decision.weights[self.report.position]) <= 0.0 or name in self.report.nonfinite \
                or decision.skip or not all(bool(torch.isfinite(rows).all()) for _, _, rows in held):
            return
        for k, idx, rows in held:
            p = live[k]
            p.index_add_(0, idx.to(p.device), rows.to(p.device, p.dtype), alpha=-1)
        self.core.kept = True

    # ------------------------------------------------------------------ commit
    def vote(self) -> Handle[Any] | None:
        """This cluster's vote (None when alone: nothing to agree on); sketched, it carries the proofs."""
        if not self.shared:
            return None
        if self.check is not None:
            row = self.check.row(self.core.transport.cluster.agree(self.ok))
            return self._counted(lambda: self.core.transport.all_gather(row, "commit vote"))
        return self._counted(lambda: self.core.transport.vote(self.ok))

    def voted(self, handle: Handle[Any] | None) -> bool:
        """Whether the round commits. Sketched: every cluster's rows give every cluster the same verdict; a
        verdict against the SUM leaves `regathered` set and False (the caller gathers: `regather`)."""
        if handle is None:
            return self.ok
        if self.check is None:
            return self._majority(self._wait(handle).cpu().flatten()) and self.ok
        rows = self._wait(handle).cpu()
        why = self._verdict(rows)
        if why:
            self.report.regathered = why
            return False
        return True

    def _majority(self, votes: Tensor) -> bool:
        """The commit: no strict majority of the quorum voted no — a tie keeps what you have (an honest "no" — a
        non-finite merged unit — is everyone's, since every cluster merges the same contributions; a lone "no" is a
        local fault). `voted` ANDs this cluster's own vote: a member whose vote differs from the outcome rolls itself
        back and is named (it heals or syncs on at its next sync; docs/security.md)."""
        yes = [bool(v > 0) for v in votes.tolist()]
        commit = 2 * sum(yes) >= len(yes)
        if yes[self.report.position]:
            for i, said in enumerate(yes):
                if not said:
                    outcome = "committed without it" if commit else "a strict majority voted no: rolled back"
                    self._name(i, f"voted no at sync {self.report.sync} ({outcome})", "veto")
        return commit

    def _verdict(self, rows: Tensor) -> str:
        """"" when the sketched SUM checks out and the rule, deciding again on the proven sketches, agrees with
        its provisional decision (then the report holds the second decisions); else why not."""
        check = self.check
        assert check is not None
        measure = lambda name, measured: self._decide(  # noqa: E731
            self._evidence(name, self.meta["reported"][:, self.core.index[name]], measured))
        final, why = check.verdict(rows, self.report.decisions, measure, self.report.quorum)
        self.report.decisions.update(final)
        return why

    def regather(self) -> bool:
        """After a sketched verdict against the SUM: undo what was applied, forget the rule's decisions, and make
        this round gather every contribution (every unit again, in order). False when there is nothing to do."""
        if not self.report.regathered or self.check is None or self.provisional is None:
            return False
        c = self.core
        for name, undo in self.undo.items():
            c.outer.restore(name, undo)
        self.undo.clear()
        self.inflight.clear()
        self.landed.clear()
        self.held.clear()
        c.rule.load(*_copy_state(self.provisional))
        c.transport.feedback.restore()  # what the SUM sent is not applied: its residuals are forgotten
        c.transport.feedback.mark()
        self.check, self.provisional, self.ok = None, None, True
        self.todo = [u.name for u in c.units]
        self.report.mode = "gathered"
        self.report.decisions.clear()
        self.report.clip.clear()
        self.report.nonfinite.clear()
        return True

    def committed(self) -> None:
        """The vote passed: this round is the one the next round's probe verdicts refer to; the routed counts it
        carried are spent."""
        if self.core.retract is not None:
            self.core.retract.committed(self.applied)
        if self.core.experts is not None:
            self.core.experts.committed()

    @torch.no_grad()
    def rollback(self) -> None:
        """Undo every applied unit (anchor, outer state, live parameters); forget what is in flight."""
        for name, undo in self.undo.items():
            self.core.outer.restore(name, undo)
        self.undo.clear()
        self.inflight.clear()
        self.landed.clear()
        self.held.clear()
        self.snap.clear()
        self.todo.clear()
        if self.provisional is not None:  # a sketched round that did not commit decided nothing
            self.core.rule.load(*_copy_state(self.provisional))
        self.core.transport.abort()
        self.core.transport.feedback.restore()
        self.core.kept = False  # the live parameters are what they were before the round


def _where(core: SyncCore) -> tuple[int, int]:
    """This rank's place in its cluster (rank, ranks): which rows of a sharded parameter it holds."""
    return core.transport.cluster.rank, core.transport.cluster.size


def _copy_state(state: tuple[dict[str, Any], dict[str, Tensor]]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    meta, tensors = state
    return json.loads(json.dumps(meta)), {k: v.clone() for k, v in tensors.items()}


@torch.no_grad()
def land_on_anchors(core: SyncCore) -> None:
    """At the end, after a sync that kept unsent parts in the live parameters (`sync.unsent=keep`, the rows of
    experts a cluster did not send) and no step since: θ ← θ̄ for every unit, so every cluster ends on the anchor
    (what was kept is let go)."""
    if core.kept:
        for unit in core.units:
            rebase(unit.live(), core.outer.anchors[unit.name])
        core.kept = False
