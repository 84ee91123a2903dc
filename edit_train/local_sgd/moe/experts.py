"""Expert-aware sync (docs/sync_math.md, "Experts"): the tokens each cluster routed to each expert over the
interval a sync carries, which rows of a unit are which expert's, per-expert weights applied to those rows, and
which rows a cluster sends.

* `RoutedCounts` is what the trainer hands `LocalSGD` (the core knows no model): `take()` returns this cluster's
  routed (token, slot) counts since the last take, ``[MoE layers, experts]`` (a collective over the cluster's
  ranks: every rank calls it at the same point), and `pieces(name, unit, params)` which row of the counts is
  unit `name`'s and which rows of its parameters are each expert's (None: no experts in it).
* `Experts` (one per `SyncCore`) takes the counts when a round's exchange starts and keeps them until that
  round commits; after an abort the next take adds to them (the cluster kept its local progress, so its next
  Δ covers both intervals). A missed sync takes nothing: the counts stay with the model until the next one.
* An expert's rows are whole dim-0 rows of the unit's parameters (an MoE block's expert e: row e of the stacked
  gate/up/down projections); a rank's FSDP2 shard holds a contiguous range of them (`evidence.shard_range`).
  Everything here works per row, never per element, so it costs nothing next to the Δ itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from edit_train.local_sgd.aggregator import Decision
from edit_train.local_sgd.moe.assignment import RoutedAssignment
from edit_train.local_sgd.evidence import shard_range, snap
from edit_train.local_sgd.penalty import weighted

__all__ = ["Pieces", "RoutedCounts", "UnitExperts", "Experts", "pin", "merged_sqnorm", "token_shares",
           "expert_weights", "Held", "unsent_rows", "owned_experts", "owned_counts", "Owned", "layer_mask"]

# the experts a cluster owns under expert subsets: one mask for every MoE layer (a static map), or one per MoE layer
# (`routed`: each layer's experts are its own); `layer_mask` reads either
Owned = Sequence[bool] | Sequence[Sequence[bool]]
Pieces = list[list[tuple[int, slice]]]  # per expert: (index into the unit's params, rows of that parameter)
Held = list[tuple[int, Tensor, Tensor]]  # (parameter index, local dim-0 row indices, a copy of those rows of Δ)


@dataclass(frozen=True)
class RoutedCounts:
    """The trainer's hook (`train/routing.py` `RoutedTally.take`, `model/expert_params.py`)."""

    take: Callable[[], Tensor]  # [MoE layers, experts] int64 since the last take (sums over the cluster's ranks)
    pieces: Callable[[str, nn.Module, list[nn.Parameter]], tuple[int, Pieces] | None]


def _rowsize(p: Tensor) -> int:
    shape = tuple(p.shape)  # a DTensor reports the global shape
    return math.prod(shape) // shape[0] if shape and shape[0] else 1


