"""The top-k wire format's layout and sizes (``sync.compression=topk``), torch-free: what the codec
(:mod:`edit_train.codec.sparse`) writes and what the planner (``edit_train/plan/traffic.py``) counts.
The format itself is described in :mod:`edit_train.codec.sparse`."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAGIC, VERSION, HEADER = 0x53, 1, 8
NONFINITE = 1
BITS = (1, 2, 4, 8)
MAX_CHUNK = 1 << 16  # indices of at most 16 bits
MAX_GROUP = 128  # log₂ g fits the header byte with room to spare; larger groups select too coarsely
SCALE_BYTES = {"fp32": 4, "bf16": 2}

# What `sync.compression=topk` sends unless told otherwise (issue 51, docs/compression.md): 3 of every 32 groups of 8
# values, 2 bits a value (0.96 % of fp32's bytes with bf16 scales, 1.16 % with fp32 ones), and error feedback as
# momentum with β = 0.6 (`sync.error_feedback_decay` unset). Measured on tiny, 3 seeds: 0.971 x the uncompressed
# loss at outer lr 1.7 without outer momentum, 0.91 x with edit's shipped outer step; the element-wise 1 %, 2-bit
# default it replaces was 1.116 x.
TOPK_DENSITY, TOPK_BITS, TOPK_GROUP, TOPK_EF_DECAY = 0.09375, 2, 8, 0.6


def error_feedback_decay(scheme: str, error_feedback: bool, decay: float | None, unsent: str = "resend") -> float:
    """β that a sync runs with: `sync.error_feedback_decay` when set; unset (None) it is `TOPK_EF_DECAY` for top-k
    that resends with error feedback, 1 (plain, exact error feedback) for every dense codec, without error
    feedback, and under `sync.unsent=keep` (its residual goes into the parameters, never decays)."""
    if decay is not None:
        return decay
    return TOPK_EF_DECAY if scheme == "topk" and error_feedback and unsent == "resend" else 1.0


@dataclass(frozen=True)
class SparseFormat:
    chunk: int  # C: values per chunk (sync.block_size)
    k: int  # kept groups per full chunk
    bits: int  # b: bits per kept value
    scale_dtype: str = "fp32"
    group: int = 1  # g: values selected together (sync.topk_group)

    @staticmethod
    def of(chunk: int, density: float, bits: int, scale_dtype: str = "fp32", group: int = 1) -> SparseFormat:
        groups = max(1, chunk // group)
        return SparseFormat(chunk, max(1, min(groups, round(density * groups))), bits, scale_dtype, group)

    @property
    def groups(self) -> int:
        """G: groups per full chunk."""
        return self.chunk // self.group

    @property
    def index_bits(self) -> int:
        return max(1, (self.groups - 1).bit_length())

    @property
    def scale_bytes(self) -> int:
        return SCALE_BYTES[self.scale_dtype]

    @property
    def group_log2(self) -> int:
        return self.group.bit_length() - 1

    def kept(self, numel: int) -> tuple[int, int, int]:
        """(chunks m, kept groups K, kept groups in the last chunk) for ``numel`` values."""
        m = math.ceil(numel / self.chunk)
        if m == 0:
            return 0, 0, 0
        last = min(self.k, math.ceil((numel - (m - 1) * self.chunk) / self.group))
        return m, (m - 1) * self.k + last, last

    def sections(self, numel: int) -> tuple[int, int, int, int]:
        """Bytes of (header, scales, values, indices)."""
        m, kept, _ = self.kept(numel)
        return (HEADER, m * self.scale_bytes, math.ceil(kept * self.group * self.bits / 8),
                math.ceil(kept * self.index_bits / 8))


def sparse_bytes(numel: int, f: SparseFormat) -> int:
    return sum(f.sections(numel))


def format_error(density: object, bits: object, chunk: int, group: object, prefix: str = "sync") -> str | None:
    """What is wrong with these ``sync.*`` settings for ``compression=topk`` (one line naming the key), or None."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        return f"{prefix}.topk_density must be in (0, 1], got {density!r}"
    if bits not in BITS or isinstance(bits, bool) or not isinstance(bits, int):
        return f"{prefix}.bits must be one of {BITS}, got {bits!r}"
    if chunk > MAX_CHUNK:
        return f"{prefix}.block_size must be <= {MAX_CHUNK} with compression=topk (16-bit indices), got {chunk}"
    g = group
    if isinstance(g, bool) or not isinstance(g, int) or g < 1 or g & (g - 1) or g > MAX_GROUP or chunk % g:
        return (f"{prefix}.topk_group must be a power of two <= {MAX_GROUP} that divides {prefix}.block_size="
                f"{chunk}, got {g!r}")
    if g > 1 and bits < 2:
        return f"{prefix}.topk_group={g} needs {prefix}.bits >= 2 (a group's code has a zero level)"
    if density * chunk / g < 0.5:
        return (f"{prefix}.topk_density={density} keeps no group of a chunk of {prefix}.block_size={chunk}: raise "
                f"block_size to at least {math.ceil(0.5 * g / density)}")
    return None
