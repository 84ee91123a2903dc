"""What a gathered round measures on the contributions the clusters actually sent: their Gram matrix
(norms, pairwise cosines, the norm of any weighted sum), which of them are finite, and a count sketch of each
(a fixed random projection to `dim` buckets that keeps inner products in expectation) for the direction test.

Every cluster must take the same decision from these numbers, so they are computed in a canonical layout:
on the unit's whole flat Δ when every rank holds it (clusters of different size: the chunked layout
assembles it), or per rank on its shard when every cluster has the same layout (equal sizes: rank r
holds the same elements everywhere), summed over the cluster's ranks in rank order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from edit_train.local_sgd.protocols import ClusterGroup, Contributions

_MUL = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio multiplier as a signed int64 (wrapping arithmetic)


@dataclass
class Measured:
    gram: Tensor  # float64 [P, P]: ⟨Δᵢ, Δⱼ⟩ over the whole unit (NaN rows for non-finite senders)
    finite: list[bool]
    sketches: Tensor | None  # float64 [P, dim]
    grams: Tensor | None = None  # float64 [E, P, P]: the Gram matrix of each expert's rows (`groups` given)

    @property
    def norms(self) -> Tensor:
        d = self.gram.diagonal().clone()
        return torch.where(torch.tensor(self.finite), d.clamp_min(0).sqrt(), torch.full_like(d, math.nan))


def shard_range(param: Tensor, rank: int, size: int) -> tuple[int, int]:
    """The dim-0 rows [lo, hi) of the whole parameter that this rank's local part holds (FSDP2 Shard(0) is
    torch.chunk of dim 0: ceil(rows / size) rows per rank, the last ranks short or empty; unsharded: all)."""
    shape = tuple(param.shape)  # a DTensor reports the global shape
    local = param.to_local() if hasattr(param, "to_local") else param
    rows = shape[0] if shape else 1
    if local.numel() == math.prod(shape) or not shape:
        return 0, rows
    lo = min(rank * -(-rows // size), rows)
    return lo, lo + (local.shape[0] if local.dim() else 0)


def shard_positions(params: list[Tensor], rank: int, size: int) -> list[Tensor]:
    """The position of every element of this rank's local part of each parameter in the unit's flat Δ
    (parameters flattened and concatenated in order; FSDP2 Shard(0) is torch.chunk of dim 0)."""
    out, offset = [], 0
    for p in params:
        shape = tuple(p.shape)
        numel = math.prod(shape)
        local = p.to_local() if hasattr(p, "to_local") else p
        start = shard_range(p, rank, size)[0] * (numel // max(shape[0], 1)) if shape else 0
        out.append(offset + start + torch.arange(local.numel(), dtype=torch.int64))
        offset += numel
    return out


def buckets(pos: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """The count sketch's bucket and sign of every flat position (a fixed hash: the same on every cluster)."""
    h = pos * _MUL + 0x632BE59BD9B4E019  # wraps in int64
    return (h >> 17) & (dim - 1), ((h >> 43) & 1).to(torch.float32) * 2 - 1


Groups = Callable[[bool], tuple[Callable[[Tensor], Tensor], int]]  # whole -> (rows [P, N] -> [E, P, P], E)