@dataclass(frozen=True)
class UnitExperts:
    """The experts of one unit: `row` of the counts, `count` experts, and for each parameter holding expert rows
    the expert of each of its whole dim-0 rows (-1: no expert's)."""

    row: int
    count: int
    owner: dict[int, Tensor]  # param index -> int64 [dim-0 rows of the whole parameter]

    @staticmethod
    def of(row: int, pieces: Pieces, params: Sequence[Tensor]) -> UnitExperts:
        owner: dict[int, Tensor] = {}
        for e, parts in enumerate(pieces):
            for k, rows in parts:
                dim0 = params[k].shape[0] if params[k].dim() else 1
                owner.setdefault(k, torch.full((dim0,), -1, dtype=torch.int64))[rows] = e
        return UnitExperts(row, len(pieces), owner)

    def sizes(self, params: Sequence[Tensor]) -> list[int]:
        """Parameter elements of each expert (all its rows)."""
        out = [0] * self.count
        for k, own in self.owner.items():
            for e, n in enumerate(torch.bincount(own[own >= 0], minlength=self.count).tolist()):
                out[e] += n * _rowsize(params[k])
        return out

    def rows(self, keep: Sequence[bool], params: Sequence[Tensor]) -> list[Tensor | None]:
        """Per parameter, bool [dim-0 rows]: the rows that go when the experts `keep` says go (every row that is
        no expert's goes; None: the whole parameter)."""
        table = torch.tensor([bool(k) for k in keep] + [True])  # owner -1 -> the last entry
        return [table[self.owner[k]] if k in self.owner else None for k in range(len(params))]

    def unsent(self, keep: Sequence[bool], params: Sequence[Tensor]) -> int:
        """Parameter elements (of the whole unit) that do not go when only the experts `keep` says go."""
        return sum(int((~r).sum()) * _rowsize(p) for r, p in zip(self.rows(keep, params), params) if r is not None)

    def _times(self, k: int, t: Tensor, param: Tensor, rank: int, size: int, w: float, ew: Tensor) -> Tensor:
        """Local shard `t` of parameter `k`, each row times its weight (expert e's: ew[e]; others: w); a weight
        of 0 gives exact zeros, never NaN·0."""
        own = self.owner[k][slice(*shard_range(param, rank, size))]
        r = torch.where(own >= 0, ew[own.clamp_min(0)], torch.full(own.shape, w, dtype=torch.float64))
        if not r.numel():  # this rank holds none of the parameter's rows
            return t.clone()
        rows = t.reshape(r.numel(), -1)
        return torch.where((r == 0)[:, None], torch.zeros_like(rows), rows * r.to(rows.dtype)[:, None]).reshape(t.shape)

    def scaled(self, tensors: list[Tensor], params: Sequence[Tensor], rank: int, size: int, w: float,
               ew: Sequence[float]) -> list[Tensor]:
        """A cluster's local shards with each expert's rows times its weight `ew[e]` and everything else times
        `w` (fp32, as `penalty.weighted`)."""
        out = weighted(tensors, w)
        e = torch.tensor(list(ew), dtype=torch.float64)
        for k in self.owner:
            t = tensors[k].to(torch.promote_types(tensors[k].dtype, torch.float32))
            out[k] = self._times(k, t, params[k], rank, size, w, e)
        return out

    def accumulate(self, total: list[Tensor], part: list[Tensor], params: Sequence[Tensor], rank: int, size: int,
                   w: float, ew: Sequence[float]) -> None:
        """total += `part` weighted as `scaled` weighs it; tensors without expert rows exactly as the round adds
        a weighted part (`add_(part, alpha=w)`)."""
        e = torch.tensor(list(ew), dtype=torch.float64)
        for k, (t, p) in enumerate(zip(total, part)):
            if k in self.owner:
                t.add_(self._times(k, p.to(t.dtype), params[k], rank, size, w, e))
            elif w != 0.0:
                t.add_(p.to(t.dtype), alpha=w)

    def grams(self, params: Sequence[Tensor], rank: int, size: int, whole: bool) -> Callable[[Tensor], Tensor]:
        """rows [P, N] of the unit's flat Δ (the whole unit, or this rank's shards) -> [E, P, P]: the Gram
        matrix of each expert's rows (fp32 products, as the unit's own Gram matrix)."""
        segments = []
        offset = 0
        for k, p in enumerate(params):
            lo, hi = (0, p.shape[0] if p.dim() else 1) if whole else shard_range(p, rank, size)
            n = (hi - lo) * _rowsize(p)
            if k in self.owner and hi > lo:
                segments.append((offset, hi - lo, _rowsize(p), self.owner[k][lo:hi]))
            offset += n

        def grams(x: Tensor) -> Tensor:
            out = torch.zeros(self.count, x.shape[0], x.shape[0], dtype=torch.float32)
            for start, rows, width, own in segments:
                block = x[:, start:start + rows * width].float().reshape(x.shape[0], rows, width)
                per_row = torch.einsum("prs,qrs->rpq", block, block)
                mine = own >= 0
                out.index_add_(0, own[mine], per_row[mine])
            return out
        return grams


