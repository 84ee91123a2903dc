"""How one round moves and merges the contributions — one class per mode behind one protocol (`Merge`); the
sequence itself is the round's (`round.py`), which mode a quorum gets is `moves.aggregation`'s.

* `Summed` (``sum``): decided on what every cluster reported; each sends w·Δ into a SUM, which is the merge.
* `Gathered` (``gathered``): every cluster receives every contribution; the rule decides on what was measured
  (Gram matrix, finiteness, sketches) and the weighted sum is taken here, in quorum order, identically everywhere.
* `Combined` (``gathered``, a `Combiner` rule): the same, the rule's own `combine` merging.
* `Sketched` (``sketched``): a SUM decided provisionally on the reports; every cluster sketches the landed sum and
  its own Δ, and the vote carries the proofs; the verdict holds the rule to the proven sketches, or the round is
  gathered again (`again`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from edit_train.local_sgd.aggregator import Combiner, Decision, Evidence
from edit_train.local_sgd.sync.core import SyncCore, SyncReport
from edit_train.local_sgd.evidence import Measured, measure, snap
from edit_train.local_sgd.sync.expert_rows import ExpertRows
from edit_train.local_sgd.sync.judge import Judge
from edit_train.local_sgd.penalty import weighted
from edit_train.local_sgd.protocols import Contributions, Handle
from edit_train.local_sgd.aggregation.retract import Taking
from edit_train.local_sgd.aggregation.sketch_check import DIGEST_DIM, EXACT_TOLERANCE, SketchCheck

T = TypeVar("T")


@dataclass
class Context:
    """What a round's collaborators share: the core, the report, the rule's side, the expert rows, the
    retraction; and the two ways the round talks to the transport (time waited, bytes sent, counted)."""

    core: SyncCore
    report: SyncReport
    judge: Judge
    rows: ExpertRows
    taking: Taking

    def wait(self, handle: Handle[T]) -> T:
        try:
            return handle.wait()
        finally:
            self.report.blocked_s += handle.blocked_s

    def counted(self, fn: Callable[[], T]) -> T:
        before = self.core.transport.bytes_sent
        out = fn()
        self.report.bytes += self.core.transport.bytes_sent - before
        return out


class Merge(Protocol):
    """One way of moving and merging a round's contributions."""

    mode: str  # the `sync` event's `aggregation`
    gathers: bool  # the transport gathers every contribution (else: a SUM of what each sends)

    def decided(self, norms: Tensor, marks: Tensor) -> Merge:
        """After the exchange: decide what can be decided now; the merge the round goes on with."""

    def send(self, name: str, raw: list[Tensor]) -> tuple[list[Tensor], Any]:
        """What this cluster sends of unit `name` (its Δ `raw`), and which rows go (None: all)."""

    def merged(self, name: str, got: Contributions, sent: list[Tensor]) -> list[Tensor]:
        """Unit `name`'s merged Δ from what landed (`got`; `sent`: this cluster's payload, a SUM's result)."""

    def landed(self, name: str, merged: list[Tensor], raw: list[Tensor]) -> None:
        """A finite merged Δ of unit `name` landed (`raw`: this cluster's Δ)."""

    def sqnorm(self, name: str) -> float | None:
        """‖merged Δ‖² of unit `name` when known without a reduction (the same number on every cluster)."""

    def vote(self, ok: bool) -> Handle[Any]:
        """This cluster's vote."""

    def voted(self, handle: Handle[Any], ok: bool) -> bool:
        """Whether the round commits (False with `report.regathered` set: gather it `again`)."""

    def again(self) -> bool:
        """After a verdict against the SUM: the rule's state as before the round; True when it is gathered again."""

    def undone(self) -> None:
        """The round rolled back: the rule's state as before it."""


