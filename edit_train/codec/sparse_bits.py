"""Bit-level pieces of :mod:`sparse_fused`'s codec (numba): LSB-first bit streams, a chunk's scale in the
payload (bf16 rounded to nearest even, as torch does), fp32 round half to even."""

from __future__ import annotations

import numpy as np

try:
    from numba import njit
    from numba.cpython.unsafe.numbers import trailing_zeros  # LLVM's cttz (numba's own intrinsic)

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised where numba is absent
    AVAILABLE = False
    trailing_zeros = None

    def njit(*_a, **_k):  # type: ignore[no-redef]
        return lambda fn: fn


@njit(cache=True, nogil=True)
def _bf16_bits(v, f32, u32):  # pragma: no cover - compiled
    """fp32 -> bf16 bit pattern, round to nearest even (finite and inf inputs); f32/u32: a 1-value scratch
    and its uint32 view (a bit cast without an allocation)."""
    f32[0] = v
    u = np.int64(u32[0])
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


@njit(cache=True, nogil=True, inline="always")
def _rint(y):  # pragma: no cover - compiled
    """Round half to even of a float32 |y| <= 2**22 (here |y| <= 128): adding and taking away 1.5 · 2**23
    leaves the integer the fp32 addition rounded to, as torch.round does."""
    big = np.float32(12582912.0)
    return (y + big) - big


@njit(cache=True, nogil=True, inline="always")
def _put_scale(out, c, amax, bf16, f32, u32, b8):  # pragma: no cover - compiled
    """Chunk c's scale into the payload (bf16: rounded to nearest even) -> the fp32 scale receivers read."""
    if bf16:
        sb = _bf16_bits(amax, f32, u32)
        out[8 + 2 * c] = sb & 0xFF
        out[8 + 2 * c + 1] = sb >> 8
        u32[0] = sb << 16
        return f32[0]
    f32[0] = amax
    for b in range(4):
        out[8 + 4 * c + b] = b8[b]
    return amax


@njit(cache=True, nogil=True, inline="always")
def _take(buf, pos, acc, have, nbits, mask):  # pragma: no cover - compiled
    """The next `nbits` bits of an LSB-first bit stream at byte `pos` with `have` bits pending in `acc`:
    (code, pos, acc, have) after it."""
    while have < nbits:
        acc |= np.uint64(buf[pos]) << np.uint64(have)
        pos += 1
        have += 8
    return np.int64(acc & mask), pos, acc >> np.uint64(nbits), have - nbits


@njit(cache=True, nogil=True, inline="always")
def _put(out, pos, acc, have, code, nbits):  # pragma: no cover - compiled
    """Append `nbits` bits of `code` to an LSB-first bit stream (next byte `pos`, `have` bits pending in
    `acc`): (pos, acc, have) after it."""
    acc |= np.uint64(code) << np.uint64(have)
    have += nbits
    while have >= 8:
        out[pos] = np.uint8(acc & np.uint64(0xFF))
        pos += 1
        acc >>= np.uint64(8)
        have -= 8
    return pos, acc, have


@njit(cache=True, nogil=True, inline="always")
def _level(v, safe, qf):  # pragma: no cover - compiled
    """Element top-k (g = 1): a kept value's magnitude level, round(|v| / s · M) − 1 clamped to [0, M − 1]
    (qf = M = 2^(b−1); safe = s, or 1 where s = 0) — the eager encoder's fp32 operations."""
    return np.int32(min(max(_rint(abs(v) / safe * qf) - np.float32(1.0), np.float32(0.0)), qf - np.float32(1.0)))


@njit(cache=True, nogil=True, inline="always")
def _level_value(level, qf, s):  # pragma: no cover - compiled
    """What an element top-k magnitude level decodes to: (level + 1) / M · s (the eager decoder's order)."""
    return np.float32(level + 1) / qf * s