class Experts:
    """The experts of every unit, the counts of the round in flight, and the sending threshold (`min_tokens`: a
    cluster that routed fewer tokens to an expert does not send its rows and is no contribution to it; 0 sends
    every row). `weighs`: the rule may weigh experts (a gathered round then measures each expert's Gram matrix
    for the clip norm; the verified rule with `expert_weights=none` never does)."""

    def __init__(self, routed: RoutedCounts, units: Sequence[tuple[str, nn.Module, list[nn.Parameter]]],
                 min_tokens: int = 0, weighs: bool = True, assignment: RoutedAssignment | None = None) -> None:
        self.hook, self.min_tokens, self.weighs = routed.take, min_tokens, weighs
        self.assignment = assignment  # expert_subsets=routed: what the committed exchanges decide (assignment.py)
        self.units: dict[str, UnitExperts] = {}
        self.shares: dict[str, list[float]] = {}  # unit -> each expert's share of its elements
        for name, module, params in units:
            found = routed.pieces(name, module, params)
            if found is not None:
                self.units[name] = UnitExperts.of(found[0], found[1], params)
                total = sum(math.prod(p.shape) for p in params)
                self.shares[name] = [n / total for n in self.units[name].sizes(params)]
        self.pending: Tensor | None = None  # counts taken for the round in flight (float64 [L, E])

    def take(self) -> list[float]:
        """At a round's exchange: the counts since the last commit (this interval's, plus an aborted round's)."""
        got = self.hook().detach().to("cpu", torch.float64)
        self.pending = got if self.pending is None or self.pending.shape != got.shape else self.pending + got
        return self.pending.reshape(-1).tolist()

    def committed(self, exchanged: Tensor | None = None, names: Sequence[str] = ()) -> None:
        """The round committed: its counts are spent; under `expert_subsets=routed` the warm-up counts what every
        member reported (`exchanged` [P, L, E], `names` in quorum order)."""
        self.pending = None
        if self.assignment is not None and exchanged is not None:
            self.assignment.observe(names, exchanged)

    @torch.no_grad()
    def to_anchor(self, units: Sequence[tuple[str, list[Tensor], list[Tensor], Sequence[Tensor]]], owned: Owned,
                  rank: int, size: int) -> int:
        """The rows of the experts a cluster does not own take the anchor's values (`units`: per unit its name,
        live local shards, anchor local shards and parameters): where a newly decided map freezes them. Returns
        the elements reset on this rank."""
        done = 0
        for name, live, anchor, params in units:
            ue = self.units.get(name)
            if ue is None:
                continue
            mask = layer_mask(owned, ue.row)
            assert mask is not None
            for k, rows in enumerate(ue.rows(mask, params)):
                if rows is None or live[k].dim() == 0:
                    continue
                idx = _unsent_local(rows, params[k], rank, size).to(live[k].device)
                if idx.numel():
                    live[k].index_copy_(0, idx, anchor[k].index_select(0, idx.to(anchor[k].device)).to(live[k].dtype))
                    done += int(idx.numel()) * _rowsize(params[k])
        return done

    @property
    def width(self) -> int:
        """Values each cluster's row of the exchange carries (L · E)."""
        return self.pending.numel() if self.pending is not None else 0

    def sent(self, tokens: Tensor) -> Tensor:
        """bool [P, E]: which experts' rows each cluster sends (its tokens reach `min_tokens`; all when 0)."""
        return tokens >= self.min_tokens if self.min_tokens > 0 else torch.ones_like(tokens, dtype=torch.bool)

    def tokens(self, name: str, exchanged: Tensor) -> Tensor:
        """[P, E]: the tokens each cluster routed to unit `name`'s experts (`exchanged`: [P, L, E])."""
        ue = self.units[name]
        return exchanged[:, ue.row, :ue.count].clone()

    def sent_by(self, name: str, exchanged: Tensor | None, clusters: int) -> Tensor:
        """bool [P, E]: which of unit `name`'s experts each cluster sends (all when nothing was exchanged)."""
        if exchanged is None:
            return torch.ones(clusters, self.units[name].count, dtype=torch.bool)
        return self.sent(self.tokens(name, exchanged))

    def summed(self, name: str, delta: list[Tensor], params: Sequence[Tensor], rank: int, size: int, d: Decision,
               me: int) -> tuple[list[Tensor], list[Tensor | None] | None, int]:
        """This cluster's part of unit `name` in a SUM under decision `d`: each expert's rows times its weight on
        that expert, the rest times its unit weight; the rows of experts every cluster weighs 0 do not go
        (which rows go, None: all; and how many elements stay behind)."""
        assert d.expert_weights is not None
        ue = self.units[name]
        part = ue.scaled(delta, params, rank, size, float(d.weights[me]), [row[me] for row in d.expert_weights])
        keep = [any(x != 0.0 for x in row) for row in d.expert_weights]
        return (part, None, 0) if all(keep) else (part, ue.rows(keep, params), ue.unsent(keep, params))

    def gathered(self, name: str, sent: Tensor, params: Sequence[Tensor], me: int) -> tuple[list[Any] | None, int]:
        """What each cluster sends of unit `name` in a gather (per cluster, which rows of each parameter; None:
        everything — no `min_tokens`) and how many elements of this cluster's stay behind."""
        if self.min_tokens <= 0:
            return None, 0
        ue, rows = self.units[name], sent.tolist()
        return [ue.rows(r, params) for r in rows], ue.unsent(rows[me], params)

    def sending(self, name: str, delta: list[Tensor], params: Sequence[Tensor], rank: int, size: int) -> list[Tensor]:
        """This cluster's Δ of unit `name` as it sends it: without the rows of experts it routed fewer than
        `min_tokens` tokens to (what a cluster reports is what it sends)."""
        ue = self.units.get(name)
        if ue is None or self.min_tokens <= 0 or self.pending is None:
            return delta
        keep = self.sent(self.pending[ue.row, :ue.count]).double().tolist()
        return ue.scaled(delta, params, rank, size, 1.0, keep)


