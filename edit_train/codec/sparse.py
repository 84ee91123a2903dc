"""Sparse, low-bit pseudo-gradients (``sync.compression=topk``): chunked top-k, a b-bit code per kept value,
one scale per chunk. Pure tensor math on any device; the payload is one flat ``uint8`` tensor.

Selection. The flat tensor (``n`` values) is cut into chunks of ``C = sync.block_size`` values (the last one
may be shorter, ``L``) and each chunk into ``G = C/g`` groups of ``g = sync.topk_group`` consecutive values
(the last group may be short: it is padded with zeros). Each chunk keeps its ``k = round(sync.topk_density ·
G)`` groups of largest magnitude (``|x|`` for ``g = 1``, the squared L2 norm of the group otherwise;
``min(k, ⌈L/g⌉)`` in the last chunk), so selection is one batched ``topk`` over a ``[n/C, G]`` view and an
index is a group's position inside its chunk: ``ib = ⌈log₂ G⌉`` bits (8 for the default 256 and ``g = 1``).
Groups trade selection precision for speed and index bytes: ``topk`` runs over ``G`` items, not ``C``, and
one index serves ``g`` values.

Values. ``s`` = the largest kept magnitude of the chunk (stored as ``sync.scale_dtype``). With ``g = 1`` a
kept value is a sign bit and a ``b − 1``-bit magnitude level, ``(c + 1)/M · s`` with ``M = 2^(b−1)`` (no zero
level: a kept value is never zero unless its whole chunk is), rounded to the nearest level; ``b = 1`` is the
sign times the chunk's scale. With ``g > 1`` a group holds small values too, so the code is offset binary with
a zero: ``(c − Q)/Q · s``, ``Q = 2^(b−1) − 1``, ``c ∈ [0, 2Q]`` (``b ≥ 2``). ``b = sync.bits`` ∈ {1, 2, 4, 8}.

Wire format (little-endian, byte-aligned sections; ``m = ⌈n/C⌉`` chunks, ``K`` kept groups in all)::

    header   8 bytes   0x53, version 1, b, ib, flags (bit 0: non-finite), log₂ g, 0, 0
    scales   m · S     S = 4 (fp32) or 2 (bf16) bytes, chunk order
    values   ⌈K·g·b/8⌉ codes packed LSB first, chunk order, ascending index inside a chunk
    indices  ⌈K·ib/8⌉  positions inside their chunk, packed the same way

(``g = 1`` is byte for byte the format before groups existed.) ``sparse_bytes(n)`` is exactly that sum, and
that is what the ``bytes`` of a ``sync`` event count (plus the tag of every piece). A tensor with a non-finite
value anywhere is sent as the header with the non-finite flag and an all-zero body of the same length: every
receiver decodes it to NaN (the rule gives it weight 0; it is never silently made finite). Everything else a
receiver cannot decode is refused by :func:`decode` with one line (:class:`PayloadError`): a wrong length or
header, a non-finite or negative scale, an index outside its chunk or not strictly ascending inside it, a code
outside ``[0, 2Q]``. The same bytes decode to the bit-identical fp32 tensor on every rank, device and codec (on
CPU, :mod:`sparse_fused`'s); :func:`encode_own` hands the sender that tensor without decoding its bytes."""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import Tensor

from edit_train.codec import compiled, sparse_fused
from edit_train.codec.sparse_format import (BITS, HEADER, MAGIC, MAX_CHUNK, MAX_GROUP, NONFINITE,  # noqa: F401
                                            VERSION, SparseFormat, format_error, sparse_bytes)
from edit_train.local_sgd.errors import FederationError

__all__ = ["PayloadError", "SparseFormat", "sparse_bytes", "format_error", "encode", "encode_own", "decode",
           "pack_bits", "unpack_bits", "warm"]

_SCALE = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}
log = logging.getLogger(__name__)
FUSED = True  # CPU tensors take sparse_fused's one-pass codec where numba is installed (tests switch it off)


def _fused(t: Tensor) -> bool:
    return FUSED and sparse_fused.AVAILABLE and t.device.type == "cpu"


class PayloadError(FederationError, ValueError):
    """A sparse payload that cannot be decoded (it came from another cluster): refused, never used."""


