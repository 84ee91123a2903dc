"""Checking a SUM against its parts without gathering them (a rule that needs measurements, above
`sync.gather_max` clusters; docs/sync_math.md, "Sketched").

Every cluster decides its weight wᵢ from what was *reported* (provisionally), sends wᵢΔᵢ into a SUM all-reduce
per unit, and once a unit's sum S has landed computes, under a projection seeded by S itself (so no cluster
could know it when it sent its part), two count sketches: s = R·S and uᵢ = R·Δᵢ of its own pseudo-gradient.
The commit vote carries every cluster's (s, u) for every unit, and every cluster evaluates the same verdict
from those rows:

* the sum check: ‖median(s) − Σᵢ wᵢuᵢ‖ ≤ tol · Σᵢ wᵢ‖uᵢ‖. When it holds, each uᵢ with wᵢ > 0 is the sketch of
  what cluster i really sent (a cluster that sent anything else would need its uᵢ to absorb exactly R·(the
  difference), a projection it could not know when it sent): the rule then decides again, on these sketches;
* that decision must equal the provisional one.

Anything else — a non-finite sum, a failed check, a decision that differs — and the sync is gathered instead
(every contribution to every cluster, judged exactly), so a misreport is caught at the price of one gather.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import Tensor

from edit_train.local_sgd.aggregator import Decision
from edit_train.local_sgd.evidence import snap
from edit_train.local_sgd.protocols import ClusterGroup

DIGEST_DIM = 64  # buckets of the fixed sketch a unit's sum is digested from (the seed of the check)
EXACT_TOLERANCE = 1e-4  # relative gap of the sum check on lossless links (fp32 summation order stays far below)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(z: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def seeded(pos: Tensor, dim: int, seed: int) -> tuple[Tensor, Tensor]:
    """A count sketch's bucket and sign of every flat position under a hash keyed by `seed` (splitmix64's
    finalizer over position + seed: every output bit depends on every input bit, so no pair of positions
    collides under every seed)."""
    z = pos * _GOLDEN + seed  # wraps in int64
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    z = z ^ _shr(z, 31)
    return z & (dim - 1), (_shr(z, 63) & 1).to(torch.float32) * 2 - 1


def sketch(local: list[Tensor], hashed: tuple[Tensor, Tensor], dim: int, cluster: ClusterGroup) -> Tensor:
    """[dim] float64: the count sketch of a unit's tensors, summed over the cluster's ranks in rank order (each
    rank holds its shard; `hashed` are its elements' buckets and signs): the same on every cluster of this
    layout."""
    bucket, sign = hashed
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in local])
    part = torch.zeros(dim, dtype=torch.float32).index_add_(0, bucket, flat * sign).double()
    if cluster.size == 1:
        return part
    ranks = cluster.all_gather(part.to(cluster.device)).cpu()
    out = ranks[0].clone()
    for r in range(1, ranks.shape[0]):
        out += ranks[r]
    return out


def seed_of(digest: Tensor, salt: str) -> int:
    """A 63-bit seed from a digest sketch, rounded to 20 significant bits first so that clusters whose sums
    differ only in their last bits (another summation order) draw the same projection."""
    mant, expo = torch.frexp(digest.double())
    key = torch.stack([torch.round(mant * (1 << 20)), expo.double()]).to(torch.int64)
    h = hashlib.blake2b(key.numpy().tobytes(), digest_size=8, person=b"edit-train-sk")
    h.update(salt.encode())
    return int.from_bytes(h.digest(), "little") & 0x7FFFFFFFFFFFFFFF


class SketchCheck:
    """The check of one sketched round: what this cluster proves per unit, and the verdict over everyone's
    rows. `units` in unit order; `dim` buckets per sketch; `tolerance` of the sum check (relative)."""

    def __init__(self, units: list[str], dim: int, tolerance: float, salt: str) -> None:
        self.units, self.dim, self.tolerance, self.salt = units, dim, tolerance, salt
        self.proofs: dict[str, Tensor] = {}  # unit -> [s ‖ u]

    def landed(self, name: str, total: list[Tensor], own: list[Tensor], positions: Tensor,
               fixed: tuple[Tensor, Tensor], cluster: ClusterGroup) -> None:
        """Unit `name`'s sum landed (`total`, this rank's shard) and `own` is this cluster's Δ of it: sketch both
        under the projection the sum seeds."""
        seed = seed_of(sketch(total, fixed, DIGEST_DIM, cluster), f"{self.salt}/{name}")
        hashed = seeded(positions, self.dim, seed)
        self.proofs[name] = torch.cat([sketch(total, hashed, self.dim, cluster), sketch(own, hashed, self.dim, cluster)])

    def row(self, ok: bool) -> Tensor:
        """What this cluster's vote carries: [ok ‖ (s ‖ u) per unit]."""
        empty = torch.full((2 * self.dim,), math.nan, dtype=torch.float64)
        return torch.cat([torch.tensor([1.0 if ok else 0.0], dtype=torch.float64),
                          *[self.proofs.get(u, empty) for u in self.units]])

    def split(self, rows: Tensor, name: str) -> tuple[Tensor, Tensor]:
        """Everyone's (s, u) of unit `name`: [P, dim] each."""
        i = 1 + self.units.index(name) * 2 * self.dim
        return rows[:, i:i + self.dim], rows[:, i + self.dim:i + 2 * self.dim]

    def sums_check(self, rows: Tensor, name: str, weights: list[float]) -> bool:
        """The sum check of unit `name` (deterministic from the rows: every cluster gets the same answer)."""
        s, u = self.split(rows, name)
        w = torch.tensor(weights, dtype=torch.float64)
        expect = (w[:, None] * torch.where(w[:, None] != 0, u, torch.zeros_like(u))).sum(0)
        median = s.median(dim=0).values  # the lower median: a minority cannot move it
        scale = float((w.abs() * torch.where(w != 0, u.norm(dim=1), torch.zeros_like(w))).sum())
        gap = float((median - expect).norm())
        return math.isfinite(gap) and math.isfinite(scale) and gap <= self.tolerance * scale + 1e-30


    def verdict(self, rows: Tensor, provisional: dict[str, Decision],
                decide: Callable[[str, dict[str, Tensor]], Decision], names: list[str]) -> tuple[dict[str, Decision], str]:
        """Every cluster's rows → (the rule's second decisions, "") when every unit's SUM checks out and
        `decide(unit, measured)` — the rule on what the proven sketches measure — agrees with the provisional
        decision; else ({}, why not). The same answer on every cluster."""
        if not bool((rows[:, 0] > 0).all()):
            return {}, "a merged pseudo-gradient is not finite"
        final: dict[str, Decision] = {}
        for name in self.units:
            first = provisional[name]
            if not self.sums_check(rows, name, first.weights):
                return {}, f"the sum of module {name} does not match the clusters' sketches"
            _, u = self.split(rows, name)
            measured = {"gram": u @ u.T, "finite": torch.isfinite(u).all(dim=1), "exact": torch.tensor(True),
                        "measured_norms": u.norm(dim=1),
                        "measure_tolerance": torch.tensor(6.0 / math.sqrt(2.0 * self.dim)),
                        # a cosine from a count sketch errs by up to √((1 + c²)/dim); an excess of two such medians
                        "distance_noise": torch.tensor(2.0 / math.sqrt(self.dim))}
            second = decide(name, measured)
            if second.left_out != first.left_out or [snap(w) for w in second.weights] != [snap(w) for w in first.weights]:
                out = lambda d: [n for n, o in zip(names, d.left_out) if o]  # noqa: E731
                return {}, f"module {name}: the measured sketches leave out {out(second)}, the reports {out(first)}"
            final[name] = second
        return final, ""
