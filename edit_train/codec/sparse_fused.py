"""The CPU fast path of :mod:`sparse`'s codec (numba): one pass over a module's Δ per payload.

The eager path makes a dozen passes over the tensor (group norms, a batched ``topk`` at ~270 ns per chunk,
gathers, codes, packing, a zero-filled output) and ~30 small-op dispatches per call; on one CPU thread that
was 9–10 % of a sync's time (issue 24). Here, 256 chunks at a time: one loop computes every group's norm and
largest |value|; a bitonic network sorts all those chunks' keys at once (row by row, so its compare-exchanges
vectorise across chunks — a per-chunk sort or quickselect loses ~10 ns a key to mispredicted branches); then
one loop per chunk writes the scale, the codes, the indices and the sender's own decoded values. Element top-k
with chunks of more than 128 values (g = 1 at the default 256) selects chunk by chunk instead, bracketing each
chunk's k-th value around the last one's (:mod:`sparse_elements`). Decoding is the mirror (a lookup table of
the chunk's 2^b values, one check per byte for an out-of-range code).

The same bytes format, and bit-identical decoded values to :func:`sparse.decode`: the value formulas are the
same fp32 operations in the same order (numba keeps IEEE semantics without ``fastmath``; bf16 scales round to
nearest even as torch does). Which k groups a chunk keeps may differ from the eager path where norms tie to
2^(ib−23) relative (a key's low ib bits hold the group's position: the earlier group wins) — a sender's choice
receivers never check. A non-finite value anywhere makes the non-finite payload (the eager path relies on
such a group ranking first, which a finite group whose squares overflow can tie). A payload this decoder
finds wrong (a scale, a code, an index) goes back to the eager decoder, whose one-line refusal names it.

Tensors of at least SPECIALIZE_MIN values use a kernel compiled with the format's numbers as constants
(`specialized`); numba caches every kernel on disk (first use: seconds). Without numba, with
``sparse.FUSED = False`` or on a GPU the eager path runs.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from edit_train.codec.sparse_bits import AVAILABLE, _level, _level_value, _put, _put_scale, _rint, _take, njit
from edit_train.codec.sparse_elements import encode_elements
from edit_train.codec.sparse_select import _keys, _select_block, _top

__all__ = ["AVAILABLE", "OK", "NONFINITE", "encode", "decode", "specialized", "SPECIALIZE_MIN"]

OK, NONFINITE, BAD_SCALE, BAD_CODE, BAD_INDEX = 0, 1, 2, 3, 4

# numba's disk cache checks the timestamp of the file that defines a kernel (this one), not of the files whose
# functions it inlines: this digest of sparse_bits, sparse_select and sparse_elements changes this file whenever
# they change (tests/codec/test_sparse_fused.py checks it), so an edit or a checkout never runs a stale kernel.
INLINED_SOURCES = "ddc6b6de7291776f"


@njit(cache=True, nogil=True)
def _emit(x, start, end, g, kc, sel, col, bits, ib, bf16, out, own, st, acc, c, scratch, vals, codes):  # noqa
    """One chunk's scale, value codes and indices (sel[:kc, col]: its kept groups, ascending) into the
    payload's bit streams (st = [values byte, values bits, indices byte, index bits], pending bits acc =
    [values, indices]; kept in locals while the chunk is written) and its decoded values into own.
    vals / codes: scratch of k·g."""
    f32, u32, b8 = scratch
    q = (1 << (bits - 1)) - (1 if g > 1 else 0)  # Q (g > 1) or M (g = 1)
    qf = np.float32(q)
    nv = kc * g
    for a in range(kc):  # the kept groups' values, zero past the end
        base = start + sel[a, col] * g
        if base + g <= end:
            for i in range(g):
                vals[a * g + i] = x[base + i]
        else:
            for i in range(g):
                vals[a * g + i] = x[base + i] if base + i < end else np.float32(0.0)
    amax = np.float32(0.0)
    for i in range(nv):
        amax = max(amax, abs(vals[i]))
    s = _put_scale(out, c, amax, bf16, f32, u32, b8)
    safe = s if s > 0 else np.float32(1.0)
    inv = qf / safe
    step = s / qf
    if g > 1:  # codes and what they decode to (the decoded values overwrite vals)
        for i in range(nv):
            r = min(max(_rint(vals[i] * inv), -qf), qf)
            codes[i] = np.int32(r) + q
            vals[i] = r * step  # = (code − Q) · (s / Q): code − Q is r exactly
    else:
        for i in range(nv):
            v = vals[i]
            code = _level(v, safe, qf)
            dec = _level_value(code, qf, s)
            neg = v < 0
            codes[i] = code | ((1 << (bits - 1)) if neg else 0)
            vals[i] = -dec if neg else dec
    for a in range(kc):  # (own is zero-filled once per payload)
        base = start + sel[a, col] * g
        for i in range(min(g, end - base)):
            own[base + i] = vals[a * g + i]
    ipos, iacc, inn = st[2], acc[1], st[3]
    for a in range(kc):
        ipos, iacc, inn = _put(out, ipos, iacc, inn, sel[a, col], ib)
    st[2], acc[1], st[3] = ipos, iacc, inn
    vpos, vacc, vn = st[0], acc[0], st[1]
    if vn == 0 and 8 % bits == 0:  # byte-aligned whole codes: a byte at a time
        per = 8 // bits
        whole = nv // per
        pos = vpos
        if bits == 2:
            for o in range(whole):
                i = 4 * o
                out[pos + o] = np.uint8(codes[i] | (codes[i + 1] << 2) | (codes[i + 2] << 4) | (codes[i + 3] << 6))
        elif bits == 4:
            for o in range(whole):
                out[pos + o] = np.uint8(codes[2 * o] | (codes[2 * o + 1] << 4))
        elif bits == 8:
            for o in range(whole):
                out[pos + o] = np.uint8(codes[o])
        else:
            for o in range(whole):
                byte = 0
                for i in range(8):
                    byte |= codes[8 * o + i] << i
                out[pos + o] = np.uint8(byte)
        vpos = pos + whole
        for i in range(whole * per, nv):
            vpos, vacc, vn = _put(out, vpos, vacc, vn, codes[i], bits)
    else:
        for i in range(nv):
            vpos, vacc, vn = _put(out, vpos, vacc, vn, codes[i], bits)
    st[0], acc[0], st[1] = vpos, vacc, vn


@njit(cache=True, nogil=True, inline="always")
def _emit_block(x, b0, lanes, chunk, g, k, bits, ib, bf16, sel, gmax, out, own, st, acc, scratch):  # noqa
    """`_emit` for a block of full chunks when every kept group is whole bytes of codes (g > 1, g·b a
    multiple of 8): one fused loop per group, stream positions in registers."""
    f32, u32, b8 = scratch
    per = 8 // bits
    q = (1 << (bits - 1)) - 1
    qf = np.float32(q)
    vpos, ipos, inn, iacc = st[0], st[2], st[3], acc[1]
    for c in range(lanes):  # whole bytes per group (g > 1, g·b a multiple of 8): one fused loop
        cc = b0 + c
        start = cc * chunk
        amax = np.float32(0.0)
        for a in range(k):
            amax = max(amax, gmax[sel[a, c], c])
        s = _put_scale(out, cc, amax, bf16, f32, u32, b8)
        inv = qf / (s if s > 0 else np.float32(1.0))
        step = s / qf
        for a in range(k):
            j = sel[a, c]
            ipos, iacc, inn = _put(out, ipos, iacc, inn, j, ib)
            base = start + j * g
            for o in range(g * bits // 8):  # one byte: 8/b codes
                byte = 0
                t0 = base + o * per
                for i in range(per):
                    r = min(max(_rint(x[t0 + i] * inv), -qf), qf)
                    own[t0 + i] = r * step  # = (code − Q) · (s / Q)
                    byte |= (np.int32(r) + q) << (i * bits)
                out[vpos] = np.uint8(byte)
                vpos += 1
    st[0], st[2], st[3], acc[1] = vpos, ipos, inn, iacc


LANES = 256  # chunks sorted together (a [rows, LANES] int32 block stays in L1/L2)
MAX_NETWORK = 128  # groups per chunk up to which the network selects (beyond: chunk by chunk, `_top`)


@njit(cache=True, nogil=True, inline="always")
def _encode(x, chunk, g, k, bits, ib, bf16, out, own):  # pragma: no cover - compiled
    """x float32[n] -> out (uint8, the whole payload after its 8-byte header) and own (float32[n], what
    receivers decode). Returns OK or NONFINITE (out and own then undefined).

    Full chunks are selected LANES at a time (`sparse_select._select_block`); the short last chunk, and every
    chunk of more than MAX_NETWORK groups, one at a time (`sparse_elements` for g = 1, else `_keys`, `_top`)."""
    n = x.shape[0]
    m = (n + chunk - 1) // chunk
    G = chunk // g
    P = 1
    while P < G:
        P *= 2
    K2 = 1
    while K2 < k:
        K2 *= 2
    sbytes = 2 if bf16 else 4
    last_groups = (n - (m - 1) * chunk + g - 1) // g
    kept_total = (m - 1) * k + min(k, last_groups)
    st = np.zeros(4, dtype=np.int64)
    st[0] = 8 + m * sbytes  # value stream
    st[2] = st[0] + (kept_total * g * bits + 7) // 8  # index stream
    acc = np.zeros(2, dtype=np.uint64)
    vals = np.empty(k * g, dtype=np.float32)
    codes = np.empty(k * g, dtype=np.int32)
    f32 = np.empty(1, dtype=np.float32)
    scratch = (f32, f32.view(np.uint32), f32.view(np.uint8))
    rows = P if P <= MAX_NETWORK else 1
    kbits = np.empty((rows, LANES), dtype=np.int32)  # C layout: the network's loops vectorise over it
    keys = kbits.view(np.float32)  # (a view has layout "A": fine for the scalar stores below)
    sel = np.empty((K2, LANES), dtype=np.int32)
    blocked = n // chunk if P <= MAX_NETWORK else 0  # full chunks selected LANES at a time
    aligned = g > 1 and (g * bits) % 8 == 0
    gmax = np.empty((min(G, rows), LANES), dtype=np.float32)  # each group's largest |value| (the chunk's scale)
    if blocked > 0 or g > 1:  # (element top-k zeroes its chunks as it reads them)
        own[:] = np.float32(0.0)  # one fill (a fill per chunk was 8x slower)
    for b0 in range(0, blocked, LANES):
        lanes = min(LANES, blocked - b0)
        if not _select_block(x, b0, lanes, chunk, g, G, P, k, K2, ib, kbits, keys, gmax, sel):
            return NONFINITE
        if not aligned:
            for c in range(lanes):
                cc = b0 + c
                _emit(x, cc * chunk, cc * chunk + chunk, g, k, sel, c, bits, ib, bf16, out, own, st, acc, cc,
                      scratch, vals, codes)
            continue
        _emit_block(x, b0, lanes, chunk, g, k, bits, ib, bf16, sel, gmax, out, own, st, acc, scratch)
    if blocked < m and g == 1:  # chunk by chunk (`sparse_elements`)
        if not encode_elements(x, blocked, n, chunk, k, bits, ib, bf16, out, own, st, acc, scratch):
            return NONFINITE
    elif blocked < m:  # chunk by chunk: the short last one, or every chunk where G is too large for a network
        gkeys = np.empty(G, dtype=np.float32)
        best = np.empty((G + 1, 1), dtype=np.int32)
        for cc in range(blocked, m):
            start = cc * chunk
            end = min(start + chunk, n)
            groups = (end - start + g - 1) // g
            kc = min(k, groups)
            if not _keys(x, start, end, g, groups, gkeys):
                return NONFINITE
            _top(gkeys.view(np.int32), groups, kc, best[:, 0])
            _emit(x, start, end, g, kc, best, 0, bits, ib, bf16, out, own, st, acc, cc, scratch, vals, codes)
    if st[1] > 0:
        out[st[0]] = np.uint8(acc[0] & np.uint64(0xFF))
    if st[3] > 0:
        out[st[2]] = np.uint8(acc[1] & np.uint64(0xFF))
    return OK


@njit(cache=True, nogil=True)
def _bad_bytes(bits, per):  # pragma: no cover - compiled
    """Which byte values hold an all-ones `bits`-bit code (the one code above 2Q) among their `per` codes."""
    bad = np.zeros(256, dtype=np.bool_)
    low = (1 << bits) - 1
    for byte in range(256):
        for i in range(per):
            if (byte >> (i * bits)) & low == low:
                bad[byte] = True
    return bad


@njit(cache=True, nogil=True, inline="always")
def _chunk_table(lut, s, q, bits, aligned, elements):  # pragma: no cover - compiled
    """The values a chunk's codes stand for, by the decoder's own formulas, into lut: offset codes (aligned
    groups) or sign-and-level codes (element top-k; `elements`). Returns the chunk's step s / Q."""
    qf = np.float32(q)
    step = s / qf
    if aligned:
        for code in range(2 * q + 1):
            lut[code] = (np.float32(code) - qf) * step
    elif elements:
        for code in range(1 << bits):
            mag = _level_value(code & (q - 1), qf, s)
            lut[code] = -mag if (code >> (bits - 1)) & 1 else mag
    return step


