"""The rows of experts in one sync round: the round's one hook for an MoE model (`experts.py` holds which rows
are whose and the routed counts). Through it the round reports and sends only the rows a cluster sends, tells
the rule who routed what, weighs each expert's rows by its own weights, and keeps the rows a cluster did not
send. A dense model (no `Experts`) goes through the same object, which then changes nothing.

Where a new way of merging experts goes: `merge` (a gathered round's Σᵢ Wᵢ∘Δᵢ, in quorum order) and `send` (what
a cluster puts into a SUM) — e.g. an expert's update only from the clusters that own it — decided per expert
from what the exchange carried (`read`, `sent`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from edit_train.local_sgd.aggregator import Decision
from edit_train.local_sgd.sync.core import SyncCore, SyncReport
from edit_train.local_sgd.evidence import Groups, Measured
from edit_train.local_sgd.moe.experts import Held, merged_sqnorm, pin, unsent_rows
from edit_train.local_sgd.protocols import Contributions


class ExpertRows:
    """One round's expert rows (a dense model: `core.experts` is None and every method is a no-op)."""

    def __init__(self, core: SyncCore, report: SyncReport) -> None:
        self.core, self.report, self.experts = core, report, core.experts
        self.exchanged: Tensor | None = None  # [P, MoE layers, experts]: the routed tokens every cluster reported
        self.held: dict[str, Held] = {}  # per unit: the rows of this cluster's Δ it did not send, to keep
        report.expert_shares = dict(self.experts.shares) if self.experts is not None else {}

    # ------------------------------------------------------------------ the exchange
    def take(self) -> list[float]:
        """The routed counts this round carries (kept until it commits)."""
        return self.experts.take() if self.experts is not None else []

    @property
    def width(self) -> int:
        return self.experts.width if self.experts is not None else 0

    def reported(self, name: str, delta: list[Tensor]) -> list[Tensor]:
        """Unit `name`'s Δ as this cluster reports its norm: what it sends."""
        if self.experts is None:
            return delta
        return self.experts.sending(name, delta, self.core.unit(name).params, *self.core.where)

    def read(self, columns: Tensor) -> None:
        """The routed tokens of every cluster, from the exchange."""
        if self.experts is not None and self.experts.pending is not None:
            self.exchanged = columns.reshape(columns.shape[0], *self.experts.pending.shape)

    # ------------------------------------------------------------------ the rule
    def evidence(self, name: str) -> dict[str, Tensor]:
        """`expert_tokens` and `expert_sent` of unit `name` for the rule (nothing for a unit without experts)."""
        if self.experts is None or name not in self.experts.units or self.exchanged is None:
            return {}
        return {"expert_tokens": self.experts.tokens(name, self.exchanged), "expert_sent": self.sent(name)}

    def sent(self, name: str) -> Tensor:
        """bool [P, E]: which of unit `name`'s experts each cluster sends."""
        assert self.experts is not None
        return self.experts.sent_by(name, self.exchanged, len(self.report.quorum))

    def pin(self, d: Decision, finite: list[bool] | None) -> Decision:
        """The expert weights this round applies (`experts.pin`); none for a unit without experts."""
        if d.expert_weights is None or self.core.unit_experts(d.module) is None:
            d.expert_weights = None
            return d
        return pin(d, self.sent(d.module), finite)

    def groups(self, name: str) -> Groups | None:
        """How to measure each expert's Gram matrix of unit `name` (a rule that may weigh experts)."""
        ue = self.core.unit_experts(name)
        if ue is None or self.experts is None or not self.experts.weighs:
            return None
        params, where = self.core.unit(name).params, self.core.where
        return lambda whole: (ue.grams(params, *where, whole), ue.count)

    # ------------------------------------------------------------------ moving and merging
    def send(self, name: str, raw: list[Tensor], decision: Decision | None) -> tuple[list[Tensor], Any] | None:
        """What this cluster sends of unit `name` and which rows go (None: the unit's rows are nothing special):
        gathered (`decision` None), only the experts it touched; in a SUM, each expert's rows by its own weight,
        the rows of experts nobody weighs not at all. What it does not send it keeps (`keep`)."""
        if self.experts is None or self.core.unit_experts(name) is None:
            return None
        params, me = self.core.unit(name).params, self.report.position
        if decision is None:
            rows, unsent = self.experts.gathered(name, self.sent(name), params, me)
            delta, mine = raw, rows[me] if rows is not None else None
        elif decision.expert_weights is None:
            return None
        else:
            delta, rows, unsent = self.experts.summed(name, raw, params, *self.core.where, decision, me)
            mine = rows
        if mine is not None:  # a copy of the rows it does not send, only those
            self.held[name] = unsent_rows(raw, mine, params, *self.core.where)
        self.report.unsent += unsent
        return delta, rows

    def merge(self, name: str, got: Contributions, m: Measured, w: list[float], ew: list[list[float]],
              record: Callable[[str, list[list[Tensor]], list[float]], None] | None) -> tuple[list[Tensor], float]:
        """Σᵢ Wᵢ∘Δᵢ with each expert's rows weighted by its own weights, in quorum order, and its ‖·‖² from the Gram
        matrices of the rest of the unit and of each expert (the same numbers on every cluster). `record`, when
        given, gets each cluster's part as weighted (a later retraction)."""
        ue, params, where = self.core.unit_experts(name), self.core.unit(name).params, self.core.where
        assert ue is not None and m.grams is not None
        used = [i for i in range(len(w)) if w[i] != 0.0 or any(row[i] != 0.0 for row in ew)]
        mine = [[row[i] for row in ew] for i in range(len(w))]
        if record is not None:
            record(name, [ue.scaled(p, params, *where, w[i], mine[i]) if i in used else p
                          for i, p in enumerate(got.parts)], [float(i in used) for i in range(len(w))])
        total = [torch.zeros_like(d, dtype=torch.float32) for d in got.parts[self.report.position]]
        for i in used:  # quorum order: the same sum on every cluster
            ue.accumulate(total, got.parts[i], params, *where, w[i], mine[i])
        return total, merged_sqnorm(m.gram, m.grams, used, w, ew)

    # ------------------------------------------------------------------ after the apply
    def keep(self, name: str, live: list[Tensor], sent: bool) -> bool:
        """The rows of experts this cluster did not send (it routed them fewer than `expert_min_tokens` tokens, or
        nobody weighs them in a SUM): θ ← θ̄_new − Δₑ there, its own raw Δ (overlap: plus its progress since the
        snapshot, which the re-base kept), so its next Δ on them carries it and goes when it sends the expert
        again. Unless its contribution to the unit counted (`sent`: weight > 0, finite, not skipped) and the rows
        are finite, it lands on θ̄ and lets them go. True when something was kept."""
        held = self.held.pop(name, None)
        if not held or not sent or not all(bool(torch.isfinite(rows).all()) for _, _, rows in held):
            return False
        for k, idx, rows in held:
            p = live[k]
            p.index_add_(0, idx.to(p.device), rows.to(p.device, p.dtype), alpha=-1)
        return True

    def unowned_to_anchor(self, name: str, live: list[Tensor]) -> None:
        """Under a decided routed map (`expert_subsets=routed`), after the apply of unit `name`: the rows of the
        experts this cluster does not own are θ̄_new exactly, whatever the re-base and `keep` left there (before the
        unit's forward in a layer-wise sync)."""
        a = self.experts.assignment if self.experts is not None else None
        if a is None or not a.decided or name not in self.experts.units:
            return
        owned = a.owned(self.core.transport.name, self.experts.units[name].count)
        if owned is not None:
            unit = self.core.unit(name)
            self.experts.to_anchor([(name, live, self.core.outer.anchors[name], unit.params)], owned,
                                   *self.core.where)

    def forget(self) -> None:
        self.held.clear()

    def committed(self) -> None:
        if self.experts is not None:
            self.experts.committed(self.exchanged, self.report.quorum)