class Summed:
    """``sum``: decided on the reports, each cluster's w·Δ into a SUM."""

    mode, gathers = "sum", False

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def decided(self, norms: Tensor, marks: Tensor) -> Merge:
        for unit in self.ctx.core.units:
            self.ctx.report.decisions[unit.name] = self.ctx.judge.reported(unit.name)
        return self

    def send(self, name: str, raw: list[Tensor]) -> tuple[list[Tensor], Any]:
        decision = self.ctx.report.decisions[name]
        sent = self.ctx.rows.send(name, raw, decision)
        return sent if sent is not None else (weighted(raw, float(decision.weights[self.ctx.report.position])), None)

    def merged(self, name: str, got: Contributions, sent: list[Tensor]) -> list[Tensor]:
        return sent  # reduced in place

    def landed(self, name: str, merged: list[Tensor], raw: list[Tensor]) -> None:
        pass

    def sqnorm(self, name: str) -> float | None:
        return None

    def vote(self, ok: bool) -> Handle[Any]:
        return self.ctx.counted(lambda: self.ctx.core.transport.vote(ok))

    def voted(self, handle: Handle[Any], ok: bool) -> bool:
        return self.ctx.judge.majority(self.ctx.wait(handle).cpu().flatten()) and ok

    def again(self) -> bool:
        return False

    def undone(self) -> None:
        pass


class Gathered(Summed):
    """``gathered``: the rule decides on what every cluster sent, the weighted sum is taken here."""

    mode, gathers = "gathered", True

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.sq: dict[str, float] = {}  # ‖Σ wᵢΔᵢ‖² per unit, from the Gram matrix

    def decided(self, norms: Tensor, marks: Tensor) -> Merge:
        self.ctx.report.retracted = self.ctx.taking.plan(self.ctx.report.quorum, marks, self.ctx.judge.meta["probe"])
        return self

    def send(self, name: str, raw: list[Tensor]) -> tuple[list[Tensor], Any]:
        sent = self.ctx.rows.send(name, raw, None)
        return sent if sent is not None else (raw, None)

    def merged(self, name: str, got: Contributions, sent: list[Tensor]) -> list[Tensor]:
        """The rule decides on what every cluster sent (its Gram matrix, finiteness, sketches); then the merge."""
        c, report = self.ctx.core, self.ctx.report
        m = measure(got, c.transport.cluster, lambda whole: c.hashed(name, whole), c.sketch_dim,
                    self.ctx.rows.groups(name))
        measured = {"gram": m.gram, "finite": torch.tensor(m.finite), "exact": torch.tensor(c.transport.exact)}
        if m.sketches is not None:
            measured["sketches"] = m.sketches
        ev = self.ctx.judge.evidence(name, m.norms, measured)
        decision = self.ctx.judge.decide(ev)
        decision.weights = [snap(float(x)) if ok else 0.0 for x, ok in zip(decision.weights, m.finite)]
        self.ctx.rows.pin(decision, m.finite)
        report.decisions[name] = decision
        if c.keep is not None:
            c.keep(name, [a.detach().clone() for a in c.outer.anchors[name]], got)
        return self._merge(name, got, m, decision, ev)

    def _merge(self, name: str, got: Contributions, m: Measured, decision: Decision, ev: Evidence) -> list[Tensor]:
        """Σ wᵢΔᵢ in quorum order (each expert's rows by its own weights: `ExpertRows.merge`)."""
        w, ew, taking = decision.weights, decision.expert_weights, self.ctx.taking
        if ew is not None and m.grams is not None:
            total, self.sq[name] = self.ctx.rows.merge(name, got, m, w, ew, taking.add if taking.recording else None)
            return total
        taking.add(name, got.parts, w)
        used = [i for i, x in enumerate(w) if x != 0.0]
        wt = torch.tensor([w[i] for i in used], dtype=torch.float64)
        self.sq[name] = float(wt @ m.gram[used][:, used] @ wt) if used else 0.0
        total = [torch.zeros_like(d, dtype=torch.float32) for d in got.parts[self.ctx.report.position]]
        for i in used:  # quorum order: the same sum on every cluster
            for t, part in zip(total, got.parts[i]):
                t.add_(part.to(t.dtype), alpha=w[i])
        return total

    def sqnorm(self, name: str) -> float | None:
        return self.sq.pop(name, None)


