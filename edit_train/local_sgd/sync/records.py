"""What this cluster's syncs did: counters for the summary and the `sync` / `sync_aborted` / `missed`
events (emitted by the cluster's leader; bytes are summed and blocked time maxed over its ranks)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from edit_train.local_sgd.aggregator import Decision
from edit_train.local_sgd.protocols import Transport
from edit_train.local_sgd.sync.round import SyncReport
from edit_train.local_sgd.aggregation.suspects import Suspects


class Records:
    def __init__(self, transport: Transport, emit: Callable[..., None] | None, cluster_index: int,
                 suspects: Suspects | None = None) -> None:
        self.t, self.emit, self.index = transport, emit, cluster_index
        self.suspects = suspects if suspects is not None else Suspects(transport.name)
        self.syncs_done = self.syncs_missed = self.syncs_aborted = self.anomalies = 0
        self.history: list[int] = []  # local steps of each completed sync
        self.step = 0  # the step at which the sync in progress started

    def _log(self, event: str, **fields: Any) -> None:
        if self.emit is not None and self.t.cluster.rank == 0:
            self.emit(event, step=self.step, cluster_index=self.index, cluster=self.t.name, **fields)

    def completed(self, report: SyncReport) -> None:
        self.syncs_done += 1
        self.history.append(report.local_steps)
        record = summarize(report)
        # the cluster's bytes are every rank's own shard traffic; blocked time is the slowest rank's
        c = self.t.cluster
        b = c.sum_(torch.tensor([float(record["bytes"])], dtype=torch.float64, device=c.device))
        m = c.max_(torch.tensor([record["blocked_s"]], dtype=torch.float64, device=c.device))
        record["bytes"], record["blocked_s"] = int(b.item()), float(m.item())
        if record["anomalous"]:
            self.anomalies += 1
        # the clusters this one named since its last sync event, by roster key (suspects.py)
        self._log("sync", **record, suspects=self.suspects.take())

    def aborted(self, report: SyncReport, why: str) -> None:
        self.syncs_aborted += 1
        self._log("sync_aborted", sync=report.sync, quorum=list(report.quorum), reason=why,
                  suspects=self.suspects.take())

    def missed(self, sync: int, local_steps: int, step: int) -> None:
        self.syncs_missed += 1
        self.step = step
        self._log("missed", sync=sync, local_steps=local_steps)

    def stats(self) -> dict[str, Any]:
        """This rank's totals (the trainer gathers one per rank of the cluster)."""
        return {"bytes_sent": self.t.bytes_sent, "blocked_s": self.t.blocked_s, "syncs": self.syncs_done,
                "anomalies": self.anomalies, "local_steps_per_sync": list(self.history),
                "syncs_missed": self.syncs_missed, "syncs_aborted": self.syncs_aborted}

    def state_json(self) -> dict[str, Any]:
        return {"anomalies": self.anomalies, "syncs_done": self.syncs_done, "syncs_missed": self.syncs_missed,
                "history": list(self.history)}

    def load(self, state: dict[str, Any]) -> None:
        self.anomalies = int(state["anomalies"])
        self.syncs_done = int(state["syncs_done"])
        self.syncs_missed = int(state.get("syncs_missed", 0))
        self.history = [int(h) for h in state.get("history", [])]


def summarize(report: SyncReport) -> dict[str, Any]:
    """The `sync` event fields for this cluster (docs/architecture.md §5)."""
    me = report.position
    decisions = list(report.decisions.values())
    sizes = [report.sizes.get(d.module, 1) for d in decisions]
    anomalous = [d.module for d in decisions if d.left_out[me]]
    clips = [c for c in report.clip.values() if c > 0] or [0.0]
    return {
        "sync": report.sync,
        "local_steps": report.local_steps,
        "pseudo_grad_norm": report.cluster_norm if math.isfinite(report.cluster_norm) else None,
        # this cluster's coefficient in the merged update (its weight per unit — per expert on an expert's rows
        # —, by size): 0 when it was left out of every unit; a sync's weights sum to the accepted share of the tokens
        "weight": sum(_coefficient(d, me, n, report.expert_shares.get(d.module, []))
                      for d, n in zip(decisions, sizes)) / max(sum(sizes), 1),
        "anomalous": bool(anomalous),
        "anomalous_modules": anomalous,
        "anomaly_details": anomaly_details(report.decisions, me),  # {module: the rule's evidence} of left-out ones
        "aggregation": report.mode,  # how this sync moved the contributions: sum | gathered | sketched
        "regathered": report.regathered,  # sketched, then gathered: why the sketches did not check out ("": no)
        "clip_coef": min(clips),
        "bytes": report.bytes,
        "unsent_params": report.unsent,  # elements of its Δ this cluster did not send (untouched experts' rows)
        # units whose experts weigh by routed tokens: this cluster's weight on each expert's rows
        "expert_weights": {d.module: [row[me] for row in d.expert_weights] for d in decisions
                           if d.expert_weights is not None},
        "blocked_s": report.blocked_s,
        "quorum": list(report.quorum),
        # clusters whose update of the last sync was admitted, then judged harmful by the probe, and taken back
        "retracted": {n: dict(v) for n, v in report.retracted.items()},
        # evaluators whose probe scores did not count, by roster name: "disagrees" with the others, or "alone"
        "probe_suspects": dict(report.probe_suspects),
        # algo.expert_bias: the rule, MaxVio of each cluster's and the federation's interval load per MoE layer
        **({"expert_bias": dict(report.expert_bias)} if report.expert_bias else {}),
    }


def _coefficient(d: Decision, me: int, numel: int, shares: list[float]) -> float:
    """Cluster `me`'s weight in unit `d` times the unit's size (its experts' rows, `shares` of it, at their own
    weights)."""
    if d.expert_weights is None or not shares:
        return d.weights[me] * numel
    rest = d.weights[me] * (1.0 - sum(shares))
    return numel * (rest + sum(row[me] * f for row, f in zip(d.expert_weights, shares)))


def anomaly_details(decisions: Mapping[str, Decision], cluster: int) -> dict[str, dict[str, Any]]:
    """`{module: the rule's evidence about it}` for every unit that left `cluster` out (for the `sync` event:
    why); non-finite values become None."""
    return {name: d.as_dict()["evidence"][cluster] if d.evidence else {}
            for name, d in decisions.items() if d.left_out[cluster]}
