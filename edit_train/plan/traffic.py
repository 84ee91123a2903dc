"""Bytes on the cross-cluster link, per cluster, exactly as `federation` counts them (no torch needed).

* a local-SGD sync moves every sync unit's pseudo-gradient: with at most `sync.gather_max` participants every
  cluster sends its contribution to each of the others (`gather`: (P−1) · wire bytes, + one 16-byte tag per
  piece and peer); above it, a SUM (`compressed_reduce.plan`: a ring all-reduce of fp32, 2(P−1)/P · 4n; a
  compressed all-gather or reduce-scatter + all-gather, whichever moves less);
* ddp all-reduces the fp32 gradients every step: 2(P−1)/P · 4n per cluster;
* pieces: clusters of equal size pair rank r with rank r (one piece per rank and unit), otherwise each unit is
  cut into `federation.chunks` pieces spread over the ranks.

`wire_bytes(n) = n · value bytes + ⌈n / block⌉ · scale bytes` (`federation/compress.py`). The test suite
checks these figures against `federation.compressed_reduce.sent_bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from edit_train.federation.auth import SEAL_TAG_BYTES  # torch-free leaf

TAG = SEAL_TAG_BYTES  # the tag after every gathered piece (federation/seal.py)
VALUE_BYTES = {"none": 4, "bf16": 2, "int8": 1, "fp8": 1}
SCALE_BYTES = {"none": 0, "bf16": 0, "int8": 4, "fp8": 4}
COMPRESSIONS = tuple(VALUE_BYTES)


def wire_bytes(numel: int, scheme: str, block: int = 256) -> int:
    if scheme not in VALUE_BYTES:
        raise ValueError(f"sync.compression: {scheme!r} is not one of {', '.join(COMPRESSIONS)}")
    return numel * VALUE_BYTES[scheme] + math.ceil(numel / block) * SCALE_BYTES[scheme]


def _bounds(numel: int, world: int, block: int) -> list[int]:
    blocks = math.ceil(numel / block)
    return [min(blocks * (j + 1) // world * block, numel) - min(blocks * j // world * block, numel)
            for j in range(world)]


def sum_bytes(numel: int, world: int, scheme: str, block: int = 256, rank: int = 0) -> int:
    """What one participant puts on the wire for a SUM of `numel` values (`compressed_reduce.sent_bytes`)."""
    if world <= 1:
        return 0
    if scheme == "none":
        return 2 * (world - 1) * 4 * numel // world
    gather = (world - 1) * wire_bytes(numel, scheme, block)
    sizes = [wire_bytes(n, scheme, block) for n in _bounds(numel, world, block)]
    ag_total, rs_total = world * gather, (world - 1) * sum(sizes) + world * (world - 1) * max(sizes)
    if rs_total < ag_total:
        return sum(b for j, b in enumerate(sizes) if j != rank) + (world - 1) * max(sizes)
    return gather


def pieces(numel: int, parts: int) -> list[int]:
    """`torch.tensor_split` sizes."""
    q, r = divmod(numel, parts)
    return [q + (1 if j < r else 0) for j in range(parts)]


def sync_bytes(units: Sequence[int], world: int, scheme: str, *, ranks: int = 1, paired: bool = True,
               chunks: int = 4, gather_max: int = 4, block: int = 256, unsent: Sequence[int] | None = None) -> int:
    """Bytes one cluster sends in one local-SGD sync among `world` participants (payload only). `unsent`: per
    unit, the elements it leaves out (rows of experts it — gathered — or nobody — a SUM — routed tokens to; the
    `unsent_params` of its `sync` event; exact for one rank per cluster or the chunked layout)."""
    if world <= 1:
        return 0
    gather = world <= gather_max
    total = 0
    for n in (u - s for u, s in zip(units, unsent)) if unsent is not None else units:
        parts = pieces(n, ranks) if paired else pieces(n, chunks)
        for piece in parts:
            if piece == 0:
                continue
            if gather:
                total += (world - 1) * (wire_bytes(piece, scheme, block) + TAG)
            else:
                total += sum_bytes(piece, world, scheme, block)
    return total


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