def _unsent_local(rows: Tensor, param: Tensor, rank: int, size: int) -> Tensor:
    """This rank's local dim-0 indices of the rows `rows` (bool, the whole parameter's rows that go) leaves out."""
    lo, hi = shard_range(param, rank, size)
    return (~rows[lo:hi]).nonzero().flatten()


def unsent_rows(delta: Sequence[Tensor], rows: Sequence[Tensor | None], params: Sequence[Tensor], rank: int,
                size: int) -> Held:
    """The rows of this rank's local shards `delta` that do not go (`rows`: per parameter, the whole parameter's
    dim-0 rows that go, None: all of it), copied — only those rows, for the cluster to keep (`SyncRound`)."""
    out: Held = []
    for k, (t, r) in enumerate(zip(delta, rows)):
        if r is None or t.dim() == 0:
            continue
        idx = _unsent_local(r, params[k], rank, size).to(t.device)
        if idx.numel():
            out.append((k, idx, t.index_select(0, idx)))
    return out


def pin(d: Decision, sent: Tensor, finite: list[bool] | None) -> Decision:
    """The expert weights a round applies: 0 for an expert a cluster did not send (gathered, `finite` given: also
    for a non-finite contribution), snapped to the unit weights' grid when gathered."""
    if d.expert_weights is not None:
        ok = finite if finite is not None else [True] * sent.shape[0]
        d.expert_weights = [[(snap(float(x)) if finite is not None else float(x)) if ok[i] and bool(sent[i, e])
                             else 0.0 for i, x in enumerate(row)] for e, row in enumerate(d.expert_weights)]
    return d


def merged_sqnorm(gram: Tensor, grams: Tensor, used: list[int], w: Sequence[float],
                  ew: Sequence[Sequence[float]]) -> float:
    """‖Σᵢ Wᵢ∘Δᵢ‖² over the contributors `used`: the rest of the unit at the unit weights `w` (its Gram matrix:
    the unit's less its experts'), each expert's rows at its own weights `ew[e]` (from the same numbers on every
    cluster)."""
    if not used:
        return 0.0
    ix = torch.tensor(used)
    per = grams[:, ix][:, :, ix]
    wt = torch.tensor([w[i] for i in used], dtype=torch.float64)
    we = torch.tensor([[row[i] for i in used] for row in ew], dtype=torch.float64)  # [E, used]
    sq = wt @ (gram[ix][:, ix] - per.sum(0)) @ wt + torch.einsum("ep,epq,eq->", we, per, we)
    return max(float(sq), 0.0)