# ------------------------------------------------------------------------------------------ bit packing
def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Non-negative integers < 2**bits -> ``⌈len·bits/8⌉`` bytes, LSB first."""
    if bits == 8:
        return codes.reshape(-1).to(torch.uint8)
    if 8 % bits == 0:  # 1, 2, 4 bits: whole codes per byte, code t at bit (t mod 8/bits)·bits of byte t·bits/8
        per = 8 // bits
        c = codes.reshape(-1).to(torch.uint8)
        c = torch.nn.functional.pad(c, (0, -c.numel() % per)).view(-1, per)
        out = c[:, 0].clone()
        for j in range(1, per):
            out |= c[:, j] << (j * bits)
        return out
    codes = codes.reshape(-1).to(torch.int64)
    if bits < 8:  # 3, 5, 6, 7 bits: 8 codes are one integer of 8·bits <= 56 bits, i.e. `bits` whole bytes
        count = codes.numel()
        eight = torch.nn.functional.pad(codes, (0, -count % 8)).view(-1, 8)
        word = (eight << torch.arange(0, 8 * bits, bits, device=codes.device)).sum(dim=1, keepdim=True)
        out = ((word >> torch.arange(0, 8 * bits, 8, device=codes.device)) & 0xFF).to(torch.uint8).reshape(-1)
        return out[:math.ceil(count * bits / 8)]
    shifts = torch.arange(bits, device=codes.device)
    flat = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8)).view(-1, 8)
    return (flat << torch.arange(8, device=codes.device)).sum(dim=1).to(torch.uint8)


def unpack_bits(buf: Tensor, count: int, bits: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes (int64)."""
    if bits == 8 or 8 % bits == 0:
        return _unpack_bytes(buf, count, bits).to(torch.int64)
    if bits < 8:  # the inverse of pack_bits's 8-codes-in-`bits`-bytes words
        whole = torch.nn.functional.pad(buf[:math.ceil(count * bits / 8)].to(torch.int64),
                                        (0, -math.ceil(count * bits / 8) % bits)).view(-1, bits)
        word = (whole << torch.arange(0, 8 * bits, 8, device=buf.device)).sum(dim=1, keepdim=True)
        return ((word >> torch.arange(0, 8 * bits, bits, device=buf.device)) & ((1 << bits) - 1)).reshape(-1)[:count]
    flat = ((buf.to(torch.int64).unsqueeze(1) >> torch.arange(8, device=buf.device)) & 1).reshape(-1)
    flat = flat[:count * bits].view(count, bits)
    return (flat << torch.arange(bits, device=buf.device)).sum(dim=1)