@njit(cache=True, nogil=True, inline="always")
def _decode(buf, n, chunk, g, k, bits, ib, bf16, out):  # pragma: no cover - compiled
    """A checked-length, checked-header payload -> out float32[n]. Returns OK or the first problem found
    (BAD_SCALE, BAD_CODE, BAD_INDEX): the caller then lets the eager decoder word the refusal."""
    m = (n + chunk - 1) // chunk
    sbytes = 2 if bf16 else 4
    q = (1 << (bits - 1)) - (1 if g > 1 else 0)
    qf = np.float32(q)
    groups_full = chunk // g
    last_groups = (n - (m - 1) * chunk + g - 1) // g
    kept_total = (m - 1) * k + min(k, last_groups)
    vpos = 8 + m * sbytes
    ipos = vpos + (kept_total * g * bits + 7) // 8
    vacc = np.uint64(0)
    vn = 0
    iacc = np.uint64(0)
    inn = 0
    vmask = np.uint64((1 << bits) - 1)
    imask = np.uint64((1 << ib) - 1)
    aligned = g > 1 and (g * bits) % 8 == 0
    per = 8 // bits
    lowbits = (1 << bits) - 1
    lut = np.zeros(1 << bits, dtype=np.float32)
    elements = g == 1 and (1 << bits) <= 2 * k  # g = 1: a table of the 2^b values when a chunk holds enough
    bad = _bad_bytes(bits, per if aligned else 0)  # bytes holding an all-ones code (above 2Q) somewhere
    f32 = np.empty(1, dtype=np.float32)
    u32 = f32.view(np.uint32)
    b8 = f32.view(np.uint8)
    out[:] = np.float32(0.0)  # one fill (a fill per chunk was 8x slower)
    for c in range(m):
        if bf16:
            u32[0] = (np.uint32(buf[8 + 2 * c]) | (np.uint32(buf[8 + 2 * c + 1]) << np.uint32(8))) << np.uint32(16)
        else:
            for b in range(4):
                b8[b] = buf[8 + 4 * c + b]
        s = f32[0]
        if not np.isfinite(s) or s < 0:
            return BAD_SCALE
        step = _chunk_table(lut, s, q, bits, aligned, elements)
        start = c * chunk
        end = min(start + chunk, n)
        groups = groups_full if c < m - 1 else last_groups
        kc = min(k, groups)
        prev = -1
        for a in range(kc):
            j, ipos, iacc, inn = _take(buf, ipos, iacc, inn, ib, imask)
            if j >= groups or j <= prev:
                return BAD_INDEX
            prev = j
            base = start + j * g
            if aligned:  # whole bytes per group: 8/b codes out of each; the only code above 2Q is all ones
                width = min(g, end - base)  # the last chunk's last group may be short
                for o in range(g * bits // 8):
                    byte = np.int64(buf[vpos])
                    vpos += 1
                    if bad[byte]:
                        return BAD_CODE
                    for i in range(per):
                        if o * per + i < width:
                            out[base + o * per + i] = lut[(byte >> (i * bits)) & lowbits]
                continue
            for t in range(base, base + g):
                code, vpos, vacc, vn = _take(buf, vpos, vacc, vn, bits, vmask)
                if g > 1:
                    if code > 2 * q:
                        return BAD_CODE
                    dec = (np.float32(code) - qf) * step
                elif elements:
                    dec = lut[code]
                else:
                    dec = _level_value(code & (q - 1), qf, s)
                    if (code >> (bits - 1)) & 1:
                        dec = -dec
                if t < end:
                    out[t] = dec
    return OK


@njit(cache=True, nogil=True)
def encode(x, chunk, g, k, bits, ib, bf16, out, own):  # pragma: no cover - compiled
    """`_encode` for any format (one compiled kernel)."""
    return _encode(x, chunk, g, k, bits, ib, bf16, out, own)


@njit(cache=True, nogil=True)
def decode(buf, n, chunk, g, k, bits, ib, bf16, out):  # pragma: no cover - compiled
    """`_decode` for any format (one compiled kernel)."""
    return _decode(buf, n, chunk, g, k, bits, ib, bf16, out)


SPECIALIZE_MIN = 1 << 16  # values: tensors this large take a kernel compiled for their format


@lru_cache(maxsize=16)
def specialized(chunk: int, g: int, k: int, bits: int, ib: int, bf16: bool):  # type: ignore[no-untyped-def]
    """(encode, decode) compiled with this format's numbers as constants: LLVM then unrolls the per-group and
    per-byte loops and vectorises the rest (35-45 % faster on a module's Δ). A run uses one format, so it
    compiles once (seconds, on first use; numba caches it on disk); small tensors keep the generic kernel."""

    @njit(cache=True, nogil=True)
    def enc(x, out, own):  # pragma: no cover - compiled
        return _encode(x, chunk, g, k, bits, ib, bf16, out, own)

    @njit(cache=True, nogil=True)
    def dec(buf, n, out):  # pragma: no cover - compiled
        return _decode(buf, n, chunk, g, k, bits, ib, bf16, out)

    return enc, dec