class Combined(Gathered):
    """``gathered`` for a `Combiner`: the rule merges the finite, admitted contributions itself."""

    def _merge(self, name: str, got: Contributions, m: Measured, decision: Decision, ev: Evidence) -> list[Tensor]:
        if decision.skip:
            return [torch.zeros_like(d, dtype=torch.float32) for d in got.parts[self.ctx.report.position]]
        kept = [p if ok and not out else [torch.zeros_like(t) for t in p]
                for p, ok, out in zip(got.parts, m.finite, decision.left_out)]
        rule = self.ctx.core.rule
        assert isinstance(rule, Combiner)
        return [t.to(torch.float32) for t in rule.combine(ev, decision, kept)]

    def sqnorm(self, name: str) -> float | None:
        return None


class Sketched(Summed):
    """``sketched``: a SUM decided provisionally, checked against every cluster's sketches at the vote."""

    mode = "sketched"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        c = ctx.core
        self.provisional = _copy_state(c.rule.state())  # the rule's state before this round
        tolerance = EXACT_TOLERANCE if c.transport.exact else c.transport.payload_error
        q = c.transport.quorum
        assert q is not None
        self.check = SketchCheck([u.name for u in c.units], c.sketch_dim, tolerance, f"{q.nonce}/{ctx.report.sync}")

    def decided(self, norms: Tensor, marks: Tensor) -> Merge:
        super().decided(norms, marks)
        self.ctx.core.rule.load(*_copy_state(self.provisional))
        if any(d.expert_weights is not None for d in self.ctx.report.decisions.values()):
            # the sketch check holds one weight per cluster, not weights per expert: gather instead
            self.ctx.report.mode = "gathered"
            self.ctx.report.decisions.clear()
            return Gathered(self.ctx)
        return self

    def landed(self, name: str, merged: list[Tensor], raw: list[Tensor]) -> None:
        c = self.ctx.core
        fixed = c.hashed(name, False, DIGEST_DIM)
        assert fixed is not None
        self.check.landed(name, merged, raw, c.positions(name), fixed, c.transport.cluster)

    def vote(self, ok: bool) -> Handle[Any]:
        row = self.check.row(self.ctx.core.transport.cluster.agree(ok))
        return self.ctx.counted(lambda: self.ctx.core.transport.all_gather(row, "commit vote"))

    def voted(self, handle: Handle[Any], ok: bool) -> bool:
        """Every cluster's rows give every cluster the same verdict: the rule, deciding again on the proven
        sketches, agrees with its provisional decision (the report then holds the second decisions), or not."""
        judge, report = self.ctx.judge, self.ctx.report
        rows = self.ctx.wait(handle).cpu()

        def decide(name: str, measured: dict[str, Tensor]) -> Decision:
            return judge.decide(judge.evidence(name, judge.meta["reported"][:, self.ctx.core.index[name]], measured))

        final, why = self.check.verdict(rows, report.decisions, decide, report.quorum)
        report.decisions.update(final)
        report.regathered = why
        return not why

    def again(self) -> bool:
        self.undone()
        return True

    def undone(self) -> None:
        self.ctx.core.rule.load(*_copy_state(self.provisional))


def merge_for(ctx: Context) -> Merge:
    """The merge of a round in `ctx.report.mode`."""
    if ctx.report.mode == "sketched":
        return Sketched(ctx)
    if ctx.report.mode == "gathered":
        return Combined(ctx) if isinstance(ctx.core.rule, Combiner) else Gathered(ctx)
    return Summed(ctx)


def _copy_state(state: tuple[dict[str, Any], dict[str, Tensor]]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    meta, tensors = state
    return json.loads(json.dumps(meta)), {k: v.clone() for k, v in tensors.items()}
