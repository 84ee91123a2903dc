"""One sync round — the only place the EDiT sync sequence exists — and the one re-base.

    exchange   each rank sums ‖Δ‖² per unit over its cluster (Δ computed here, once per unit and round, and
               held until the unit is applied); the leaders all-gather one small vector ([‖Δ‖² per unit ‖ last
               committed round ‖ routed tokens (an MoE model) ‖ local steps, s/step, total steps, stop vote, tokens ‖
               probe scores]) across the quorum; the rule's side reads it (`judge.py`)
    launch     a unit's contribution goes into the transport: a SUM or a gather (`merges.py`)
    land       wait for a unit's contributions and merge them (`merges.py`); a non-finite merge can never be
               applied (the round votes no)
    apply      clip → (take back what the probe showed harmful: `Taking`, `retract.py`) → outer step → re-base
               the live parameters on the new anchor, less what this cluster did not send and keeps (top-k's
               `sync.unsent=keep`; the rows an MoE model's cluster did not send: `expert_rows.py`)
    commit     every cluster votes; a "no" or a lost cluster rolls every applied unit back; a sketched SUM whose
               verdict went against it is gathered again (`regather`)

How the contributions move (`sum`, `gathered`, `sketched`) is `moves.aggregation`'s decision; each way of
moving and merging them is one class behind `merges.Merge`. How and when units are launched, landed and applied
is the drivers' business (`drivers.py`): layer-wise inside the next forward pass, all at once (at_end), or in
the background while training goes on (overlap).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.aggregator import Combiner
from edit_train.local_sgd.sync.core import SyncCore, SyncReport, Unit, build_units
from edit_train.local_sgd.sync.expert_rows import ExpertRows
from edit_train.local_sgd.sync.judge import EXTRA, Judge
from edit_train.local_sgd.sync.merges import Context, Gathered, merge_for
from edit_train.local_sgd.penalty import clip_factor
from edit_train.local_sgd.protocols import Handle
from edit_train.local_sgd.aggregation.retract import Applied, Taking, marker_of

__all__ = ["EXTRA", "SyncCore", "SyncReport", "SyncRound", "Unit", "build_units", "land_on_anchors", "rebase"]


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


class SyncRound:
    """One sync of one cluster: exchange → (launch → land → apply) per unit → vote, commit or roll back.

    `eager=True` applies each unit as soon as it lands and keeps an undo record until the vote (layer-wise:
    the next forward needs θ̄_new); `eager=False` applies nothing before the vote passed, re-basing on the
    snapshot taken at `exchange` (overlap: local steps go on meanwhile)."""

    def __init__(self, core: SyncCore, sync: int, local_steps: int, eager: bool) -> None:
        q = core.transport.quorum
        assert q is not None, "a round needs an issued quorum"
        self.core, self.eager, self.shared = core, eager, q.shared
        self.report = SyncReport(sync, local_steps, q.names, q.me, sizes={u: core.outer.numel(u) for u in core.index},
                                 mode=core.movement(q))
        rows = ExpertRows(core, self.report)
        # what a gathered round applies, for a later verdict (not a combining rule's); who of the last round to take back
        record = self.report.mode == "gathered" and not isinstance(core.rule, Combiner)
        taking = Taking(core.retract, Applied(sync, marker_of(q.nonce), q.names) if record else None)
        self.ctx = Context(core, self.report, Judge(core, self.report, rows), rows, taking)
        self.merge = merge_for(self.ctx)
        self.todo = [u.name for u in core.units]  # in unit order
        self.delta: dict[str, list[Tensor]] = {}  # this cluster's Δ per unit, from the exchange
        self.snap: dict[str, list[Tensor]] = {}
        self.inflight: dict[str, tuple[Handle[Any], list[Tensor]]] = {}
        self.landed: dict[str, list[Tensor]] = {}
        self.undo: dict[str, Any] = {}
        self.ok = True  # False once something makes this cluster vote no
        # error feedback: what a rolled-back round sent was never applied, so its residuals are forgotten
        core.transport.feedback.mark()
        core.kept = False

    @torch.no_grad()
    def exchange(self, extra: list[float]) -> Handle[Tensor]:
        """Start the norm exchange (asynchronous); `extra` rides along (EXTRA, in that order)."""
        c, outer = self.core, self.core.outer
        counts = self.ctx.rows.take()  # kept until this round commits
        sq = torch.zeros(len(c.units), dtype=torch.float64, device=c.transport.cluster.device)
        for i, unit in enumerate(c.units):
            live = unit.live()
            outer.params[unit.name] = live
            if not self.eager:
                self.snap[unit.name] = [t.detach().clone() for t in live]
            self.delta[unit.name] = outer.pseudo_grad(unit.name)
            sent = self.ctx.rows.reported(unit.name, self.delta[unit.name])  # what it reports is what it sends
            sq[i] = sum(float(d.double().pow(2).sum()) for d in sent)
        c.transport.cluster.sum_(sq)
        bias = c.expert_bias.payload() if c.expert_bias is not None else []  # owned ‖ bias (expert_bias.py)
        vec = torch.cat([sq, torch.tensor([self.ctx.taking.marker, *counts, *bias, *extra], dtype=torch.float64,
                                          device=sq.device)])
        return self.ctx.counted(lambda: c.transport.all_gather(vec, "norm exchange"))

    def gathered(self, handle: Handle[Tensor]) -> Tensor:
        """Wait for the exchange and decide what can be decided now (a SUM: every unit; sketched: provisionally;
        a rule that weighs experts above `gather_max` gathers instead). Returns the EXTRA columns [clusters,
        len(EXTRA)]."""
        norms, marks, extra = self.ctx.judge.read(self.ctx.wait(handle).cpu())
        self.merge = self.merge.decided(norms, marks)
        return extra

    @torch.no_grad()
    def launch(self, name: str) -> None:
        """Start moving unit `name`'s contribution (once)."""
        if name in self.inflight or name in self.landed or name not in self.todo:
            return
        c = self.core
        unit = c.unit(name)
        c.outer.params[name] = unit.live()
        c.outer.prefetch(name)
        delta, rows = self.merge.send(name, self.delta[name])
        kw = {"rows": rows} if rows is not None else {}  # (a transport that predates `rows` is never asked)
        move = c.transport.gather if self.merge.gathers else c.transport.reduce_
        self.inflight[name] = (self.ctx.counted(lambda: move(delta, unit.params, name, **kw)), delta)

    def ready(self, name: str) -> bool:
        return name in self.landed or (name in self.inflight and self.inflight[name][0].ready())

    @torch.no_grad()
    def land(self, name: str) -> None:
        """Wait for unit `name`'s contributions (raises FederationError when a cluster was lost) and merge them.
        A non-finite result can never be applied: this cluster votes no."""
        self.launch(name)
        handle, sent = self.inflight.pop(name)
        merged = self.merge.merged(name, self.ctx.wait(handle), sent)
        if all(bool(torch.isfinite(d).all()) for d in merged):
            self.merge.landed(name, merged, self.delta[name])
        else:
            self.report.nonfinite.append(name)
            self.ok = False
        self.landed[name] = merged

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
        failed = decision.skip or name in report.nonfinite
        back = self.ctx.taking.term(name) if name not in report.nonfinite else None
        if failed:
            report.clip[name] = 0.0  # no outer step; every cluster lands on the anchor it had
            if back is not None:  # ... except for taking back a harmful update of the last round
                c.outer.step(name, [-b for b in back])
        else:
            sq = self.merge.sqnorm(name)
            if sq is None:
                t = torch.tensor([sum(float(d.double().pow(2).sum()) for d in delta)], dtype=torch.float64,
                                 device=c.transport.cluster.device)
                sq = float(c.transport.cluster.sum_(t))
            coef = clip_factor(sq, c.clip)
            step = [d * coef for d in delta] if coef != 1.0 else delta
            c.outer.step(name, step if back is None else [d - b.to(d.device, d.dtype) for d, b in zip(step, back)])
            report.clip[name] = coef
            self.ctx.taking.clipped(name, coef)
        rebase(live, c.outer.anchors[name], self.snap.pop(name, None))
        w = float(decision.weights[report.position])
        _keep_unsent(c, name, live, w, failed, self.merge.gathers)
        c.kept = self.ctx.rows.keep(name, live, w > 0.0 and not failed) or c.kept
        self.ctx.rows.unowned_to_anchor(name, live)  # expert_subsets=routed, once decided
        if self.merge.mode != "sketched":  # (a sketched round may gather again: its Δ stays until the verdict)
            self.delta.pop(name, None)
        c.outer.release(name)
        self.todo.remove(name)

    def vote(self) -> Handle[Any] | None:
        """This cluster's vote (None when alone: nothing to agree on); sketched, it carries the proofs."""
        return self.merge.vote(self.ok) if self.shared else None

    def voted(self, handle: Handle[Any] | None) -> bool:
        """Whether the round commits. Sketched: a verdict against the SUM leaves `regathered` set and False (the
        caller gathers: `regather`)."""
        return self.ok if handle is None else self.merge.voted(handle, self.ok)

    def regather(self) -> bool:
        """After a sketched verdict against the SUM: undo what was applied, forget the rule's decisions, and make
        this round gather every contribution (every unit again, in order). False when there is nothing to do."""
        if not self.report.regathered or not self.merge.again():
            return False
        c = self.core
        for name, undo in self.undo.items():
            c.outer.restore(name, undo)
        self.undo.clear()
        self.inflight.clear()
        self.landed.clear()
        self.ctx.rows.forget()
        c.transport.feedback.restore()  # what the SUM sent is not applied: its residuals are forgotten
        c.transport.feedback.mark()
        self.ok, self.todo = True, [u.name for u in c.units]
        self.report.mode = "gathered"
        self.merge = Gathered(self.ctx)
        self.report.decisions.clear()
        self.report.clip.clear()
        self.report.nonfinite.clear()
        return True

    def committed(self) -> None:
        """The vote passed: this round is the one the next round's probe verdicts refer to; the routed counts it
        carried are spent."""
        self.ctx.taking.committed()
        self.ctx.judge.bias_committed()
        self.ctx.rows.committed()
        self.delta.clear()

    @torch.no_grad()
    def rollback(self) -> None:
        """Undo every applied unit (anchor, outer state, live parameters); forget what is in flight."""
        for name, undo in self.undo.items():
            self.core.outer.restore(name, undo)
        for held in (self.undo, self.inflight, self.landed, self.snap, self.delta):
            held.clear()
        self.ctx.rows.forget()
        self.todo.clear()
        self.merge.undone()  # a sketched round that did not commit decided nothing
        if self.core.expert_bias is not None:
            self.core.expert_bias.rolled_back()
        self.core.transport.abort()
        self.core.transport.feedback.restore()
        self.core.kept = False  # the live parameters are what they were before the round


def _keep_unsent(core: SyncCore, name: str, live: list[Tensor], w: float, failed: bool, gathered: bool) -> None:
    """`sync.unsent=keep`: θ ← θ̄_new − e, the part e of this cluster's Δ that top-k left out (a SUM carried
    w·Δ: e/w). A cluster whose contribution was left out (weight `w` 0) or `failed` (skipped, non-finite) lands
    on θ̄ and lets e go with it."""
    unsent = core.transport.take_unsent(live, core.unit(name).params, name)
    if unsent is None or w <= 0.0 or failed:
        return
    scale = 1.0 if gathered else 1.0 / w
    for p, u in zip(live, unsent):
        p.sub_(u.to(p.device, p.dtype), alpha=scale)  # θ = θ̄ − Δ: the part of Δ not sent stays here
    core.kept = True


@torch.no_grad()
def land_on_anchors(core: SyncCore) -> None:
    """At the end, after a sync that kept unsent parts in the live parameters (`sync.unsent=keep`, the rows of
    experts a cluster did not send) and no step since: θ ← θ̄ for every unit, so every cluster ends on the anchor
    (what was kept is let go)."""
    if core.kept:
        for unit in core.units:
            rebase(unit.live(), core.outer.anchors[unit.name])
        core.kept = False
