"""Bytes on the cross-cluster link, per cluster, exactly as `federation` counts them (no torch needed).

* a local-SGD sync moves every sync unit's pseudo-gradient as its rule needs (`local_sgd.moves.aggregation`,
  the round's and the lanes' own decision, torch-free; docs/sync_math.md): a rule that needs a SUM (`uniform`, `edit_norm`:
  diloco, post-local SGD) sums at any count (`compressed_reduce.plan`: a ring all-reduce of fp32,
  2(P−1)/P · 4n; a compressed all-gather or reduce-scatter + all-gather, whichever moves less); the `verified`
  rule (edit, a_edit) gathers up to `sync.gather_max` participants (every cluster sends its contribution to
  each of the others: (P−1) · payload bytes, + one 16-byte tag per piece and peer) and above it sums and proves
  the sum with two count sketches per unit in the vote ((P−1) · 16 · `sketch_dim` bytes per unit); a top-k
  payload is always gathered (a sum of sparse payloads is not sparse), tags included;
* ddp all-reduces the fp32 gradients every step: 2(P−1)/P · 4n per cluster;
* pieces: clusters of equal size pair rank r with rank r (one piece per rank and unit), otherwise each unit is
  cut into `federation.chunks` pieces spread over the ranks.

A payload of n values (`Codec.payload`): `n · value bytes + ⌈n / block⌉ · scale bytes` for none / bf16 / int8 /
fp8 (`codec/dense.py`), and the top-k format's header + scales + packed codes + packed indices
(`codec/sparse_format.py`, the module the codec itself takes its layout from). `sync.unsent` changes where
top-k's residual goes (resent, or kept in the cluster's own parameters), not a byte on the wire. The test
suite checks these figures against the real codec's payloads and `federation.compressed_reduce.sent_bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from edit_train.codec.sparse_format import SCALE_BYTES, SparseFormat, format_error, sparse_bytes  # torch-free
from edit_train.federation.auth import SEAL_TAG_BYTES  # torch-free leaf
from edit_train.local_sgd.moves import aggregation, wire  # torch-free: how contributions move

TAG = SEAL_TAG_BYTES  # the tag after every gathered piece (federation/seal.py)
SKETCH_DIM = 1024  # algo.rule.verified.sketch_dim: buckets of each count sketch a sketched sync's vote carries
# what each algorithm's default rule needs moved (local_sgd/aggregator.Needs)
NEEDS = {"ddp": "sum", "post_local_sgd": "sum", "diloco": "sum", "edit": "measurements", "a_edit": "measurements"}


def needs_of_rule(rule: str) -> str:
    """What a rule named in `algo.rule.name` needs: the built-ins' answer; a rule of one's own is assumed to
    need measurements (the planner cannot import it)."""
    return "sum" if rule in ("uniform", "edit_norm") else "measurements"


VALUE_BYTES = {"none": 4, "bf16": 2, "int8": 1, "fp8": 1}
BLOCKWISE = ("int8", "fp8")
COMPRESSIONS = ("none", "bf16", "int8", "fp8", "topk")
UNSENT = ("resend", "keep")


@dataclass(frozen=True)
class Codec:
    """`sync.compression` and the keys that shape its wire format (`sync.block_size`, `sync.scale_dtype`, and
    for top-k `sync.topk_density`, `sync.bits`, `sync.topk_group`, `sync.unsent`), and the one that shapes what
    the residual it keeps does (`sync.error_feedback_decay` β: < 1 is error feedback as outer momentum). β moves
    no byte; it is in the codec because its loss differs (the planner's loss model reads it by `label`)."""

    scheme: str = "none"
    block_size: int = 256
    scale_dtype: str = "fp32"
    density: float = 0.01
    bits: int = 2
    group: int = 1
    unsent: str = "resend"
    ef_decay: float = 1.0

    def error(self, prefix: str = "sync") -> str | None:
        """What is wrong with these settings (one line naming the key), or None."""
        if self.scheme not in COMPRESSIONS:
            return f"{prefix}.compression: {self.scheme!r} is not one of {', '.join(COMPRESSIONS)}"
        if self.block_size < 1:
            return f"{prefix}.block_size must be >= 1, got {self.block_size}"
        if self.scale_dtype not in SCALE_BYTES:
            return f"{prefix}.scale_dtype must be one of {', '.join(SCALE_BYTES)}, got {self.scale_dtype!r}"
        if self.unsent not in UNSENT or (self.unsent == "keep" and not self.sparse):
            return f"{prefix}.unsent must be one of {', '.join(UNSENT)} (keep: top-k only), got {self.unsent!r}"
        if not 0.0 < self.ef_decay <= 1.0 or (self.ef_decay < 1.0 and not self.lossy):
            return (f"{prefix}.error_feedback_decay must be in (0, 1] (< 1: a lossy compression only), "
                    f"got {self.ef_decay!r}")
        return format_error(self.density, self.bits, self.block_size, self.group, prefix) if self.sparse else None

    @property
    def sparse(self) -> bool:
        return self.scheme == "topk"

    @property
    def lossy(self) -> bool:
        return self.scheme != "none"

    @property
    def format(self) -> SparseFormat:
        return SparseFormat.of(self.block_size, float(self.density), int(self.bits), self.scale_dtype, int(self.group))

    def payload(self, numel: int) -> int:
        """Exact bytes of one payload of `numel` values."""
        if self.sparse:
            return sparse_bytes(numel, self.format)
        if self.scheme not in VALUE_BYTES:
            raise ValueError(self.error() or f"sync.compression: {self.scheme!r}")
        scales = math.ceil(numel / self.block_size) * SCALE_BYTES[self.scale_dtype] if self.scheme in BLOCKWISE else 0
        return numel * VALUE_BYTES[self.scheme] + scales

    @property
    def label(self) -> str:
        """`none`, `int8`, …, `topk(0.02,4b,g1[,keep])`; error feedback as momentum adds `,efm0.95` (inside the
        top-k parentheses, `int8(efm0.95)` for a dense scheme): a different loss, the same bytes."""
        efm = f"efm{self.ef_decay:g}" if self.ef_decay < 1.0 else ""
        if not self.sparse:
            return f"{self.scheme}({efm})" if efm else self.scheme
        keep = ",keep" if self.unsent == "keep" else ""
        return f"topk({self.density:g},{self.bits}b,g{self.group}{keep}{',' + efm if efm else ''})"


def codec(c: Codec | str, block: int = 256) -> Codec:
    return c if isinstance(c, Codec) else Codec(c, block)


def wire_bytes(numel: int, scheme: Codec | str, block: int = 256) -> int:
    c = codec(scheme, block)
    why = c.error()
    if why is not None:
        raise ValueError(why)
    return c.payload(numel)


def _bounds(numel: int, world: int, block: int) -> list[int]:
    blocks = math.ceil(numel / block)
    return [min(blocks * (j + 1) // world * block, numel) - min(blocks * j // world * block, numel)
            for j in range(world)]


def sum_method(numel: int, world: int, scheme: Codec | str, block: int = 256) -> str:
    """How a SUM of `numel` values moves (`compressed_reduce.plan`): all_reduce, all_gather or rs_ag."""
    c = codec(scheme, block)
    if not c.lossy:
        return "all_reduce"
    if c.sparse:
        return "all_gather"
    sizes = [c.payload(n) for n in _bounds(numel, world, c.block_size)]
    rs = (world - 1) * sum(sizes) + world * (world - 1) * max(sizes)
    return "rs_ag" if rs < world * (world - 1) * c.payload(numel) else "all_gather"


def sum_bytes(numel: int, world: int, scheme: Codec | str, block: int = 256, rank: int = 0) -> int:
    """What one participant puts on the wire for a SUM of `numel` values (`compressed_reduce.sent_bytes`)."""
    if world <= 1:
        return 0
    c = codec(scheme, block)
    method = sum_method(numel, world, c)
    if method == "all_reduce":
        return 2 * (world - 1) * 4 * numel // world
    if method == "all_gather":
        return (world - 1) * c.payload(numel)
    sizes = [c.payload(n) for n in _bounds(numel, world, c.block_size)]
    return sum(b for j, b in enumerate(sizes) if j != rank) + (world - 1) * max(sizes)


def pieces(numel: int, parts: int) -> list[int]:
    """`torch.tensor_split` sizes."""
    q, r = divmod(numel, parts)
    return [q + (1 if j < r else 0) for j in range(parts)]


def unit_pieces(numel: int, ranks: int, paired: bool, chunks: int) -> list[int]:
    """The lane pieces of one unit this cluster sends (paired: one per rank; else `chunks` pieces)."""
    return [p for p in (pieces(numel, ranks) if paired else pieces(numel, chunks)) if p > 0]


def sync_bytes(units: Sequence[int], world: int, scheme: Codec | str, *, ranks: int = 1, paired: bool = True,
               chunks: int = 4, gather_max: int = 4, block: int = 256, needs: str = "measurements",
               sketch_dim: int = SKETCH_DIM, unsent: Sequence[int] | None = None) -> int:
    """Bytes one cluster sends in one local-SGD sync among `world` participants (payload, tags, and the
    sketched sync's proofs; not the small norm exchange). `unsent`: per unit, the elements it leaves out (rows
    of experts it — gathered — or nobody — a SUM — routed tokens to; the `unsent_params` of its `sync` event;
    exact for one rank per cluster or the chunked layout)."""
    if world <= 1:
        return 0
    c = codec(scheme, block)
    how = aggregation(needs, world, gather_max, sketch_dim, c.sparse)
    total = 0
    for n in (u - s for u, s in zip(units, unsent)) if unsent is not None else units:
        for piece in unit_pieces(n, ranks, paired, chunks):
            if wire(how, c.sparse) == "gather":
                total += (world - 1) * (c.payload(piece) + TAG)
            else:
                total += sum_bytes(piece, world, c)
        if how == "sketched":
            total += (world - 1) * 16 * sketch_dim  # s and u, float64, in the leader's vote
    return total


def codec_values(units: Sequence[int], world: int, scheme: Codec | str, *, ranks: int = 1, paired: bool = True,
                 chunks: int = 4, gather_max: int = 4, block: int = 256,
                 needs: str = "measurements") -> tuple[float, float]:
    """(values this cluster encodes, values it decodes) in one sync: a gather encodes its own contribution once
    and decodes the P − 1 others'; a compressed SUM as its method does (rs_ag: every part, then its own
    chunk's sum again; decodes P − 1 parts of its chunk, its own, and every chunk of the sum); none: neither."""
    c = codec(scheme, block)
    if world <= 1 or not c.lossy:
        return 0.0, 0.0
    enc = dec = 0.0
    for n in units:
        for piece in unit_pieces(n, ranks, paired, chunks):
            if wire(aggregation(needs, world, gather_max, SKETCH_DIM, c.sparse), c.sparse) == "gather" or \
                    sum_method(piece, world, c) == "all_gather":
                enc, dec = enc + piece, dec + (world - 1) * piece
            else:  # rs_ag
                mine = piece / world
                enc, dec = enc + piece + mine, dec + world * mine + piece
    return enc, dec


def ddp_bytes(total_params: int, world: int, width: int = 4) -> int:
    """Bytes one cluster sends per ddp step (gradients of `width` bytes — fp32 in edit-train —, ring
    all-reduce)."""
    return 0 if world <= 1 else 2 * (world - 1) * width * total_params // world


def heal_bytes(total_params: int, outer_momentum: bool = True) -> int:
    """A heal payload: anchor + outer momentum (fp32) + live parameters of nothing else (JSON header aside)."""
    return total_params * 4 * (2 if outer_momentum else 1)


def lanes(ranks: int, paired: bool, chunks: int = 4) -> int:
    """Transfers one cluster runs side by side per unit (the simulated link queues each rank's own)."""
    return max(1, ranks if paired else min(ranks, chunks))