def _partials(rows: Tensor, hashed: tuple[Tensor, Tensor] | None, dim: int,
              grams: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """[P, P + dim (+ E·P)] (float64): Gram rows, sketches (and each expert's Gram rows) of this part of the
    module. The products accumulate in fp32 (BLAS); the decisions made from them need far less than fp32's
    precision. A non-finite row shows as a non-finite diagonal entry (and its own sketch row): nothing else is
    contaminated."""
    x = rows.float()
    parts = [(x @ x.T).double()]
    if dim > 0 and hashed is not None:
        b, sign = hashed
        parts.append(torch.zeros(x.shape[0], dim, dtype=torch.float32).index_add_(1, b, x * sign).double())
    if grams is not None:
        parts.append(grams(x).permute(1, 0, 2).reshape(x.shape[0], -1).double())
    return torch.cat(parts, dim=1)


def measure(got: Contributions, cluster: ClusterGroup, hashed: Callable[[bool], tuple[Tensor, Tensor] | None],
            dim: int, groups: Groups | None = None) -> Measured:
    """Gram matrix, finiteness and (dim > 0, a power of two) sketches of every cluster's contribution.
    `hashed(whole)`: the sketch's buckets and signs for the whole flat unit, or this rank's shard of it;
    `groups(whole)`: how to take each expert's Gram matrix in that layout, and how many experts (`experts.py`)."""
    whole = got.whole is not None
    grams, experts = groups(whole) if groups is not None else (None, 0)
    if got.whole is not None:  # identical on every rank of every cluster
        m = _partials(got.whole, hashed(True), dim, grams)
    else:
        rows = got.rows if got.rows is not None else \
            torch.stack([torch.cat([t.detach().reshape(-1).cpu() for t in parts]) for parts in got.parts])
        per_rank = cluster.all_gather(_partials(rows, hashed(False), dim, grams).to(cluster.device)).cpu()
        m = per_rank[0].clone()
        for r in range(1, per_rank.shape[0]):  # rank order: the same sum in every cluster of this layout
            m += per_rank[r]
    n = m.shape[0]
    finite = [math.isfinite(v) for v in m.diagonal().tolist()]
    gram = m[:, :n].clone()
    for i, ok in enumerate(finite):
        if not ok:
            gram[i, :] = gram[:, i] = math.nan
    end = m.shape[1] - experts * n
    per_expert = m[:, end:].reshape(n, experts, n).permute(1, 0, 2).clone() if experts else None
    return Measured(gram, finite, m[:, n:end].clone() if dim > 0 else None, per_expert)


def cosine(a: Tensor, b: Tensor) -> float:
    """cos(a, b) in float64 (0 when either is zero)."""
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else 0.0


def snap(w: float, bits: int = 30) -> float:
    """A weight on a 2^-bits grid: measurements that differ in their last bits between clusters (another
    summation order on other hardware) still give every cluster the same weight."""
    return round(w * (1 << bits)) / (1 << bits)


PROBE_BOUND = 1.0  # a probe score counts at most ±100 % (one wild evaluator cannot pull a middle value far)
# what honest sites with other data do to each other's probe loss, above what the quorum's typical update does:
# up to tens of percent (benchmarks/false_positives.py, four-language sites, 3 seeds: +77 % at most, at a site's
# second and third scores — before its own history holds PROBE_WARM scores this is its whole threshold); a site's
# typical harm counts up to it, and more is harmful whatever the site's history (a liar creeping up is held here)
PROBE_LIE = 0.8
# an evaluator is suspected only when, on most updates it scored, it is this far (relative probe loss) from the
# other evaluators' lower median: honest four-language sites' median distance reached 0.87 (false_positives.py,
# seed 0), a liar scoring every update +1000 % (bounded to +100 %) against others' −20..−45 % is 1.2-1.45 away.
# Below it, the lower median of at least two other evaluators already bounds what one evaluator's score does. The
# distance is taken on scores bounded at ±PROBE_WILD (not PROBE_BOUND, which bounds what a score counts for): an
# evaluator claiming +1000 % is 10 away from the others, one claiming +100 % is within what honest sites show. An
# evaluator whose score is the only one an update got is named only above PROBE_BOUND + PROBE_DISAGREE: it decided
# nothing, and honest unlike sites score each other's updates up to +58 %.
PROBE_DISAGREE, PROBE_WILD = 0.95, 10.0


def _lower_median(values: Tensor) -> float:
    """The lower of the middle two (the middle one for an odd count): above a threshold only when a strict
    majority of the values is."""
    return float(values.sort().values[(values.numel() - 1) // 2])


def probe_judgement(scores: Tensor, tolerance: float, backed: set[int] | None = None) -> tuple[Tensor, dict[int, str]]:
    """[evaluators, candidates] relative loss changes -> (per candidate the lower median of the bounded scores
    the *other*, unsuspected evaluators gave it, NaN unless at least two of them measured it, less the quorum's
    `baseline` — what a typical update does to the others' probe loss; the suspected
    evaluators). Nobody vouches for its own update, and no single evaluator decides alone: with two clusters
    each update has one other evaluator, so the probe flags nobody. An evaluator is suspected when, for a strict
    majority of the updates it can be compared on, its score is more than `tolerance` (at least `PROBE_DISAGREE`)
    from the lower median of the other evaluators of that update; its scores are then not counted ("disagrees").
    An evaluator whose score above `PROBE_BOUND` + `PROBE_DISAGREE` is the only one an update got is named too
    ("alone"): it decided nothing — unless that update is in `backed` (the receivers' own tests left it out or
    clipped it: a two-cluster garbage or 10x payload raises an honest evaluator's probe loss by more than that, and
    the evaluator told the truth). Honest sites with other data disagree by less (`PROBE_DISAGREE`)."""
    wild = scores.to(torch.float64).clamp(-PROBE_WILD, PROBE_WILD)  # NaN (not measured) stays NaN
    s = wild.clamp(-PROBE_BOUND, PROBE_BOUND)
    n_eval, n_cand = s.shape
    suspects: dict[int, str] = {}
    for e in range(n_eval):
        compared = disagreed = 0
        for c in range(n_cand):
            if c == e or not math.isfinite(float(s[e, c])):
                continue
            others = torch.tensor([float(wild[j, c]) for j in range(n_eval) if j not in (e, c)], dtype=torch.float64)
            others = others[torch.isfinite(others)]
            if others.numel():
                compared += 1
                disagreed += int(abs(float(wild[e, c]) - _lower_median(others)) > max(tolerance, PROBE_DISAGREE))
        if compared and 2 * disagreed > compared:
            suspects[e] = "disagrees"
    out = []
    for c in range(n_cand):
        who = [e for e in range(n_eval) if e != c and e not in suspects and math.isfinite(float(s[e, c]))]
        col = torch.tensor([float(s[e, c]) for e in who], dtype=torch.float64)
        out.append(_lower_median(col) if col.numel() >= 2 else math.nan)
        if len(who) == 1 and float(wild[who[0], c]) > PROBE_BOUND + PROBE_DISAGREE and c not in (backed or set()):
            suspects.setdefault(who[0], "alone")
    judged = torch.tensor(out, dtype=torch.float64)
    return judged - baseline(judged), suspects


def baseline(judged: Tensor) -> float:
    """What an update typically does to the others' probe loss: the lower median of the judged candidates (0 when
    that is an improvement or nothing was judged). Sites with their own data make every other site's local model
    worse on their slice (the four-language sites: by tens of percent); a harmful update is judged by how much
    more it hurts than the typical one does."""
    ok = judged[torch.isfinite(judged)]
    return max(0.0, _lower_median(ok)) if ok.numel() else 0.0
