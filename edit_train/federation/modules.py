"""Moving one unit's tensors across the quorum's lanes: a SUM (in place) or a gather of every
cluster's contribution, in fp32 or compressed with this rank's error feedback.

Layout: when every cluster has the same size, lane r carries rank r's own FSDP shard (paired; no
resharding); otherwise the unit's full flat Δ is cut into the federation's `chunks` pieces and piece j
travels on lane j, owned by the cluster's rank `j % size` (chunked), and the pieces are put back together
over the cluster's fast links. A gathered piece carries its tag (`seal.py`): a piece that does not verify
fails the whole move on every rank of the cluster (the sync is rolled back; nothing forged is judged).

Rows (expert-aware sync): a move may carry only some dim-0 rows of each whole parameter — the same ones from
every cluster for a SUM, each cluster's own for a gather (every cluster knows all of them). Only
those elements go on the wire (a gather of unequal pieces is an all-to-all of each one's own); the rest comes
back as 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

from edit_train.codec.dense import CompressionConfig, ErrorFeedback
from edit_train.federation.compressed_reduce import BackgroundReducer, sent_bytes
from edit_train.federation.lanes import Lanes
from edit_train.federation.link import LinkClock
from edit_train.federation.pending import Pending
from edit_train.federation.seal import TAG, Seal
from edit_train.local_sgd.evidence import shard_range
from edit_train.local_sgd.moves import wire
from edit_train.local_sgd.protocols import ClusterGroup, Contributions, Quorum



class _FutureWork:
    """A compressed reduction running on a lane's background thread, seen as a Work: wait() puts the sum
    in place (a gather's pieces are read from the future)."""

    def __init__(self, future: Future[Any], out: Tensor | None) -> None:
        self._future, self._out = future, out

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def wait(self) -> None:
        got, _ = self._future.result()
        if self._out is not None and got is not None:  # None: a piece did not verify (settle says so)
            self._out.copy_(got)


def _sum_opts() -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    return opts


class _Done:
    """A lane with nothing to move (every cluster's piece is empty)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def _kept(c: ClusterGroup, fulls: list[Tensor], likes: list[Tensor | None], rows: list[Tensor | None],
          paired: bool) -> Tensor | None:
    """bool over the flat of `fulls` (this rank's shards when paired, the whole tensors when chunked): the elements
    in the dim-0 `rows` of each whole parameter (None for a tensor: all of it; None overall: everything)."""
    if all(r is None for r in rows):
        return None
    parts = []
    for t, like, r in zip(fulls, likes, rows):
        if r is None or t.dim() == 0:
            parts.append(torch.ones(t.numel(), dtype=torch.bool))
            continue
        if paired and like is not None:
            r = r[slice(*shard_range(like, c.rank, c.size))]
        parts.append(r.repeat_interleave(t.numel() // t.shape[0]) if t.shape[0] else r)
    return torch.cat(parts)


def _bounds(total: int, chunks: int) -> list[int]:
    """Where each of `chunks` lane pieces of a flat tensor of `total` values starts (and the end)."""
    out = [0]
    for piece in torch.tensor_split(torch.empty(total, device="meta"), chunks):
        out.append(out[-1] + piece.numel())
    return out


def _unflatten(c: ClusterGroup, row: Tensor, tensors: list[Tensor], shapes: list[Any], paired: bool) -> list[Tensor]:
    """A unit's flat row cut back into tensors shaped like `tensors`: as it is (paired: the row is this rank's
    shards) or as this rank's shard of each whole tensor (chunked: the row is the whole unit)."""
    parts, offset = [], 0
    for t, shape in zip(tensors, shapes):
        n = math.prod(shape)
        piece = row[offset:offset + n].view(shape)
        offset += n
        parts.append(piece.to(t.dtype) if paired else c.shard(piece, t).to(t.dtype))
    return parts


@dataclass
class ModuleMover:
    cluster: ClusterGroup
    lanes: Lanes
    clock: LinkClock
    compression: CompressionConfig
    feedback: ErrorFeedback
    chunks: int
    reducers: dict[int, BackgroundReducer] = field(default_factory=dict)

    def close(self) -> None:
        for r in self.reducers.values():
            r.shutdown(wait=False)
        self.reducers.clear()

    def _lane(self, q: Quorum, seal: Seal, context: str, lane: int, flat: Tensor, key: str,
              gather: bool, sizes: list[int] | None = None) -> tuple[Any, Callable[[], list[Tensor] | None], int]:
        """Start a SUM (in place) or a gather of `flat` over one lane: (work, its result — the sum, or every
        cluster's piece in quorum order, None when a piece's tag does not verify —, bytes this rank puts
        on the wire). Pseudo-gradients (`key` given) go compressed under a lossy scheme; a sparse one is
        gathered even for a SUM (every receiver adds the authenticated pieces in quorum order). `sizes`: every
        cluster's piece on this lane when they differ (a gather of rows)."""
        pg, world, me = self.lanes.groups[lane], len(q.members), q.me
        if sizes is not None and not any(sizes):  # rows: nobody has anything on this lane
            return _Done(), lambda: [flat[:0].clone() for _ in range(world)], 0
        lossy = bool(key) and self.compression.lossy
        cfg = self.compression if lossy else CompressionConfig()
        if sizes is not None and lossy:
            raise ValueError("rows of a contribution cannot go compressed (error feedback needs every row); "
                             "use sync.compression=none with algo.rule.verified.expert_min_tokens")
        on_wire = wire("gathered" if gather else "sum", cfg.sparse)  # local_sgd/moves.py: the one decision
        summed = not gather and on_wire == "gather"
        nbytes = sent_bytes(on_wire, flat.numel(), world, me, cfg)
        ctx = f"{context}/lane{lane}"
        if not gather and not summed:
            if not lossy:
                return pg.allreduce([flat], _sum_opts()), lambda: [flat], nbytes
            reducer = self.reducers.setdefault(lane, BackgroundReducer(f"edit-train-lane{lane}"))
            future = reducer.submit(flat, pg, cfg, feedback=self.feedback.pinned(), key=f"{key}#{lane}")
            return _FutureWork(future, flat), lambda: [flat], nbytes
        nbytes += (world - 1) * TAG  # every piece is followed by its tag

        # on the lane's own thread (in order per lane): tagging, the gather and checking the others' tags
        # overlap the training thread's compute (hashlib releases the GIL), lossless or compressed alike
        reducer = self.reducers.setdefault(lane, BackgroundReducer(f"edit-train-lane{lane}"))
        future = reducer.submit_gather(flat, pg, cfg, feedback=self.feedback.pinned(), key=f"{key}#{lane}",
                                       seal=lambda payload: seal.wrap(payload, ctx, me),
                                       unseal=lambda i, got: seal.unwrap(got, ctx, i),
                                       names=[m.name for m in q.members], summed=summed, sizes=sizes)
        if summed:  # the sum lands in `flat` (wait); None: a piece did not verify
            return _FutureWork(future, flat), lambda: None if future.result()[0] is None else [flat], nbytes
        return _FutureWork(future, None), lambda: future.result()[0], nbytes

    @torch.no_grad()
    def take_unsent(self, q: Quorum, tensors: list[Tensor], params: list[Tensor], key: str) -> list[Tensor] | None:
        """This rank's error-feedback residual of unit `key` (what its last gather did not send), laid out like
        `tensors` (its local shards), and forgotten; None when there is none. A collective inside the cluster
        when the unit travels in chunks (every rank calls it for the same unit)."""
        c = self.cluster
        if q.paired:
            flat = self.feedback.residual(f"{key}#{c.rank}")
            self.feedback.clear(f"{key}#{c.rank}")
            return None if flat is None else _unflatten(c, flat, tensors, [t.shape for t in tensors], True)
        shapes = [tuple(p.shape) for p in params]  # a DTensor reports the whole shape
        bounds = _bounds(sum(math.prod(sh) for sh in shapes), self.chunks)
        flat, found = torch.zeros(bounds[-1]), False
        for j in range(c.rank, self.chunks, c.size):  # this rank's lanes, as in `move`
            r = self.feedback.residual(f"{key}#{j}")
            self.feedback.clear(f"{key}#{j}")
            if r is not None:
                flat[bounds[j]:bounds[j + 1]], found = r, True
        if c.agree(not found):  # nobody has a residual
            return None
        return _unflatten(c, c.sum_(flat.to(c.device)).cpu(), tensors, shapes, False)

    def move(self, q: Quorum, seal: Seal, tensors: list[Tensor], params: list[Tensor] | None, key: str,
             gather: bool, rows: list[list[Tensor | None]] | None = None) -> Pending[Any]:
        """The SUM of `tensors` (in place) over the quorum, or every cluster's contribution. `rows`: the
        dim-0 rows of each whole parameter that go — one list for a SUM, one per cluster for a gather."""
        c, n = self.cluster, len(q.members)
        context = seal.context(f"module/{key}")
        likes: list[Tensor | None] = list(params) if params is not None else [None] * len(tensors)
        fulls = tensors if q.paired else [c.full(t, p) for t, p in zip(tensors, likes)]
        flat = torch.cat([f.detach().reshape(-1).to("cpu", torch.float32) for f in fulls])
        masks = [_kept(c, fulls, likes, r, q.paired) for r in rows] if rows is not None else []
        if all(m is None for m in masks):
            masks = []
        masks = [m if m is not None else torch.ones(flat.numel(), dtype=torch.bool) for m in masks]
        lens = [int(m.sum()) for m in masks] if masks else [flat.numel()] * (n if gather else 1)
        send = flat[masks[q.me if gather else 0]] if masks else flat
        pieces = [send] if q.paired else list(torch.tensor_split(send, self.chunks))
        mine = [c.rank] if q.paired else [j for j in range(self.chunks) if j % c.size == c.rank]

        def sizes(j: int) -> list[int] | None:  # every cluster's piece on lane j, when a gather's differ
            if not (gather and masks and len(set(lens)) > 1):
                return None
            return lens if q.paired else [(b := _bounds(m, self.chunks))[j + 1] - b[j] for m in lens]

        started = [self._lane(q, seal, context, j, pieces[0] if q.paired else pieces[j], key, gather, sizes(j))
                   for j in mine]
        ready_at = self.clock.account(sum(b for _, _, b in started)) if started else 0.0
        out: list[list[Tensor]] = []
        whole: list[Tensor] = []  # chunked: every cluster's whole flat Δ (the same on every rank)
        local: list[Tensor] = []  # paired: every cluster's flat shard as this rank holds it

        def settle(ok: bool) -> bool | str:
            got_rows = [got() for _, got, _ in started] if ok else []
            verified = all(r is not None for r in got_rows)
            if not c.agree(ok and verified):
                if ok and not verified:
                    return f"a contribution to module {key} does not verify (another key, or altered on the way)"
                return False
            k = len(lens)
            if q.paired:
                compact: list[Tensor] | Tensor = got_rows[0]  # type: ignore[assignment]
            else:
                compact = torch.zeros(k, max(lens))
                for j, got in zip(mine, got_rows):
                    for i, t in enumerate(got or []):
                        b = _bounds(lens[i], self.chunks)
                        compact[i, b[j]:b[j + 1]] = t
                compact = c.sum_(compact.to(c.device))
            if masks:
                full = torch.zeros(k, flat.numel())
                for i in range(k):
                    full[i][masks[i]] = compact[i][:lens[i]].cpu()
            else:
                full = torch.stack(compact) if q.paired else compact  # type: ignore[arg-type]
            (local if q.paired else whole).append(full if q.paired else full.cpu())
            out.extend(_unflatten(c, row, tensors, [f.shape for f in fulls], q.paired) for row in full)
            if not gather:
                for t, part in zip(tensors, out[0]):
                    t.copy_(part)
            return True

        result = (lambda: Contributions(out, whole[0] if whole else None, local[0] if local else None)) \
            if gather else None
        return Pending(self.clock, [w for w, _, _ in started], ready_at, settle=settle,
                       what=f"pseudo-gradient {'gather' if gather else 'reduction'}", result=result)