def _unpack_bytes(buf: Tensor, count: int, bits: int) -> Tensor:
    """:func:`unpack_bits` for 1, 2, 4 and 8 bits, left as ``uint8`` (a value code needs no wider type)."""
    if bits == 8:
        return buf[:count]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=buf.device)
    return ((buf.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count]


# ------------------------------------------------------------------------------------------ the code of a value
def _levels(f: SparseFormat) -> int:
    """M = 2^(b−1) (g = 1: magnitude levels) or Q = 2^(b−1) − 1 (g > 1: levels each side of zero)."""
    return (1 << (f.bits - 1)) - (f.group > 1)


def _to_codes(vals: Tensor, s: Tensor, f: SparseFormat) -> Tensor:
    """Kept values and their chunk's scale (same shape) -> codes (int64)."""
    levels = _levels(f)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    if f.group == 1:
        mag = ((vals.abs() / safe * levels).round() - 1).clamp(0, levels - 1).to(torch.int64)
        return mag | ((vals < 0).to(torch.int64) << (f.bits - 1))
    return (vals * (levels / safe)).round_().clamp_(-levels, levels).add_(levels).to(torch.uint8)


def _from_codes(code: Tensor, s: Tensor, f: SparseFormat) -> Tensor:
    """Codes and their chunk's scale -> fp32 values: the one formula sender and receivers share."""
    levels = _levels(f)
    if f.group == 1:
        mag = ((code & (levels - 1)) + 1).float() / levels * s
        return torch.where((code >> (f.bits - 1)) & 1 == 1, -mag, mag)
    return code.float().sub_(levels).mul_(s / levels)


def _place(vals: Tensor, rows: Tensor, numel: int, f: SparseFormat) -> Tensor:
    """Kept groups ``[K·g]`` at their rows (chunk·G + index) of a zero tensor -> flat fp32 of ``numel``."""
    m = math.ceil(numel / f.chunk)
    if f.group == 1:
        out = torch.zeros(m * f.chunk, dtype=torch.float32, device=vals.device)
        out[rows] = vals
        return out[:numel]
    out = torch.zeros(m * f.groups, f.group, dtype=torch.float32, device=vals.device)
    out.index_copy_(0, rows, vals.view(-1, f.group))
    return out.view(-1)[:numel]


# ------------------------------------------------------------------------------------------ encode / decode
def _header(f: SparseFormat, flags: int, device: torch.device) -> Tensor:
    return torch.tensor([MAGIC, VERSION, f.bits, f.index_bits, flags, f.group_log2, 0, 0], dtype=torch.uint8,
                        device=device)


def _select(mag: Tensor, f: SparseFormat) -> tuple[Tensor, Tensor]:
    """Per-group magnitudes ``[⌈n/g⌉]`` -> (chunk [K], index inside it [K]) of the kept groups, in chunk
    order, ascending index. A NaN ranks above every number in ``topk``, an inf above every finite value: a
    non-finite chunk keeps one."""
    items, G, dev = mag.numel(), f.groups, mag.device
    full, tail = divmod(items, G)
    idx, chunk = [], []
    if full:
        # magnitudes compared as int32 bit patterns (abs first: a NaN may carry a sign): the same order for
        # non-negative floats (NaN > inf > finite included), and a faster topk on CPU
        top = mag[:full * G].view(full, G).abs().view(torch.int32).topk(f.k, dim=1, sorted=False).indices
        if f.k <= 16:  # a few per chunk: sort them
            idx.append(top.sort(dim=1).values.reshape(-1))
            chunk.append(torch.arange(full, device=dev).repeat_interleave(f.k))
        else:  # many: mark them and read the marks back in order (ascending per chunk, no sort)
            kept = torch.zeros(full, G, dtype=torch.bool, device=dev).scatter_(1, top, True)
            c, i = kept.nonzero(as_tuple=True)
            idx.append(i)
            chunk.append(c)
    if tail:  # the last chunk is shorter
        top = mag[full * G:].abs().view(torch.int32).topk(min(f.k, tail), sorted=False).indices
        idx.append(top.sort().values)
        chunk.append(torch.full_like(top, full))
    return torch.cat(chunk), torch.cat(idx)


def encode_own(x: Tensor, f: SparseFormat) -> tuple[Tensor, Tensor]:
    """Flat fp32 ``x`` -> (the ``uint8`` payload of exactly ``sparse_bytes(x.numel(), f)`` bytes, the fp32
    tensor every receiver decodes it to: bit-identical to ``decode(payload)``, made from the codes already
    at hand instead of unpacking and checking the sender's own bytes)."""
    x = x.reshape(-1).float()
    n, dev, g = x.numel(), x.device, f.group
    sizes = f.sections(n)
    if n == 0:
        return _header(f, 0, dev), x.clone()
    if _fused(x):
        out = torch.empty(sum(sizes), dtype=torch.uint8)
        own = torch.empty(n, dtype=torch.float32)
        args = (f.chunk, g, f.k, f.bits, f.index_bits, f.scale_dtype == "bf16")
        xs, o, w = x.detach().contiguous().numpy(), out.numpy(), own.numpy()
        status = (sparse_fused.specialized(*args)[0](xs, o, w) if n >= sparse_fused.SPECIALIZE_MIN
                  else sparse_fused.encode(xs, *args, o, w))
        if status == sparse_fused.NONFINITE:
            return _nonfinite(f, sizes, n, dev)
        out[:HEADER] = _header(f, 0, dev)
        return out, own
    m, _, last = f.kept(n)
    padded = x if n % g == 0 else torch.nn.functional.pad(x, (0, -n % g))
    grouped = padded.view(-1, g)
    # a group's squared L2 norm as a matrix-vector product (NaN and inf carry through it)
    mag = x if g == 1 else (grouped * grouped) @ torch.ones(g, dtype=torch.float32, device=dev)
    chunk, idx = _select(mag, f)
    rows = chunk * f.groups + idx
    vals = grouped.index_select(0, rows).reshape(-1)
    even = last == f.k  # every chunk holds exactly k kept groups, in chunk order: [m, k·g] views
    if even:
        vals = vals.view(m, -1)
        absmax = vals.abs().amax(dim=1)  # amax carries NaN: a non-finite kept value shows in its scale
    else:
        per_value = chunk if g == 1 else chunk.repeat_interleave(g)
        absmax = torch.zeros(m, dtype=torch.float32, device=dev).scatter_reduce(0, per_value, vals.abs(), "amax")
    if not bool(torch.isfinite(absmax.amax() if even else vals.abs().amax())):  # every non-finite chunk kept one
        return _nonfinite(f, sizes, n, dev)
    stored = absmax.to(_SCALE[f.scale_dtype][0])
    s = stored.float().unsqueeze(1) if even else stored.float()[per_value]
    code = _to_codes(vals, s, f)
    payload = torch.cat([_header(f, 0, dev), stored.contiguous().view(torch.uint8), pack_bits(code, f.bits),
                         pack_bits(idx, f.index_bits)])
    return payload, _place(_from_codes(code, s, f).reshape(-1), rows, n, f)


def _nonfinite(f: SparseFormat, sizes: tuple[int, ...], n: int, dev: torch.device) -> tuple[Tensor, Tensor]:
    """The payload of a tensor with a non-finite value: the flagged header, a zero body; it decodes to NaN."""
    out = torch.zeros(sum(sizes), dtype=torch.uint8, device=dev)
    out[:HEADER] = _header(f, NONFINITE, dev)
    return out, torch.full((n,), float("nan"), dtype=torch.float32, device=dev)


def warm(f: SparseFormat, device: torch.device | str = "cpu") -> None:
    """Load (first time on a machine: compile) format ``f``'s fused kernels: start-up pays, not a sync. Says so in
    a line before (a compile is tens of seconds of start-up on a busy host, with nothing else printed meanwhile)
    and, after a compile, where numba keeps the kernels for the next run."""
    if not (FUSED and sparse_fused.AVAILABLE) or torch.device(device).type != "cpu":
        return
    known = compiled.key(f) in compiled.compiled()
    log.info("top-k kernels (numba): %s the codec's kernels for %s …", "loading" if known else
             "compiling (once per machine and format: tens of seconds on a busy host)", compiled.key(f))
    t0 = time.monotonic()
    for n in (1, sparse_fused.SPECIALIZE_MIN):  # the generic kernel and the one compiled for the format
        decode(encode_own(torch.zeros(n), f)[0], n, f)
    compiled.record(f)  # the planner counts a format's compile time in start-up until it is on disk here
    if not known:
        log.info("top-k kernels (numba): ready in %.0f s; numba keeps them in %s, later runs load them",
                 time.monotonic() - t0, compiled.cache_dir())


def encode(x: Tensor, f: SparseFormat) -> Tensor:
    """Flat fp32 ``x`` -> one ``uint8`` payload of exactly ``sparse_bytes(x.numel(), f)`` bytes."""
    return encode_own(x, f)[0]


def _refuse(why: str) -> PayloadError:
    return PayloadError(f"sparse payload refused: {why}")


def _check_header(head: list[int], f: SparseFormat) -> bool:
    """Is the payload flagged non-finite? (raises on a header that is not this format's)"""
    want = [MAGIC, VERSION, f.bits, f.index_bits]
    if head[:4] != want or head[5:] != [f.group_log2, 0, 0] or head[4] not in (0, NONFINITE):
        raise _refuse(f"header {head} is not this federation's format {want + ['flags', f.group_log2, 0, 0]} "
                      f"(sync.bits={f.bits}, sync.block_size={f.chunk}, sync.topk_group={f.group})")
    return head[4] == NONFINITE


def _check_rows(idx: Tensor, first: int, limit: int | None) -> None:
    """Indices ``[chunks, kept]`` of consecutive chunks from ``first``: each below ``limit`` (None: the index
    width cannot say more) and strictly ascending along its row; else :class:`PayloadError`."""
    if limit is not None and bool((idx >= limit).any()):
        c, j = (int(v) for v in (idx >= limit).nonzero()[0])
        raise _refuse(f"index {int(idx[c, j])} of chunk {first + c} is out of range [0, {limit})")
    if idx.shape[1] > 1 and bool((idx[:, 1:] <= idx[:, :-1]).any()):
        c, j = (int(v) for v in (idx[:, 1:] <= idx[:, :-1]).nonzero()[0])
        raise _refuse(f"indices of chunk {first + c} are not strictly ascending ({int(idx[c, j])}, "
                      f"{int(idx[c, j + 1])})")


def _check_indices(idx: Tensor, numel: int, f: SparseFormat) -> None:
    """Every chunk's indices in range and ascending: the full chunks as one ``[m−1, k]`` view, then the last
    (``last`` indices below its own group count); ranges before order, chunk by chunk."""
    m, kept, last = f.kept(numel)
    if m == 0:
        return
    tail = math.ceil((numel - (m - 1) * f.chunk) / f.group)
    full = None if f.groups & (f.groups - 1) == 0 else f.groups  # a power of two: the width bounds it
    _check_rows(idx[:kept - last].view(m - 1, f.k), 0, full)
    _check_rows(idx[kept - last:].view(1, last), m - 1, None if tail == f.groups and full is None else tail)


def decode(payload: Tensor, numel: int, f: SparseFormat) -> Tensor:
    """A payload of ``numel`` values (possibly another cluster's) -> flat fp32, or :class:`PayloadError`."""
    sizes = f.sections(numel)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != sum(sizes):
        raise _refuse(f"{payload.numel()} {payload.dtype} where {numel} values take {sum(sizes)} bytes "
                      f"(k={f.k} of every {f.groups} groups of {f.group}, {f.bits}-bit values, "
                      f"{f.scale_dtype} scales)")
    dev = payload.device
    if _check_header(payload[:HEADER].tolist(), f):
        return torch.full((numel,), float("nan"), dtype=torch.float32, device=dev)
    if _fused(payload) and numel:
        out = torch.empty(numel, dtype=torch.float32)
        args = (f.chunk, f.group, f.k, f.bits, f.index_bits, f.scale_dtype == "bf16")
        buf, o = payload.contiguous().numpy(), out.numpy()
        status = (sparse_fused.specialized(*args)[1](buf, numel, o) if numel >= sparse_fused.SPECIALIZE_MIN
                  else sparse_fused.decode(buf, numel, *args, o))
        if status == sparse_fused.OK:
            return out
        # a scale, code or index is wrong: the eager checks below refuse it with the line that names it
    m, kept, last = f.kept(numel)
    at = [HEADER, HEADER + sizes[1], HEADER + sizes[1] + sizes[2]]
    scales = payload[at[0]:at[1]].clone().view(_SCALE[f.scale_dtype][0]).float()
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        bad = int((~torch.isfinite(scales) | (scales < 0)).nonzero()[0])
        raise _refuse(f"scale of chunk {bad} is {float(scales[bad])} (finite and >= 0 expected)")
    code = _unpack_bytes(payload[at[1]:at[2]], kept * f.group, f.bits)
    if f.group == 1:
        code = code.to(torch.int64)
    if f.group > 1 and bool((code > 2 * _levels(f)).any()):
        raise _refuse(f"a value code above {2 * _levels(f)} (the largest level of {f.bits}-bit values)")
    idx = unpack_bits(payload[at[2]:], kept, f.index_bits)
    _check_indices(idx, numel, f)
    if m and last == f.k:  # every chunk holds k
        chunk = torch.arange(m, device=dev).unsqueeze(1).expand(m, f.k).reshape(-1)
    else:
        per = torch.full((m,), f.k, dtype=torch.int64, device=dev)
        if m:
            per[-1] = last
        chunk = torch.repeat_interleave(torch.arange(m, device=dev), per)
    if last == f.k:  # every chunk holds k groups: the scales broadcast over [m, k·g] (as in encode_own)
        vals = _from_codes(code.view(m, -1), scales.unsqueeze(1), f).reshape(-1)
    else:
        vals = _from_codes(code, scales[chunk if f.group == 1 else chunk.repeat_interleave(f.group)], f)
    return _place(vals, chunk * f.groups + idx, numel, f)
