"""SUM of a flat fp32 tensor over a process group, with compressed payloads and error feedback.

``compressed_sum(x, pg, cfg)`` works on any ``torch.distributed`` process group object: the default group,
a ``dist.new_group``, or a torchft reconfigurable ``ProcessGroupGloo`` (its ``rank()`` is not the configured
rank, so the rank is read from its ``parent``). It calls the group's own methods (``allreduce``,
``allgather``, ``alltoall_base``), which is all gloo offers: gloo cannot SUM int8 (nor reduce-scatter at
all), so lossy schemes move ``uint8`` payloads and every receiver dequantizes and accumulates in fp32,
**in rank order 0..P−1**, so every rank ends with the bit-identical sum.

Methods (``P`` clusters, ``n`` values, ``B(m) = wire_bytes(m, cfg)``, chunks ``n_j`` block-aligned):

* ``all_reduce`` (scheme ``none``): fp32 SUM all-reduce. Handed: ``4n``. Wire (ring): ``2(P−1)·4n`` in all.
* ``all_gather``: every rank all-gathers its payload and sums the P dequantized payloads.
  Handed: ``B(n)``. Wire: ``P(P−1)·B(n)`` in all (each payload reaches the P−1 others).
* ``rs_ag``: reduce-scatter as an all-to-all of quantized chunks (rank j owns chunk j and receives only
  chunk j from the others; nothing is sent to oneself), the owner sums the P dequantized chunks in fp32,
  re-quantizes its sum, then an all-gather of the re-quantized sums (padded to the largest, ``Bmax``).
  Handed by rank r: ``Σ_{j≠r} B(n_j) + Bmax``. Wire: ``(P−1)·Σ_j B(n_j) + P(P−1)·Bmax`` in all.

Sparse payloads (``topk``) cannot be summed on the way nor re-sparsified as a sum: they always take the
all-gather, each receiver decoding every payload and adding them in rank order (:func:`gathered_sum` does the
same over authenticated pieces).

``method="auto"`` picks ``rs_ag`` iff its wire total is strictly smaller than ``all_gather``'s (the same
decision on every rank: it depends only on n, P and cfg). For P = 2 that never happens (both move
``2·B(n)``; all-gather needs one round and one quantization), for P ≥ 3 it does once the tensor spans at
least about P blocks (``≈ 2(P−1)·B(n)`` vs ``P(P−1)·B(n)``).

bf16 goes through the same payload path, not a bf16 all-reduce: the sum is accumulated in fp32 (a bf16 ring
all-reduce rounds every partial sum to bf16, and that rounding would be nobody's residual), the error
feedback is exact, and the bytes are the same (all-gather = all-reduce at P = 2; rs_ag = ring at P ≥ 3).

Error feedback (``feedback`` given and ``cfg.error_feedback``): the sender adds its residual for ``key``
before quantizing and keeps what quantization dropped. With ``rs_ag`` the chunk owner also keeps the
residual of re-quantizing the sum under ``key + ErrorFeedback.AGG_SUFFIX`` (a full-length tensor of which
it updates its own chunk), so the second quantization is compensated too.

The returned byte count is what this rank *handed to the collectives* (the input tensors' bytes), the
figure the byte accounting and the link model use. ``plan()`` exposes method, chunks and both formulas.

Threads: ``compressed_sum`` keeps no global state and :class:`ErrorFeedback` is locked, so it may run on a
background thread. Collectives on one group must be issued in the same order on every rank, so use one
thread per group: :class:`BackgroundReducer` (one background thread; ``submit`` returns a ``Future``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

from edit_train.codec.dense import (CompressionConfig, ErrorFeedback, PayloadError, dequantize, quantize,
                                    quantize_own, wire_bytes)

__all__ = ["Plan", "plan", "handed_bytes", "sent_bytes", "group_rank_size", "compressed_sum", "compressed_gather",
           "gathered_sum", "BackgroundReducer"]

METHODS = ("auto", "all_reduce", "all_gather", "rs_ag")


@dataclass(frozen=True)
class Plan:
    method: str  # "local" (one cluster) | "all_reduce" | "all_gather" | "rs_ag"
    numel: int
    world: int
    bounds: tuple[tuple[int, int], ...]  # per-rank chunk [start, end) (rs_ag); the whole tensor otherwise
    wire_total: int  # bytes on the wire summed over all ranks (ring / direct model, see module doc)


def chunk_bounds(numel: int, world: int, block: int) -> tuple[tuple[int, int], ...]:
    """Split ``numel`` values into ``world`` block-aligned chunks, as even as whole blocks allow."""
    blocks = math.ceil(numel / block)
    return tuple((min(blocks * j // world * block, numel), min(blocks * (j + 1) // world * block, numel))
                 for j in range(world))


def _wire_all_gather(numel: int, world: int, cfg: CompressionConfig) -> int:
    return world * (world - 1) * wire_bytes(numel, cfg)


def _wire_rs_ag(bounds: tuple[tuple[int, int], ...], cfg: CompressionConfig) -> int:
    world = len(bounds)
    sizes = [wire_bytes(e - s, cfg) for s, e in bounds]
    return (world - 1) * sum(sizes) + world * (world - 1) * max(sizes)


def plan(numel: int, world: int, cfg: CompressionConfig, method: str = "auto") -> Plan:
    """How ``compressed_sum`` moves ``numel`` values among ``world`` clusters (same on every rank)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    whole = ((0, numel),)
    if world <= 1:
        return Plan("local", numel, world, whole, 0)
    if not cfg.lossy or method == "all_reduce":
        if cfg.lossy:
            raise ValueError(f"method all_reduce is for compression none, not {cfg.scheme}")
        return Plan("all_reduce", numel, world, whole, 2 * (world - 1) * 4 * numel)
    bounds = chunk_bounds(numel, world, cfg.block_size)
    ag, rs = _wire_all_gather(numel, world, cfg), _wire_rs_ag(bounds, cfg)
    if cfg.sparse:
        if method == "rs_ag":
            raise ValueError("method rs_ag cannot carry sparse payloads (a sum of them is not sparse)")
        return Plan("all_gather", numel, world, whole, ag)
    if method == "rs_ag" or (method == "auto" and rs < ag):
        return Plan("rs_ag", numel, world, bounds, rs)
    return Plan("all_gather", numel, world, whole, ag)


