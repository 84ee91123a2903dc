"""What a checkpoint keeps of the sync machinery, and what a heal copies between clusters: the outer state,
the aggregation rule's statistics, the transport's error-feedback residuals, the pacer, the counters and the
routed expert assignment (`expert_subsets=routed`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from edit_train.local_sgd.moe.assignment import RoutedAssignment
from edit_train.local_sgd.errors import HealError
from edit_train.local_sgd.moe.expert_bias import BiasSync
from edit_train.local_sgd.sync.healing import (LocalState, Replica, adopt_outer, adopt_replica, anchor_digest,
                                          collect_state, prefixed)
from edit_train.local_sgd.sync.membership import Membership
from edit_train.local_sgd.sync.outer import OuterState
from edit_train.local_sgd.sync.pacer import Pacer
from edit_train.local_sgd.protocols import Transport
from edit_train.local_sgd.sync.records import Records
from edit_train.local_sgd.aggregation.rules import Aggregator


class SyncState:
    def __init__(self, replica: Replica, rule: Aggregator, pacer: Pacer, membership: Membership, records: Records,
                 transport: Transport, outer: Callable[[], OuterState | None], start_local: Callable[[], None],
                 assignment: RoutedAssignment | None = None, bias: BiasSync | None = None) -> None:
        self.replica, self.rule, self.pacer, self.membership = replica, rule, pacer, membership
        self.records, self.t, self.outer, self.start_local = records, transport, outer, start_local
        self.assignment, self.bias = assignment, bias

    # ------------------------------------------------------------------ heal
    def heal_out(self) -> tuple[dict[str, Any], LocalState]:
        """What a source sends (JSON meta + this rank's tensors)."""
        rule_meta, rule_tensors = self.rule.state()
        outer = self.outer()
        meta = {"sync_index": self.membership.sync_index, "total_steps": self.pacer.total_steps,
                "global_step": self.pacer.global_step, "rule": rule_meta, "local_phase": outer is not None,
                **self._assignment(), **self._bias()}
        return meta, collect_state(self.replica, outer, rule_tensors)

    def anchor_digest(self) -> str:
        """The digest of this cluster's whole anchor (what it claims to hold in a quorum request; "" before the
        local-SGD phase). Every rank takes part (a sharded anchor is gathered); the leader's is the one sent."""
        outer = self.outer()
        if outer is None:
            return ""
        c = self.t.cluster
        local = collect_state(self.replica, outer, {})
        full = {k: c.full(t, like) for k, (t, like) in local.items() if "/anchor/" in k}
        return anchor_digest(full) if c.rank == 0 else ""

    def heal_in(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        """A healer takes what it received (keeping its local progress in the local-SGD phase) and the source's
        expert assignment."""
        if self.assignment is not None:
            self.assignment.load(meta.get("assignment"))
        if meta.get("local_phase"):
            if self.outer() is None:
                self.start_local()
            outer = self.outer()
            assert outer is not None
            adopt_outer(self.replica, outer, tensors, self.t.feedback)
            self.rule.load(dict(meta.get("rule") or {}), prefixed(tensors, "penalty/"))
            if self.bias is not None:  # a joiner (or a cluster behind) starts from the anchor's expert bias
                try:
                    self.bias.load_json(meta.get("expert_bias"), f"healing payload from {meta.get('from', '?')}")
                except ValueError as exc:
                    raise HealError(str(exc)) from None
                self.bias.to_anchor()
        else:
            adopt_replica(self.replica, tensors)
        self.membership.holds(int(meta.get("sync_index", self.membership.sync_index)))
        p = self.pacer
        p.global_step = max(p.global_step, int(meta.get("global_step", 0)))
        if p.total_steps == 0 or p.lockstep:
            # lockstep schedules end at train.steps on every cluster: a cluster that healed (restarted, joined
            # late, or ran ahead/behind while cut off) continues from the federation's step; so does a cluster
            # with no steps of its own. Under a time schedule the clusters' step counts differ by design: one
            # that resumed its own checkpoint keeps its own count (its learning-rate schedule and data position
            # are that checkpoint's) and only takes the newer anchor (re-based: its local progress is kept)
            self.membership.adopt_step = p.adopt(int(meta.get("total_steps", 0)))

    # ------------------------------------------------------------------ checkpoint
    def tensors(self) -> dict[str, dict[str, Tensor]]:
        outer = self.outer()
        if outer is None:
            return {}
        return {"outer": outer.state_dict(), "penalty": self.rule.state()[1], "residual": self.t.feedback.state_dict()}

    def json(self) -> dict[str, Any]:
        return {"sync_index": self.membership.sync_index, "local_phase": self.outer() is not None,
                "bytes_sent": self.t.bytes_sent, "blocked_s": self.t.blocked_s, "rule": self.rule.state()[0],
                **self.pacer.state_json(), **self.records.state_json(), **self._assignment(), **self._bias()}

    def _bias(self) -> dict[str, Any]:
        return {"expert_bias": self.bias.state_json()} if self.bias is not None else {}

    def _assignment(self) -> dict[str, Any]:
        return {"assignment": self.assignment.state_json()} if self.assignment is not None else {}

    def load(self, tensors: dict[str, dict[str, Tensor]], state: dict[str, Any]) -> None:
        self.membership.holds(int(state["sync_index"]))
        self.membership.rejoining = True  # resumed: the federation may have moved on without this cluster
        self.pacer.load(state)
        self.records.load(state)
        self.t.carry(int(state["bytes_sent"]), float(state["blocked_s"]))
        if self.assignment is not None:
            self.assignment.load(state.get("assignment"))
        if state["local_phase"]:
            if self.outer() is None:
                self.start_local()
            outer = self.outer()
            assert outer is not None
            outer.load_state_dict(tensors["outer"])
            self.rule.load(dict(state.get("rule") or {}), tensors.get("penalty", {}))
            self.t.feedback.load_state_dict(tensors.get("residual", {}))
            if self.bias is not None:  # the anchor's bias (the live one is the model's buffer)
                self.bias.load_json(state.get("expert_bias"), "checkpoint")
