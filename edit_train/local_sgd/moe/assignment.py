"""Expert subsets assigned by routing (`expert_subsets=routed`): every cluster trains and sends every expert for
the first `syncs` committed syncs (the warm-up), counting the tokens each member routed to each expert of each MoE
layer as the exchange carried them; at the commit that ends the warm-up each cluster decides the same map from the
same counts (`routed_owners`, layer by layer: expert e of one layer is another map than expert e of the next),
and from then on trains and sends only its own experts (`experts.owned_counts`).

* **One map everywhere.** The counts are the exchange's (every member of a sync holds the same numbers), summed
  per cluster name over the warm-up's committed syncs; the map is a pure function of them. A cluster that missed
  a warm-up sync, restarted or joined late takes the state from its healing source (`SyncState.heal_in`) and a
  resumed one from its checkpoint (`SyncState.json`): the assignment is never recomputed from a partial view.
* **Who is in the map.** The clusters seen in the warm-up, in name order. A cluster the map does not name (it
  joined after the decision) owns every expert: it trains and sends all of them, and its tokens weigh its share
  of each expert's update as they do without subsets.
* **What it trusts.** The reported counts, as capped by the verified rule for the token weights
  (`max_token_ratio` bounds a claim's total, not its spread): an insider can claim the experts it routes most
  to, not more than its balanced share (`routed_owners`), and an expert's update still passes the rule's tests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["routed_owners", "RoutedAssignment"]

log = logging.getLogger(__name__)


def routed_owners(counts: Tensor) -> tuple[int, ...]:
    """The owner of each expert from ``[clusters, experts]`` routed counts: balanced greedy by share.

    Every (cluster, expert) pair is ranked by the share of the cluster's own tokens it routed to the expert
    (descending; ties by cluster, then expert), and a pair is taken while its expert has no owner and its cluster
    is below its quota: ⌊E/P⌋ experts each, and ⌈E/P⌉ for the first E mod P clusters that reach ⌊E/P⌋ + 1. Every
    expert gets exactly one owner; a cluster that routed nothing shares equally (its shares are all 0)."""
    clusters, experts = counts.shape
    if clusters == 0:
        raise ValueError("routed_owners: no cluster to own the experts")
    c = counts.to(torch.float64).clamp_min(0.0)
    share = c / c.sum(1, keepdim=True).clamp_min(1e-300)
    low, extra = divmod(experts, clusters)
    ranked = sorted(range(clusters * experts), key=lambda k: (-float(share[k // experts, k % experts]), k))
    owner = [-1] * experts
    owns = [0] * clusters
    above = 0  # clusters holding low + 1 experts
    for k in ranked:
        i, e = divmod(k, experts)
        quota = low + 1 if above < extra or owns[i] > low else low
        if owner[e] < 0 and owns[i] < quota:
            owner[e] = i
            owns[i] += 1
            above += owns[i] == low + 1
    assert min(owner) >= 0, owner  # the quotas sum to E: the last pairs fill what is left
    return tuple(owner)


class RoutedAssignment:
    """The warm-up's counts and, once decided, the map (cluster name → the experts it owns)."""

    def __init__(self, syncs: int) -> None:
        if syncs < 1:
            raise ValueError(f"expert_subsets=routed needs a warm-up of >= 1 sync, got {syncs}")
        self.syncs = syncs  # committed syncs of every-expert training the map is measured over
        self.seen = 0  # committed syncs counted so far
        self.counts: dict[str, list[list[float]]] = {}  # cluster name -> [MoE layer][expert] tokens routed
        self.owners: dict[str, tuple[tuple[int, ...], ...]] | None = None  # decided: name -> per layer its experts

    @property
    def decided(self) -> bool:
        return self.owners is not None

    def owned(self, name: str, experts: int) -> tuple[tuple[bool, ...], ...] | None:
        """Per MoE layer, which experts cluster `name` trains and sends (None: every one — the warm-up, or not in
        the map)."""
        if self.owners is None or name not in self.owners:
            return None
        return tuple(tuple(e in layer for e in range(experts)) for layer in self.owners[name])

    def observe(self, names: Sequence[str], exchanged: Tensor) -> bool:
        """A committed sync's exchange: `exchanged` [P, MoE layers, experts], the routed tokens each member in
        `names` (quorum order) reported. Counts it during the warm-up and decides the map at its end. True when
        this sync decided it."""
        if self.owners is not None:
            return False
        for name, rows in zip(names, exchanged.to(torch.float64).tolist()):
            old = self.counts.get(name)
            self.counts[name] = rows if old is None else [[a + b for a, b in zip(o, r)] for o, r in zip(old, rows)]
        self.seen += 1
        if self.seen < self.syncs:
            return False
        order = sorted(self.counts)
        counts = torch.tensor([self.counts[n] for n in order], dtype=torch.float64)  # [P, L, E]
        per_layer = [routed_owners(counts[:, layer]) for layer in range(counts.shape[1])]
        self.owners = {n: tuple(tuple(e for e, o in enumerate(owner) if o == i) for owner in per_layer)
                       for i, n in enumerate(order)}
        log.info("expert subsets decided after %d syncs (per MoE layer): %s", self.seen,
                 "; ".join(f"{n} {[list(x) for x in v]}" for n, v in self.owners.items()))
        return True

    # ------------------------------------------------------------------ checkpoint and heal (JSON)
    def state_json(self) -> dict[str, Any]:
        return {"syncs": self.syncs, "seen": self.seen, "counts": self.counts,
                "owners": None if self.owners is None else {n: [list(x) for x in v] for n, v in self.owners.items()}}

    def load(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's or a healing source's state (its map replaces this cluster's view)."""
        if not state:
            return
        self.seen = int(state["seen"])
        self.counts = {str(n): [[float(x) for x in row] for row in v] for n, v in dict(state["counts"]).items()}
        owners = state.get("owners")
        self.owners = None if owners is None else {str(n): tuple(tuple(int(e) for e in layer) for layer in v)
                                                   for n, v in owners.items()}