def handed_bytes(p: Plan, rank: int, cfg: CompressionConfig) -> int:
    """Bytes rank ``rank`` hands to the collectives under plan ``p`` (= what ``compressed_sum`` returns)."""
    if p.method == "local":
        return 0
    if p.method == "all_reduce":
        return 4 * p.numel
    if p.method == "all_gather":
        return wire_bytes(p.numel, cfg)
    sizes = [wire_bytes(e - s, cfg) for s, e in p.bounds]
    return sum(b for j, b in enumerate(sizes) if j != rank) + max(sizes)


def group_rank_size(pg: Any) -> tuple[int, int]:
    """(rank, size) of this process in ``pg``; ``None`` = the default group (or a lone process)."""
    if pg is None:
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        pg = dist.distributed_c10d._get_default_group()
    inner = getattr(type(pg), "parent", None)
    if isinstance(inner, property):  # torchft ProcessGroupWrapper: rank() is always 0, parent has the truth
        pg = pg.parent
    return int(pg.rank()), int(pg.size())


def _default(pg: Any) -> Any:
    return dist.distributed_c10d._get_default_group() if pg is None else pg


def _all_gather(pg: Any, t: Tensor, world: int) -> list[Tensor]:
    outs = [torch.empty_like(t) for _ in range(world)]
    pg.allgather([outs], [t], AllgatherOptions()).wait()
    return outs


def _all_gather_v(pg: Any, t: Tensor, sizes: Sequence[int], me: int) -> list[Tensor]:
    """Every rank's `t` when their lengths differ (`sizes[r]` elements from rank r): an all-to-all in which each
    rank sends its own to each of the others (the bytes of an all-gather of its own piece)."""
    world = len(sizes)
    out_splits = [0 if j == me else int(sizes[j]) for j in range(world)]
    in_splits = [0 if j == me else t.numel() for j in range(world)]
    out = torch.empty(sum(out_splits), dtype=t.dtype)
    inp = torch.cat([t] * (world - 1)) if world > 1 else t[:0]
    pg.alltoall_base(out, inp, out_splits, in_splits, AllToAllOptions()).wait()
    got = list(torch.split(out, out_splits))
    return [t if j == me else got[j] for j in range(world)]


def _sender(x: Tensor, cfg: CompressionConfig, fb: ErrorFeedback | None, key: str) -> Tensor:
    return fb.compensate(key, x) if fb is not None else x


