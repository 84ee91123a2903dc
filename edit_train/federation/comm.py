"""`FederationComm`: every byte that crosses clusters goes through here.

Per sync: `form()` gets the quorum (leader ↔ Lighthouse, then broadcast inside the cluster) and configures
the lane groups; `all_gather()` exchanges the small per-cluster vectors over lane 0; `all_reduce_()`
reduces a module's weighted pseudo-gradient over the lanes; `vote()` is the commit decision (the sync
commits on all participants or on none); `send_bytes`/`recv_bytes` carry healing payloads.
Bytes are counted from the tensors handed to the collectives; the WAN model is applied on top.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

from edit_train.cluster.collectives import broadcast_bytes, shard_sum_
from edit_train.federation.compress import CompressionConfig, ErrorFeedback
from edit_train.federation.compressed_reduce import BackgroundReducer, handed_bytes, plan
from edit_train.federation.forming import Forming
from edit_train.federation.lanes import Lanes
from edit_train.federation.link import FederationError, FederationRefused, LinkClock, LinkModel, Pending
from edit_train.federation.quorum import Member, Membership, QuorumClient

log = logging.getLogger(__name__)


class _FutureWork:
    """A compressed reduction running on a lane's background thread, seen as a Work: wait() puts the sum
    in place."""

    def __init__(self, future: Any, out: Tensor) -> None:
        self._future, self._out = future, out

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def wait(self) -> None:
        total, _ = self._future.result()
        self._out.copy_(total)


def _sum_opts() -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    return opts


class FederationComm:
    """Cross-cluster collectives of one rank. With no Lighthouse (a lone cluster) every call is local."""

    def __init__(self, name: str, rank: int, size: int, shard_pg: Any, device: torch.device,
                 lighthouse: str | None = None, host: str = "127.0.0.1", chunks: int = 4,
                 link: LinkModel | None = None, quorum_timeout_s: float = 300.0,
                 collective_timeout_s: float = 60.0, compression: CompressionConfig | None = None) -> None:
        self.name, self.rank, self.size, self.shard_pg, self.device = name, rank, size, shard_pg, device
        self.host, self.chunks = host, chunks
        self.clock = LinkClock(link)
        self.quorum_timeout_s = quorum_timeout_s
        self.lanes = Lanes(host, collective_timeout_s)
        self.membership: Membership | None = None
        self.client: QuorumClient | None = None
        self.store: dist.TCPStore | None = None
        self.store_addr = ""
        self.federated = lighthouse is not None
        # pseudo-gradient payloads: fp32 SUM all-reduce, or bf16/int8/fp8 (compressed_reduce) with this rank's
        # error-feedback residuals; one background thread per lane keeps each lane's collectives in order
        self.compression = compression or CompressionConfig()
        self.compression.validate()
        self.feedback = ErrorFeedback()
        self._reducers: dict[int, BackgroundReducer] = {}
        self._forming: Forming | None = None  # a quorum being formed in the background (form_start)
        if self.federated and rank == 0:
            from edit_train.cluster.mesh import bound_store

            self.store = bound_store(host, 0, 1, True, datetime.timedelta(seconds=collective_timeout_s))
            self.store_addr = f"{host}:{self.store.port}"
            self.client = QuorumClient(lighthouse, name)  # type: ignore[arg-type]

    # ------------------------------------------------------------ accounting
    @property
    def link(self) -> LinkModel:
        return self.clock.link

    @property
    def bytes_sent(self) -> int:
        return self.clock.bytes_sent

    @property
    def blocked_s(self) -> float:
        return self.clock.blocked_s

    @property
    def num_groups(self) -> int:
        return len(self.membership.members) if self.membership is not None else 1

    @property
    def position(self) -> int:
        return self.membership.me if self.membership is not None else 0

    @property
    def members(self) -> list[Member]:
        return self.membership.members if self.membership is not None else []

    @property
    def active(self) -> bool:
        return self.membership is not None and len(self.membership.members) > 1

    def partition(self, seconds: float) -> None:
        if self.client is not None:
            self.client.partition(seconds)

    # ---------------------------------------------------------------- quorum
    def form(self, sync: int, data: dict[str, Any]) -> Membership | None:
        """This sync's quorum, the same on every rank of the cluster; None when the cluster is cut off
        (it keeps training and tries again at its next sync). Blocks for at most the Lighthouse's grace
        window plus the time the others need to reach their sync point."""
        self.form_start(sync, data)
        return self.form_poll(block=True)[1]

    def form_start(self, sync: int, data: dict[str, Any]) -> None:
        """Start forming this sync's quorum on background threads (`form_poll` collects it)."""
        assert self._forming is None, "a quorum is already being formed"
        self.lanes.abort()
        self.membership = None
        if not self.federated:
            self.membership = Membership(0, "solo", [Member(self.name, sync, self.size, "", data)], 0)
            return
        self._forming = Forming(self, sync, data)

    @property
    def forming(self) -> bool:
        return self._forming is not None

    def form_poll(self, block: bool = False) -> tuple[bool, Membership | None]:
        """(done, membership). Not blocking unless `block`; every rank of the cluster gets the same answer."""
        if self._forming is None:
            return True, self.membership
        try:
            done = self._forming.poll(block)
        except FederationError:
            self._forming = None
            raise
        if done:
            self.membership, self._forming = self._forming.membership, None
        return done, self.membership

    def ask(self, sync: int, data: dict[str, Any]) -> dict[str, Any]:
        """The leader's Lighthouse request (a background thread): {"ok", "m" | "error"} as JSON."""
        assert self.client is not None
        try:
            m = self.client.request(sync, self.size, self.store_addr, data, self.quorum_timeout_s)
            return {"ok": True, "m": m.to_json() if m is not None else None}
        except FederationError as exc:  # the leader's answer reaches its cluster as JSON: keep the kind
            return {"ok": False, "error": str(exc), "refused": isinstance(exc, FederationRefused)}

    def connect(self, membership: Membership) -> bool:
        """This rank's lanes for `membership` (a background thread); False when a peer did not connect."""
        try:
            self.lanes.configure(membership, self.rank, self.size, self.chunks)
            return True
        except FederationError as exc:
            log.warning("cluster %s: %s", self.name, exc)
            return False

    def agree(self, ok: bool) -> bool:
        """Every rank of the cluster takes the same branch."""
        if self.shard_pg is None or self.size <= 1:
            return ok
        t = torch.tensor([1.0 if ok else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.shard_pg)
        return bool(t.item() > 0)

    def abort(self) -> None:
        """Drop the current quorum's groups (after a failed collective)."""
        self.lanes.abort()

    def close(self) -> None:
        for r in self._reducers.values():
            r.shutdown(wait=False)
        self._reducers.clear()
        self.lanes.abort()
        if self.client is not None:
            self.client.close()

    # ------------------------------------------------------- small exchange
    def all_gather_async(self, vec: Tensor, what: str = "norm exchange") -> tuple[Pending, list[Tensor]]:
        """[members, n] rows of a small float64 vector (lane 0 among the leaders, then inside the
        cluster). Every rank of the cluster must wait() on it at the same point."""
        vec = vec.detach().to("cpu", torch.float64).contiguous()
        n = len(self.members) if self.active else 1
        out = [torch.zeros_like(vec) for _ in range(n)]
        if not self.active:
            out[0].copy_(vec)
            return Pending(self.clock, [], 0.0), out
        works: list[Any] = []
        ready_at = 0.0
        if self.rank == 0:
            ready_at = self.clock.account(vec.numel() * vec.element_size())
            works = [self.lanes.groups[0].allgather([out], [vec], AllgatherOptions())]

        def share(ok: bool) -> bool:
            if self.size > 1:  # the leader's rows (and whether it got them) to the cluster
                flat = torch.zeros(n + 1, vec.numel(), dtype=vec.dtype)
                if self.rank == 0:
                    flat[0, 0] = 1.0 if ok else 0.0
                    if ok:
                        flat[1:] = torch.stack(out)
                flat = flat.to(self.device)
                dist.broadcast(flat, src=dist.get_global_rank(self.shard_pg, 0), group=self.shard_pg)
                flat = flat.cpu()
                ok = bool(flat[0, 0] > 0)
                for i in range(n):
                    out[i].copy_(flat[i + 1])
            return ok

        return Pending(self.clock, works, ready_at, settle=share, what=what), out

    def all_gather(self, vec: Tensor) -> Tensor:
        pending, out = self.all_gather_async(vec)
        pending.wait()
        return torch.stack(out)

    def vote(self, ok: bool) -> bool:
        """should_commit: True only if every rank of every participant says ok (and nobody is lost)."""
        ok = self.agree(ok)
        if not self.active:
            return ok
        result = 0.0
        try:
            if self.rank == 0:
                t = torch.tensor([1.0 if ok else 0.0])
                opts = AllreduceOptions()
                opts.reduceOp = ReduceOp.MIN
                Pending(self.clock, [self.lanes.groups[0].allreduce([t], opts)], self.clock.account(4),
                        what="commit vote").wait()
                result = float(t.item())
        except FederationError as exc:
            log.warning("cluster %s: %s", self.name, exc)
            result = 0.0
        if self.size > 1:
            r = torch.tensor([result], device=self.device)
            dist.broadcast(r, src=dist.get_global_rank(self.shard_pg, 0), group=self.shard_pg)
            result = float(r.item())
        return result > 0

    # ------------------------------------------------------- module reduce
    def _lane_sum(self, lane: int, flat: Tensor, key: str) -> tuple[Any, int]:
        """Start the SUM of `flat` (in place) over one lane: (work, bytes handed to the collectives)."""
        pg = self.lanes.groups[lane]
        if not key or not self.compression.lossy:
            return pg.allreduce([flat], _sum_opts()), flat.numel() * flat.element_size()
        reducer = self._reducers.setdefault(lane, BackgroundReducer(f"edit-train-lane{lane}"))
        nbytes = handed_bytes(plan(flat.numel(), len(self.members), self.compression), self.position,
                              self.compression)
        future = reducer.submit(flat, pg, self.compression, feedback=self.feedback, key=f"{key}#{lane}")
        return _FutureWork(future, flat), nbytes

    def all_reduce_(self, tensors: list[Tensor], async_op: bool = False,
                    params: list[Tensor] | None = None, key: str = "") -> Pending:
        """In-place SUM over the participants of a module's (already weighted) local shards."""
        if not self.active or not tensors:
            return Pending(self.clock, [], 0.0)
        assert self.membership is not None
        if self.membership.paired or self.size == 1 and all(m.size == 1 for m in self.members):
            pending = self._paired(tensors, key)
        else:
            pending = self._chunked(tensors, params, key)
        if not async_op:
            pending.wait()
        return pending

    def _paired(self, tensors: list[Tensor], key: str) -> Pending:
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
        work, nbytes = self._lane_sum(self.rank, flat, key)
        ready_at = self.clock.account(nbytes)

        def unflatten(ok: bool) -> bool:
            if not self.agree(ok):
                return False
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n
            return True

        return Pending(self.clock, [work], ready_at, settle=unflatten, what="pseudo-gradient reduction")

    def _full(self, local: Tensor, param: Tensor | None) -> Tensor:
        if param is not None and hasattr(param, "device_mesh"):
            from torch.distributed.tensor import DTensor

            dt = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                    stride=param.stride(), run_check=False)
            return dt.full_tensor()
        return local

    def _chunked(self, tensors: list[Tensor], params: list[Tensor] | None, key: str) -> Pending:
        params = params if params is not None else [None] * len(tensors)  # type: ignore[list-item]
        fulls = [self._full(t, p) for t, p in zip(tensors, params)]
        flat = torch.cat([f.detach().reshape(-1).to("cpu", torch.float32) for f in fulls])
        pieces = list(torch.tensor_split(flat, self.chunks))
        mine = [j for j in range(self.chunks) if j % self.size == self.rank]
        works, nbytes = [], 0
        for j in mine:
            work, n = self._lane_sum(j, pieces[j], key)
            nbytes += n
            works.append(work)
        ready_at = self.clock.account(nbytes) if mine else 0.0

        def assemble(ok: bool) -> bool:
            if not self.agree(ok):
                return False
            full = torch.zeros_like(flat)
            bounds = [0]
            for p in pieces:
                bounds.append(bounds[-1] + p.numel())
            for j in mine:
                full[bounds[j]:bounds[j + 1]] = pieces[j]
            full = full.to(self.device)
            shard_sum_(full, self.shard_pg, self.size)
            offset = 0
            for t, f in zip(tensors, fulls):
                n = f.numel()
                whole = full[offset:offset + n].view(f.shape)
                offset += n
                if whole.shape != t.shape:  # FSDP2 Shard(0): this rank's torch.chunk of dim 0
                    whole = torch.chunk(whole, self.size, dim=0)[self.rank]
                t.copy_(whole.to(t.dtype))
            return True

        return Pending(self.clock, works, ready_at, settle=assemble, what="pseudo-gradient reduction")

    # --------------------------------------------------------------- healing
    def send_bytes(self, payload: bytes, dst: int) -> None:
        """Leader to leader over lane 0 (length first, then the bytes)."""
        pg = self.lanes.groups[0]
        n = torch.tensor([len(payload)], dtype=torch.int64)
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        Pending(self.clock, [pg.send([n], dst, 11)], self.clock.account(8), what="heal header").wait()
        Pending(self.clock, [pg.send([buf], dst, 12)], self.clock.account(len(payload)), what="heal payload").wait()

    def recv_bytes(self, src: int) -> bytes:
        pg = self.lanes.groups[0]
        n = torch.zeros(1, dtype=torch.int64)
        Pending(self.clock, [pg.recv([n], src, 11)], 0.0, what="heal header").wait()
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        Pending(self.clock, [pg.recv([buf], src, 12)], 0.0, what="heal payload").wait()
        return bytes(buf.numpy().tobytes())

    def share_bytes(self, payload: bytes | None) -> bytes:
        """Leader's bytes to every rank of the cluster."""
        return broadcast_bytes(payload, self.shard_pg, self.size, self.device)
