"""Sparse, low-bit pseudo-gradients (``sync.compression=topk``): chunked top-k, a b-bit code per kept value,
one scale per chunk. Pure tensor math on any device; the payload is one flat ``uint8`` tensor.

Selection. The flat tensor (``n`` values) is cut into chunks of ``C = sync.block_size`` values (the last one
may be shorter, ``L``); each chunk keeps its ``k = round(sync.topk_density · C)`` values of largest magnitude
(``min(k, L)`` in the last), so selection is one batched ``topk`` over a ``[n/C, C]`` view and an index is a
position inside its chunk: ``ib = ⌈log₂ C⌉`` bits (8 for the default 256).

Values. ``s`` = the largest kept magnitude of the chunk (stored as ``sync.scale_dtype``); a kept value is a
sign bit and a ``b − 1``-bit magnitude level, ``(c + 1)/M · s`` with ``M = 2^(b−1)`` (no zero level: a kept
value is never zero unless its whole chunk is), rounded to the nearest level. ``b = sync.bits`` ∈ {1, 2, 4, 8};
``b = 1`` is the sign times the chunk's scale.

Wire format (little-endian, byte-aligned sections; ``m = ⌈n/C⌉`` chunks, ``K`` kept values in all)::

    header   8 bytes   0x53, version 1, b, ib, flags (bit 0: non-finite), 0, 0, 0
    scales   m · S     S = 4 (fp32) or 2 (bf16) bytes, chunk order
    values   ⌈K·b/8⌉   codes packed LSB first, chunk order, ascending index inside a chunk
    indices  ⌈K·ib/8⌉  positions inside their chunk, packed the same way

``sparse_bytes(n)`` is exactly that sum, and that is what the ``bytes`` of a ``sync`` event count (plus the
tag of every piece). A tensor with a non-finite value anywhere is sent as the header with the non-finite
flag and an all-zero body of the same length: every receiver decodes it to NaN (the rule gives it weight 0;
it is never silently made finite). Everything else a receiver cannot decode is refused by :func:`decode`
with one line (:class:`PayloadError`): a wrong length or header, a non-finite or negative scale, an index
outside its chunk or not strictly ascending inside it. Decoding is deterministic: the same bytes give the
bit-identical fp32 tensor on every rank and device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from edit_train.local_sgd.errors import FederationError

__all__ = ["PayloadError", "SparseFormat", "sparse_bytes", "encode", "decode", "pack_bits", "unpack_bits"]

MAGIC, VERSION, HEADER = 0x53, 1, 8
NONFINITE = 1
BITS = (1, 2, 4, 8)
MAX_CHUNK = 1 << 16  # indices of at most 16 bits
_SCALE = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}


class PayloadError(FederationError, ValueError):
    """A sparse payload that cannot be decoded (it came from another cluster): refused, never used."""


@dataclass(frozen=True)
class SparseFormat:
    chunk: int  # C: values per chunk (sync.block_size)
    k: int  # kept values per full chunk
    bits: int  # b: bits per kept value
    scale_dtype: str = "fp32"

    @staticmethod
    def of(chunk: int, density: float, bits: int, scale_dtype: str = "fp32") -> SparseFormat:
        return SparseFormat(chunk, max(1, min(chunk, round(density * chunk))), bits, scale_dtype)

    @property
    def index_bits(self) -> int:
        return max(1, (self.chunk - 1).bit_length())

    @property
    def scale_bytes(self) -> int:
        return _SCALE[self.scale_dtype][1]

    def kept(self, numel: int) -> tuple[int, int, int]:
        """(chunks m, kept values K, kept in the last chunk) for ``numel`` values."""
        m = math.ceil(numel / self.chunk)
        if m == 0:
            return 0, 0, 0
        last = min(self.k, numel - (m - 1) * self.chunk)
        return m, (m - 1) * self.k + last, last

    def sections(self, numel: int) -> tuple[int, int, int, int]:
        """Bytes of (header, scales, values, indices)."""
        m, kept, _ = self.kept(numel)
        return HEADER, m * self.scale_bytes, math.ceil(kept * self.bits / 8), math.ceil(kept * self.index_bits / 8)


def sparse_bytes(numel: int, f: SparseFormat) -> int:
    return sum(f.sections(numel))


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
    shifts = torch.arange(bits, device=codes.device)
    flat = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8)).view(-1, 8)
    return (flat << torch.arange(8, device=codes.device)).sum(dim=1).to(torch.uint8)


def unpack_bits(buf: Tensor, count: int, bits: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes (int64)."""
    if bits == 8:
        return buf[:count].to(torch.int64)
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=buf.device)
        return ((buf.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count].to(torch.int64)
    flat = ((buf.to(torch.int64).unsqueeze(1) >> torch.arange(8, device=buf.device)) & 1).reshape(-1)
    flat = flat[:count * bits].view(count, bits)
    return (flat << torch.arange(bits, device=buf.device)).sum(dim=1)


# ------------------------------------------------------------------------------------------ encode / decode
def _header(f: SparseFormat, flags: int, device: torch.device) -> Tensor:
    return torch.tensor([MAGIC, VERSION, f.bits, f.index_bits, flags, 0, 0, 0], dtype=torch.uint8, device=device)


def _select(x: Tensor, f: SparseFormat) -> tuple[Tensor, Tensor, Tensor]:
    """(kept values [K], their chunk [K], their index inside it [K]) in chunk order, ascending index. A NaN
    ranks above every number in ``topk``, an inf above every finite value: a non-finite chunk keeps one."""
    n, dev = x.numel(), x.device
    full, tail = divmod(n, f.chunk)
    idx, chunk = [], []
    if full:
        # |x| compared as int32 bit patterns: the same order for non-negative floats (NaN > inf > finite
        # included), and a faster topk on CPU
        top = x[:full * f.chunk].view(full, f.chunk).abs().view(torch.int32).topk(f.k, dim=1, sorted=False).indices
        if f.k <= 16:  # a few per chunk: sort them
            idx.append(top.sort(dim=1).values.reshape(-1))
            chunk.append(torch.arange(full, device=dev).repeat_interleave(f.k))
        else:  # many: mark them and read the marks back in order (ascending per chunk, no sort)
            kept = torch.zeros(full, f.chunk, dtype=torch.bool, device=dev).scatter_(1, top, True)
            c, i = kept.nonzero(as_tuple=True)
            idx.append(i)
            chunk.append(c)
    if tail:  # the last chunk is shorter
        top = x[full * f.chunk:].abs().topk(min(f.k, tail), sorted=False).indices
        idx.append(top.sort().values)
        chunk.append(torch.full_like(top, full))
    i, c = torch.cat(idx), torch.cat(chunk)
    return x[c * f.chunk + i], c, i


def encode(x: Tensor, f: SparseFormat) -> Tensor:
    """Flat fp32 ``x`` -> one ``uint8`` payload of exactly ``sparse_bytes(x.numel(), f)`` bytes."""
    x = x.reshape(-1).float()
    n, dev = x.numel(), x.device
    sizes = f.sections(n)
    if n == 0:
        return _header(f, 0, dev)
    m = f.kept(n)[0]
    vals, chunk, idx = _select(x, f)
    if not bool(torch.isfinite(vals).all()):  # every non-finite chunk kept one (see _select)
        out = torch.zeros(sum(sizes), dtype=torch.uint8, device=dev)
        out[:HEADER] = _header(f, NONFINITE, dev)
        return out
    sdtype = _SCALE[f.scale_dtype][0]
    full = n // f.chunk
    if full == m:  # every chunk holds exactly k kept values, in chunk order
        absmax = vals.abs().view(m, f.k).amax(dim=1)
    else:
        absmax = torch.zeros(m, dtype=torch.float32, device=dev).scatter_reduce(0, chunk, vals.abs(), "amax")
    stored = absmax.to(sdtype)
    s = stored.float()[chunk]
    levels = 1 << (f.bits - 1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    mag = ((vals.abs() / safe * levels).round() - 1).clamp(0, levels - 1).to(torch.int64)
    code = mag | ((vals < 0).to(torch.int64) << (f.bits - 1))
    return torch.cat([_header(f, 0, dev), stored.contiguous().view(torch.uint8),
                      pack_bits(code, f.bits), pack_bits(idx, f.index_bits)])


def _refuse(why: str) -> PayloadError:
    return PayloadError(f"sparse payload refused: {why}")


def _check_header(head: list[int], f: SparseFormat) -> bool:
    """Is the payload flagged non-finite? (raises on a header that is not this format's)"""
    want = [MAGIC, VERSION, f.bits, f.index_bits]
    if head[:4] != want or head[5:] != [0, 0, 0] or head[4] not in (0, NONFINITE):
        raise _refuse(f"header {head} is not this federation's format {want + ['flags', 0, 0, 0]} "
                      f"(sync.bits={f.bits}, sync.block_size={f.chunk})")
    return head[4] == NONFINITE


def decode(payload: Tensor, numel: int, f: SparseFormat) -> Tensor:
    """A payload of ``numel`` values (possibly another cluster's) -> flat fp32, or :class:`PayloadError`."""
    sizes = f.sections(numel)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != sum(sizes):
        raise _refuse(f"{payload.numel()} {payload.dtype} where {numel} values take {sum(sizes)} bytes "
                      f"(k={f.k} of every {f.chunk}, {f.bits}-bit values, {f.scale_dtype} scales)")
    dev = payload.device
    if _check_header(payload[:HEADER].tolist(), f):
        return torch.full((numel,), float("nan"), dtype=torch.float32, device=dev)
    m, kept, last = f.kept(numel)
    at = [HEADER, HEADER + sizes[1], HEADER + sizes[1] + sizes[2]]
    scales = payload[at[0]:at[1]].clone().view(_SCALE[f.scale_dtype][0]).float()
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        bad = int((~torch.isfinite(scales) | (scales < 0)).nonzero()[0])
        raise _refuse(f"scale of chunk {bad} is {float(scales[bad])} (finite and >= 0 expected)")
    code = unpack_bits(payload[at[1]:at[2]], kept, f.bits)
    idx = unpack_bits(payload[at[2]:], kept, f.index_bits)
    per = torch.full((m,), f.k, dtype=torch.int64, device=dev)
    if m:
        per[-1] = last
    chunk = torch.repeat_interleave(torch.arange(m, device=dev), per)
    limit = torch.where(chunk == m - 1, numel - (m - 1) * f.chunk, f.chunk)
    if bool((idx >= limit).any()):
        j = int((idx >= limit).nonzero()[0])
        raise _refuse(f"index {int(idx[j])} of chunk {int(chunk[j])} is out of range [0, {int(limit[j])})")
    same = chunk[1:] == chunk[:-1]
    if bool((same & (idx[1:] <= idx[:-1])).any()):
        j = int((same & (idx[1:] <= idx[:-1])).nonzero()[0])
        raise _refuse(f"indices of chunk {int(chunk[j])} are not strictly ascending ({int(idx[j])}, {int(idx[j + 1])})")
    levels = 1 << (f.bits - 1)
    mag = ((code & (levels - 1)) + 1).float() / levels * scales[chunk]
    vals = torch.where((code >> (f.bits - 1)) & 1 == 1, -mag, mag)
    out = torch.zeros(m * f.chunk, dtype=torch.float32, device=dev)
    out[chunk * f.chunk + idx] = vals
    return out[:numel]