def token_shares(counts: Tensor, sent: Tensor, backing: Tensor) -> Tensor:
    """[n, E]: the tokens behind each cluster's share of each expert: its backing (the tokens the unit rule
    counts for it) spread over the experts as it routed them (`counts` [n, E] over its row sum), 0 where it
    did not send the expert."""
    total = counts.sum(1, keepdim=True)
    share = torch.where(total > 0, counts / total.clamp_min(1e-300), torch.zeros_like(counts))
    return torch.where(sent, share * backing[:, None], torch.zeros_like(share))


def expert_weights(counts: Tensor, sent: Tensor, kept: Tensor, rejected: Tensor) -> Tensor:
    """[E, n]: each expert's weights. `kept`: the accepted clusters' token backing (0 for the left out);
    `rejected`: what a left-out cluster's share counts in the denominator (`left_out=zero`: its capped claim;
    `others`: 0). wᵢₑ = kept-share ᵢₑ / (Σⱼ kept-share ⱼₑ + Σₖ rejected-share ₖₑ); an expert no accepted
    cluster sent weighs 0 everywhere (no update, no NaN)."""
    num = token_shares(counts, sent, kept)
    den = num.sum(0) + token_shares(counts, sent, rejected).sum(0)
    w = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))
    return w.T.contiguous()


# ------------------------------------------------------------------------------------------ expert subsets
def owned_experts(spec: str, index: int, clusters: int, experts: int) -> tuple[bool, ...] | None:
    """Which experts cluster `index` (of `clusters` configured) trains and sends under `expert_subsets=spec`
    (SPES-style; None: off, every expert). ``split``: expert e is cluster (e mod clusters)'s; ``0+1|2+3``: cluster
    i's experts are the i-th ``|``-separated list; ``routed``: decided at run time (`assignment.py`), None here.
    Raises ValueError (one line) for a spec that leaves an expert to nobody or names one the model does not
    have."""
    if not spec or spec == "routed":
        return None
    if spec == "split":
        owners = [[e for e in range(experts) if e % clusters == i] for i in range(clusters)]
    else:
        try:
            owners = [[int(x) for x in part.split("+") if x.strip()] for part in spec.split("|")]
        except ValueError:
            raise ValueError(f"expert_subsets={spec!r}: use split, routed, or each cluster's experts as 0+1|2+3") \
                from None
        if len(owners) != clusters:
            raise ValueError(f"expert_subsets={spec!r} names {len(owners)} clusters' experts, the federation has "
                             f"{clusters}")
    named = {e for o in owners for e in o}
    if bad := sorted(e for e in named if not 0 <= e < experts):
        raise ValueError(f"expert_subsets={spec!r}: expert(s) {bad} not in the model's {experts}")
    if orphans := sorted(set(range(experts)) - named):
        raise ValueError(f"expert_subsets={spec!r}: expert(s) {orphans} belong to no cluster (nobody would train "
                         "them); give each expert at least one owner")
    mine = set(owners[index % clusters])
    return tuple(e in mine for e in range(experts))


def layer_mask(owned: Owned | None, layer: int) -> tuple[bool, ...] | None:
    """MoE layer `layer`'s mask of `owned` (None: every expert)."""
    if owned is None:
        return None
    if len(owned) and isinstance(owned[0], (tuple, list)):
        return tuple(bool(x) for x in owned[layer])  # type: ignore[union-attr]
    return tuple(bool(x) for x in owned)  # type: ignore[arg-type]


def owned_counts(counts: Tensor, owned: Owned | None) -> Tensor:
    """A cluster's routed counts [layers, experts] as it reports them under expert subsets: 0 for every expert it
    does not own, so every cluster knows from the exchange that it sends none of that expert's rows and backs
    none of its update (`Experts.sent` with min_tokens ≥ 1)."""
    if owned is None:
        return counts
    mask = torch.tensor([layer_mask(owned, layer) for layer in range(counts.shape[0])], dtype=torch.bool)
    return torch.where(mask, counts, torch.zeros_like(counts))