def compressed_sum(x: Tensor, pg: Any, cfg: CompressionConfig, *, feedback: ErrorFeedback | None = None,
                   key: str = "", method: str = "auto") -> tuple[Tensor, int]:
    """SUM of flat fp32 ``x`` over ``pg`` -> (sum fp32 on every rank, bytes this rank handed to collectives).

    ``feedback`` is used only for lossy schemes with ``cfg.error_feedback``; ``key`` names the residual
    (e.g. module/chunk). With one cluster nothing is sent: the result is ``x`` plus any residual.
    """
    if x.dim() != 1:
        raise ValueError(f"compressed_sum takes a flat tensor, got shape {tuple(x.shape)}")
    x = x.float().contiguous()
    fb = feedback if (feedback is not None and cfg.lossy and cfg.error_feedback) else None
    rank, world = group_rank_size(pg)
    p = plan(x.numel(), world, cfg, method)
    if p.method == "local":
        out = _sender(x, cfg, fb, key).clone()
        if fb is not None:
            fb.clear(key)
        return out, 0
    pg = _default(pg)
    if p.method == "all_reduce":
        out = x.clone()
        pg.allreduce([out], AllreduceOptions()).wait()  # default op: SUM
        return out, 4 * x.numel()
    send = _sender(x, cfg, fb, key)
    if p.method == "all_gather":
        payload, own = quantize_own(send, cfg)
        if fb is not None:
            fb.update(key, own, send)
        total = torch.zeros_like(x)
        for i, got in enumerate(_all_gather(pg, payload, world)):  # rank order; this rank's own is already decoded
            total += own if i == rank else dequantize(got, x.numel(), cfg)
        return total, payload.numel()
    return _rs_ag(send, pg, cfg, fb, key, rank, p)


def _rs_ag(send: Tensor, pg: Any, cfg: CompressionConfig, fb: ErrorFeedback | None, key: str,
           rank: int, p: Plan) -> tuple[Tensor, int]:
    world, n = p.world, p.numel
    sizes = [e - s for s, e in p.bounds]
    parts = [quantize(send[s:e], cfg) for s, e in p.bounds]
    if fb is not None:
        fb.update(key, torch.cat([dequantize(q, m, cfg) for q, m in zip(parts, sizes)]), send)
    # reduce-scatter: rank j receives chunk j from everybody else (nothing is sent to oneself)
    in_splits = [0 if j == rank else parts[j].numel() for j in range(world)]
    mine = wire_bytes(sizes[rank], cfg)
    out_splits = [0 if i == rank else mine for i in range(world)]
    in_buf = torch.cat([parts[j] for j in range(world) if j != rank])
    out_buf = torch.empty(sum(out_splits), dtype=torch.uint8, device=send.device)
    pg.alltoall_base(out_buf, in_buf, out_splits, in_splits, AllToAllOptions()).wait()
    acc = torch.zeros(sizes[rank], dtype=torch.float32, device=send.device)
    offset = 0
    for i in range(world):  # rank order, so the owner's sum does not depend on arrival order
        if i == rank:
            got = parts[rank]
        else:
            got, offset = out_buf[offset:offset + mine], offset + mine
        acc += dequantize(got, sizes[rank], cfg)
    # all-gather the owners' re-quantized sums (padded to the largest payload)
    start, end = p.bounds[rank]
    agg_key = key + ErrorFeedback.AGG_SUFFIX
    if fb is not None:
        full = fb.residual(agg_key)
        if full is None or full.numel() != n:
            full = torch.zeros(n, dtype=torch.float32, device=send.device)
        acc = acc + full[start:end].to(acc.device)
    summed = quantize(acc, cfg)
    if fb is not None:
        full = full.clone()
        full[start:end] = acc - dequantize(summed, sizes[rank], cfg)
        fb.set_residual(agg_key, full)
    width = max(wire_bytes(m, cfg) for m in sizes)
    padded = torch.zeros(width, dtype=torch.uint8, device=send.device)
    padded[:summed.numel()] = summed
    gathered = _all_gather(pg, padded, world)
    out = torch.cat([dequantize(g[:wire_bytes(m, cfg)], m, cfg) for g, m in zip(gathered, sizes)])
    return out, in_buf.numel() + width


