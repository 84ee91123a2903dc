"""Which groups a chunk of a sparse payload keeps, for :mod:`sparse_fused` (numba): the k groups of largest
squared L2 norm (|x| for element top-k), indices ascending, ties to the earlier group (element top-k over
chunks of more than 128 values: :mod:`sparse_elements`).

Many chunks at once (`_select_block`): a bitonic network sorts the keys of 256 chunks together, row by row, so
every compare-exchange is a vectorised min/max across chunks — a per-chunk sort or quickselect loses ~10 ns a
key to mispredicted branches. One chunk at a time (`_keys` + `_top`, for a short last chunk or chunks of more
than 128 groups): the k-th largest key bit by bit from the top with branch-free counting passes.
"""

from __future__ import annotations

import numpy as np

from edit_train.codec.sparse_bits import njit


@njit(cache=True, nogil=True)
def _keys(x, start, end, g, groups, keys):  # pragma: no cover - compiled
    """Group keys of one chunk, g > 1: the squared L2 norm (every value finite, so a key is a number or +inf
    where the squares overflow: plain float order). Returns False if a value is not finite."""
    for j in range(groups):
        acc = np.float32(0.0)
        lo, hi = start + j * g, min(start + (j + 1) * g, end)
        for t in range(lo, hi):
            v = x[t]
            acc += v * v
        if not np.isfinite(acc):  # NaN or inf in the group, or finite squares that overflow
            for t in range(lo, hi):
                if not np.isfinite(x[t]):
                    return False
        keys[j] = acc
    return True


@njit(cache=True, nogil=True)
def _top(bits, groups, k, best_idx):  # pragma: no cover - compiled
    """The indices of the k largest keys, ascending, into best_idx[:k] (best_idx holds groups + 1). `bits`:
    the keys' int32 bit patterns (non-negative floats and +inf order as their patterns). The k-th largest
    pattern is found bit by bit from the top (up to 31 branch-free counting passes over the chunk's keys, fewer
    once exactly k are at or above the prefix — no data-dependent branch to mispredict, which made a sort or
    a quickselect 10 ns a key); then one pass takes every key above it and, of the keys equal to it, the
    earliest."""
    thr = np.int32(0)
    ties = -1
    for b in range(30, -1, -1):
        cand = thr | np.int32(1 << b)
        count = 0
        for j in range(groups):
            count += bits[j] >= cand
        if count >= k:
            thr = cand
            if count == k:  # exactly the k largest are >= thr: done (random keys get here in ~15 passes)
                ties = 0
                thr -= 1  # "above thr" below is then "at least cand"
                break
    if ties < 0:  # thr is the k-th largest key itself
        above = 0
        for j in range(groups):
            above += bits[j] > thr
        ties = k - above
    a = 0
    for j in range(groups):
        key = bits[j]
        take = (key > thr) | ((key == thr) & (ties > 0))
        ties -= (key == thr) & take
        best_idx[a] = j
        a += take


@njit(cache=True, nogil=True)
def _bitonic(rows, n_rows, lanes, descending):  # pragma: no cover - compiled
    """Sort each column of rows[:n_rows, :lanes] (n_rows a power of two) with a bitonic network: every
    compare-exchange is a min and a max of two rows over all lanes (chunks) at once, data-independent and
    vectorised — where a per-chunk sort or quickselect loses ~10 ns a key to mispredicted branches."""
    size = 2
    while size <= n_rows:
        stride = size // 2
        while stride > 0:
            for i in range(n_rows):
                o = i ^ stride
                if o > i:
                    up = ((i & size) == 0) == descending  # this pair's larger value goes to row i
                    a, b = (rows[i], rows[o]) if up else (rows[o], rows[i])
                    for c in range(lanes):  # one loop body: it vectorises (two made it 4x slower)
                        x, y = a[c], b[c]
                        a[c] = max(x, y)
                        b[c] = min(x, y)
            stride //= 2
        size *= 2


@njit(cache=True, nogil=True, inline="always")
def _select_block(x, b0, lanes, chunk, g, G, P, k, K2, ib, kbits, keys, gmax, sel):  # pragma: no cover - compiled
    """Full chunks b0 .. b0+lanes: each group's norm (keys, as bits in kbits) and largest |value| (gmax); a
    key's low ib bits become (G − 1 − group), so keys are distinct and a tie goes to the earlier group; one
    network sorts every chunk's keys (descending), the first k are kept, a second orders their indices into
    sel[:k, :lanes]. False if a value is not finite."""
    low = (1 << ib) - 1
    for c in range(lanes):
        start = (b0 + c) * chunk
        for j in range(G):
            s2 = np.float32(0.0)
            mx = np.float32(0.0)
            for t in range(start + j * g, start + (j + 1) * g):
                v = x[t]
                s2 += v * v if g > 1 else abs(v)
                mx = max(mx, abs(v))
            if not np.isfinite(s2):  # NaN or inf in the group, or finite squares that overflow
                for t in range(start + j * g, start + (j + 1) * g):
                    if not np.isfinite(x[t]):
                        return False
            keys[j, c] = s2
            gmax[j, c] = mx
    for j in range(G):
        row = kbits[j]
        tag = G - 1 - j
        for c in range(lanes):
            row[c] = (row[c] & ~low) | tag
    for j in range(G, P):
        for c in range(lanes):
            kbits[j, c] = -1
    _bitonic(kbits, P, lanes, True)
    for a in range(K2):
        for c in range(lanes):
            sel[a, c] = G - 1 - (kbits[a, c] & low) if a < k else 1 << 30
    _bitonic(sel, K2, lanes, False)
    return True