def compressed_gather(x: Tensor, pg: Any, cfg: CompressionConfig, *, feedback: ErrorFeedback | None = None,
                      key: str = "", seal: Callable[[Tensor], Tensor] | None = None,
                      unseal: Callable[[int, Tensor], Tensor | None] | None = None,
                      names: Sequence[str] | None = None,
                      sizes: Sequence[int] | None = None) -> tuple[list[Tensor] | None, int]:
    """Every rank's flat fp32 ``x`` as the others receive it (dequantized payloads, in rank order; this rank's
    own too, decoded from its own payload, so every rank holds the bit-identical set) -> (the P tensors, bytes
    this rank handed over). Lossy schemes compress with this rank's error feedback for ``key``; ``none`` moves
    fp32. ``seal`` appends a tag to this rank's payload and ``unseal(rank, payload)`` checks one (None: the
    whole result is None). A payload that does not decode raises :class:`PayloadError` naming its sender
    (``names[rank]``). ``sizes``: every rank's number of values when they differ (fp32 only)."""
    if x.dim() != 1:
        raise ValueError(f"compressed_gather takes a flat tensor, got shape {tuple(x.shape)}")
    x = x.float().contiguous()
    me, world = group_rank_size(pg)
    pg = _default(pg)
    uneven = sizes is not None and len(set(sizes)) > 1
    if uneven and cfg.lossy:
        raise ValueError("compressed_gather: pieces of different sizes go uncompressed only")
    if not cfg.lossy:
        sealed = seal is not None and unseal is not None
        sent = seal(x) if seal is not None and sealed else x
        extra = sent.numel() - x.numel()  # the tag's values
        gathered = _all_gather_v(pg, sent, [n + extra for n in sizes], me) if uneven and sizes is not None \
            else _all_gather(pg, sent, world)
        if unseal is None or not sealed:
            return gathered, 4 * x.numel()
        plain = []
        for i, got in enumerate(gathered):
            body = x if i == me else unseal(i, got)  # this rank's own piece needs no check
            if body is None:
                return None, sent.numel() * sent.element_size()
            plain.append(body)
        return plain, sent.numel() * sent.element_size()
    fb = feedback if (feedback is not None and cfg.error_feedback) else None
    send = _sender(x, cfg, fb, key)
    payload, own = quantize_own(send, cfg)
    if fb is not None:
        fb.update(key, own, send)
    sent = seal(payload) if seal is not None else payload
    out = []
    for i, got in enumerate(_all_gather(pg, sent, world)):
        if i == me:  # this rank's own piece came back as it was sent: its payload needs no check
            out.append(own)
            continue
        body = unseal(i, got) if unseal is not None else got
        if body is None:
            return None, sent.numel()
        try:
            out.append(dequantize(body, x.numel(), cfg))
        except PayloadError as exc:
            module, _, lane = key.rpartition("#")
            where = f", module {module}, lane {lane}" if module else (f", {key}" if key else "")
            raise PayloadError(f"{exc} (from {names[i] if names else f'cluster {i}'}{where})") from None
    return out, sent.numel()


def gathered_sum(x: Tensor, pg: Any, cfg: CompressionConfig, **kw: Any) -> tuple[Tensor | None, int]:
    """The SUM of sparse contributions: :func:`compressed_gather` (same arguments), then every piece added in
    rank order, so every rank holds the bit-identical sum (None when a piece's tag does not verify)."""
    pieces, nbytes = compressed_gather(x, pg, cfg, **kw)
    if pieces is None:
        return None, nbytes
    total = torch.zeros_like(pieces[0])
    for piece in pieces:
        total += piece
    return total, nbytes


def sent_bytes(method: str, numel: int, world: int, rank: int, cfg: CompressionConfig) -> int:
    """Bytes this rank puts on the wire for one unit's exchange among ``world`` clusters (the figure
    the link model and the `bytes` of `sync` events use): a ring all-reduce of fp32 sends 2(P−1)/P·4n; a
    gather, (P−1) copies of its payload; the compressed sum, what its plan moves (module docstring)."""
    if world <= 1:
        return 0
    if method == "gather" or cfg.sparse:  # a sparse SUM is a gather too
        return (world - 1) * wire_bytes(numel, cfg)
    p = plan(numel, world, cfg)
    if p.method == "all_reduce":
        return 2 * (world - 1) * 4 * numel // world
    if p.method == "all_gather":
        return (world - 1) * wire_bytes(numel, cfg)
    sizes = [wire_bytes(e - s, cfg) for s, e in p.bounds]
    return sum(b for j, b in enumerate(sizes) if j != rank) + (world - 1) * max(sizes)


class BackgroundReducer:
    """Runs ``compressed_sum`` (or ``compressed_gather``) on one background thread, in submission order (use one
    per process group)."""

    def __init__(self, name: str = "compressed-sum") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, x: Tensor, pg: Any, cfg: CompressionConfig, *, feedback: ErrorFeedback | None = None,
               key: str = "", method: str = "auto") -> Future[tuple[Tensor, int]]:
        """Start the sum of a snapshot of ``x`` (the caller may keep changing ``x``)."""
        snapshot = x.detach().clone()
        return self._pool.submit(compressed_sum, snapshot, pg, cfg, feedback=feedback, key=key, method=method)

    def submit_gather(self, x: Tensor, pg: Any, cfg: CompressionConfig, *, feedback: ErrorFeedback | None = None,
                      key: str = "", seal: Callable[[Tensor], Tensor] | None = None,
                      unseal: Callable[[int, Tensor], Tensor | None] | None = None,
                      names: Sequence[str] | None = None, summed: bool = False,
                      sizes: Sequence[int] | None = None) -> Future[Any]:
        """Start the gather of a snapshot of ``x`` (``summed``: :func:`gathered_sum`, the pieces added; ``sizes``:
        every rank's number of values when they differ)."""
        fn = gathered_sum if summed else compressed_gather
        kw = {"sizes": sizes} if sizes is not None else {}
        return self._pool.submit(fn, x.detach().clone(), pg, cfg, feedback=feedback, key=key, seal=seal,
                                 unseal=unseal, names=names, **kw)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
