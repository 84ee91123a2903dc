"""`LaneTransport`: the core's `Transport` across clusters. Every byte that crosses clusters goes through here.

Per sync: `form_start`/`form_poll` get the quorum (the leader asks a quorum service — torchft's Lighthouse,
or `federation.inproc` in one process — and the answer is broadcast inside the cluster), then every rank
configures its lanes (`lanes.py`); `all_gather` exchanges small per-cluster vectors over lane 0; `reduce_`
sums a unit's weighted pseudo-gradient over the lanes (fp32 SUM, or a compressed payload with error
feedback, `compressed_reduce.py`); `vote` is the commit decision; `send_bytes`/`recv_bytes` carry heal
payloads. Bytes are counted from the tensors handed to the collectives; the simulated WAN link (`link.py`)
delays their delivery.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions

from edit_train.codec import sparse
from edit_train.codec.dense import CompressionConfig, ErrorFeedback
from edit_train.federation import auth
from edit_train.federation.modules import ModuleMover
from edit_train.federation.seal import TAG, Seal
from edit_train.federation.forming import Forming
from edit_train.federation.lanes import Lanes, SilentStores
from edit_train.federation.link import LinkClock, LinkModel
from edit_train.federation.pending import Pending
from edit_train.local_sgd.errors import FederationError, FederationRefused, HealError
from edit_train.local_sgd.protocols import ClusterGroup, Contributions, Quorum

if TYPE_CHECKING:
    from edit_train.federation.signed import Credentials

log = logging.getLogger(__name__)
T = TypeVar("T")


class QuorumService(Protocol):
    """Where a cluster's leader asks for each sync's quorum (torchft's Lighthouse client, or the in-process
    hub's)."""

    def request(self, sync: int, size: int, store: str, data: dict[str, Any], timeout_s: float) -> Quorum | None: ...

    def partition(self, seconds: float) -> None: ...

    def close(self) -> None: ...


class LaneTransport:
    """Cross-cluster collectives of one rank. Not `federated` (a lone cluster): every call is local."""

    def __init__(self, name: str, cluster: ClusterGroup, lanes: Lanes, federated: bool,
                 service: QuorumService | None = None, store_addr: str = "", chunks: int = 4,
                 link: LinkModel | None = None, quorum_timeout_s: float = 300.0,
                 compression: CompressionConfig | None = None, store: Any = None,
                 key: bytes = auth.INSECURE, connect_timeout_s: float = 60.0) -> None:
        self.name, self.cluster, self.lanes, self.federated = name, cluster, lanes, federated
        self.key = key  # authenticates what the lanes carry (tags bound to the quorum's nonce)
        self.store = store  # the leader's store the lanes rendezvous in (kept alive with the transport)
        self.service, self.store_addr, self.chunks = service, store_addr, chunks
        self.clock = LinkClock(link)
        self.quorum_timeout_s = quorum_timeout_s
        self.connect_timeout_s = connect_timeout_s  # connecting a quorum's lanes ends by then, whatever the peers do
        self._quorum: Quorum | None = None
        self._forming: Forming | None = None  # a quorum being formed in the background
        # pseudo-gradient payloads: fp32 SUM all-reduce, or bf16/int8/fp8 (compressed_reduce) with this rank's
        # error-feedback residuals; one background thread per lane keeps each lane's collectives in order
        self.compression = compression or CompressionConfig()
        self.compression.validate()
        if self.compression.sparse and federated:  # the codec's kernels load now, not in the first sync
            sparse.warm(self.compression.format, cluster.device)
        self.feedback = ErrorFeedback(self.compression.error_feedback_decay)
        self.mover = ModuleMover(cluster, lanes, self.clock, self.compression, self.feedback, chunks)
        self._seal = Seal(key, "")  # the current quorum's tags (its nonce once issued)
        self.silent = SilentStores(name)  # members whose lanes' store never answered: left out for a while
        self._mark_sends: list[Any] = []  # the arrival marks of the last small exchange, in flight
        self._marked_at = 0.0  # when this leader marked its arrival at the last small exchange (monotonic)

    # ------------------------------------------------------------ accounting
    @property
    def bytes_sent(self) -> int:
        return self.clock.bytes_sent

    @property
    def blocked_s(self) -> float:
        return self.clock.blocked_s

    def waiting(self) -> AbstractContextManager[None]:
        return self.clock.waiting()

    def carry(self, bytes_sent: int, blocked_s: float) -> None:
        self.clock.bytes_sent, self.clock.blocked_s = bytes_sent, blocked_s

    @property
    def quorum(self) -> Quorum | None:
        return self._quorum

    @property
    def exact(self) -> bool:
        return not self.compression.lossy

    @property
    def payload_error(self) -> float:
        return self.compression.payload_error

    @property
    def gathers_sums(self) -> bool:
        """A SUM of sparse payloads is a gather summed by every receiver: gathering costs the same."""
        return self.compression.sparse

    @property
    def _shared(self) -> bool:
        return self._quorum is not None and self._quorum.shared

    def partition(self, seconds: float) -> None:
        if self.service is not None:
            self.service.partition(seconds)

    # ---------------------------------------------------------------- quorum
    def form_start(self, sync: int, data: dict[str, Any], vet: Callable[[Quorum], Quorum] | None = None) -> None:
        """Start forming this sync's quorum on background threads (`form_poll` collects it); the leader passes
        the issued quorum through `vet` (members left out, or FederationRefused) before any lane connects."""
        assert self._forming is None, "a quorum is already being formed"
        self.lanes.abort()
        self._quorum = None
        if not self.federated:
            self._quorum = Quorum.solo(self.name, sync, self.cluster.size, data)
            return
        ask = (lambda: self._ask(sync, data, vet)) if self.cluster.rank == 0 else None
        # every wait has an end: the gate answers within quorum_timeout_s (+ its own connect), lanes connect
        # within connect_timeout_s; past those, the sync is skipped with a line that says what never came
        self._forming = Forming(self.cluster, self.clock, ask, self._connect, self.lanes.abort,
                                deadlines=(self.quorum_timeout_s + 15.0, self.connect_timeout_s),
                                label=f"cluster {self.name}, sync {sync}")

    @property
    def forming(self) -> bool:
        return self._forming is not None

    def form_poll(self, block: bool = False) -> tuple[bool, Quorum | None]:
        """(done, quorum). Not blocking unless `block`; every rank of the cluster gets the same answer."""
        if self._forming is None:
            return True, self._quorum
        try:
            done = self._forming.poll(block)
        except FederationError:
            self._forming = None
            raise
        if done:
            self._quorum, self._forming = self._forming.quorum, None
            if self._quorum is not None:
                self._seal = Seal(self.key, self._quorum.nonce)
        return done, self._quorum

    def _ask(self, sync: int, data: dict[str, Any], vet: Callable[[Quorum], Quorum] | None) -> dict[str, Any]:
        """The leader's quorum request (a background thread): {"ok", "m" | "error"} as JSON."""
        assert self.service is not None
        try:
            q = self.service.request(sync, self.cluster.size, self.store_addr, data, self.quorum_timeout_s)
            if q is not None and vet is not None:
                q = vet(q)
            q = self.silent.vet(q) if q is not None else None
            return {"ok": True, "m": q.to_json() if q is not None else None}
        except FederationError as exc:  # the leader's answer reaches its cluster as JSON: keep the kind
            return {"ok": False, "error": str(exc), "refused": isinstance(exc, FederationRefused)}

    def _connect(self, quorum: Quorum) -> bool:
        """This rank's lanes for `quorum` (a background thread); False when a peer did not connect."""
        try:
            self.lanes.configure(quorum, self.cluster.rank, self.cluster.size, self.chunks)
            return True
        except FederationError as exc:
            log.warning("cluster %s: %s", self.name, exc)
            if self.cluster.rank == 0:
                self.silent.blame(quorum, exc)
            return False

    def abort(self) -> None:
        """Drop the current quorum's groups (after a failed collective)."""
        self.lanes.abort()

    def close(self) -> None:
        self.mover.close()
        self.lanes.abort()
        if self.service is not None:
            self.service.close()

    # ------------------------------------------------------- small exchanges
    def all_gather(self, vec: Tensor, what: str = "norm exchange") -> Pending[Tensor]:
        """[members, n] rows of a small float64 vector (lane 0 among the leaders, then inside the cluster)."""
        return self._gather(vec, what, lambda rows: rows)

    def vote(self, ok: bool) -> Pending[Tensor]:
        """Every cluster's commit vote, [members] (1.0: every rank of it says ok; raises when one is lost)."""
        ok = self.cluster.agree(ok)
        return self._gather(torch.tensor([1.0 if ok else 0.0]), "commit vote", lambda rows: rows.flatten())

    def _gather(self, vec: Tensor, what: str, result: Callable[[Tensor], T]) -> Pending[T]:
        vec = vec.detach().to("cpu", torch.float64).contiguous()
        q = self._quorum
        n = len(q.members) if q is not None and q.shared else 1
        out = [torch.zeros_like(vec) for _ in range(n)]
        if n == 1:
            out[0].copy_(vec)
            return Pending(self.clock, [], 0.0, result=lambda: result(torch.stack(out)))
        assert q is not None
        works: list[Any] = []
        ready_at = 0.0
        c = self.cluster
        context = self._seal.context(what)
        sealed = [torch.empty(vec.numel() + TAG // 8, dtype=torch.float64) for _ in range(n)]
        marks: dict[int, Any] = {}
        if c.rank == 0:  # a ring all-gather: this leader's row (and its tag) goes to each of the n − 1 others
            ready_at = self.clock.account((n - 1) * (vec.numel() * vec.element_size() + TAG))
            marks = self._mark(q)
            works = [self.lanes.groups[0].allgather([sealed], [self._seal.wrap(vec, context, q.me)],
                                                    AllgatherOptions())]

        def share(ok: bool) -> bool | str:
            why = ""
            if c.rank == 0 and ok:
                for i, got in enumerate(sealed):
                    row = self._seal.unwrap(got, context, i)
                    if row is None:
                        why = f"the row of cluster {q.members[i].name} does not verify (another key, or altered)"
                        ok = False
                        break
                    out[i].copy_(row)
            if c.size > 1:  # the leader's rows (and whether it got them, verified) to the cluster
                flat = torch.zeros(n + 1, vec.numel(), dtype=vec.dtype)
                if c.rank == 0:
                    flat[0, 0] = 1.0 if ok else 0.0
                    if ok:
                        flat[1:] = torch.stack(out)
                flat = c.broadcast_(flat.to(c.device)).cpu()
                ok = bool(flat[0, 0] > 0)
                for i in range(n):
                    out[i].copy_(flat[i + 1])
            return True if ok else (why or False)

        return Pending(self.clock, works, ready_at, settle=share, what=what, result=lambda: result(torch.stack(out)),
                       blame=lambda error: self._stalled(q, marks, error, what))

    def _mark(self, q: Quorum) -> dict[int, Any]:
        """The leader's arrival mark: one byte to every other leader as it enters a small exchange, and a receive of
        each of theirs (gloo matches sends and receives per peer and tag, in order). Costs no round trip: nothing
        waits for them unless the exchange fails (`_stalled`)."""
        pg, marks = self.lanes.groups[0], {}
        self._marked_at = time.monotonic()
        self._mark_sends = [pg.send([torch.ones(1, dtype=torch.uint8)], j, MARK_TAG)
                            for j in range(len(q.members)) if j != q.me]
        for j in range(len(q.members)):
            if j != q.me:
                buf = torch.zeros(1, dtype=torch.uint8)
                marks[j] = (pg.recv([buf], j, MARK_TAG), buf)
        return marks

    def _stalled(self, q: Quorum, marks: dict[int, Any], error: BaseException, what: str) -> str:
        """After exchange `what` of `q` failed with `error`: the members that never came to it — their mark did not
        arrive while this cluster waited — named and left out of the next quorums (`SilentStores.stalled`), when
        that is what failed it: the wait ran out (a timeout), or this cluster waited half the collective deadline
        and some other member came (that one gave up on them first). A failure that comes sooner (a member's
        connection closed: a crash, wherever it happened) blames nobody."""
        if not marks:
            return ""
        missing = [j for j, (w, buf) in marks.items() if not _arrived(w, buf)]
        text = str(error).lower()
        timed_out = "timed out" in text or "timeout" in text
        waited = time.monotonic() - self._marked_at >= 0.5 * self.connect_timeout_s
        if not missing or not (timed_out or (waited and len(missing) < len(marks))):
            return ""
        return self.silent.stalled(q, missing, what)

    def take_stalled(self) -> list[str]:
        """The members this cluster blamed for a stalled exchange since the last call (for the `sync_aborted` event)."""
        return self.silent.take_blamed()

    # ------------------------------------------------------- unit reduce / gather
    def reduce_(self, tensors: list[Tensor], params: list[Tensor] | None = None, key: str = "",
                rows: list[Tensor | None] | None = None) -> Pending[None]:
        """In-place SUM over the clusters of a unit's (already weighted) local shards (`rows`: only these
        dim-0 rows of each whole parameter are sent; the others come back as 0)."""
        if not self._shared or not tensors:
            return Pending(self.clock, [], 0.0)
        assert self._quorum is not None
        return self.mover.move(self._quorum, self._seal, tensors, params, key, gather=False,
                               rows=None if rows is None else [rows])

    def gather(self, tensors: list[Tensor], params: list[Tensor] | None = None, key: str = "",
               rows: list[list[Tensor | None]] | None = None) -> Pending[Contributions]:
        """Every cluster's contribution for a unit, as this rank holds it (`Contributions.parts`
        [cluster][tensor], shaped like `tensors`): exactly what each one sent — after compression, its
        dequantized payload, this cluster's own included, so every cluster judges and sums bit-identical
        tensors; each piece authenticated (`seal.py`). The chunked layout also hands out the whole flat Δ.
        `rows[i]`: the dim-0 rows cluster i sends (the rest of its contribution arrives as 0)."""
        if not self._shared:
            return Pending(self.clock, [], 0.0, result=lambda: Contributions([[t.detach().clone() for t in tensors]]))
        assert self._quorum is not None
        return self.mover.move(self._quorum, self._seal, tensors, params, key, gather=True, rows=rows)

    def take_unsent(self, tensors: list[Tensor], params: list[Tensor], key: str) -> list[Tensor] | None:
        """`sync.unsent=keep`: what this cluster's last sparse send of unit `key` left out (its error-feedback
        residual, in the units it was sent in), shaped like `tensors`, and forgotten here: the caller keeps it
        in its own parameters instead. None otherwise."""
        if not self._shared or self._quorum is None or not self.compression.keeps_unsent:
            return None
        return self.mover.take_unsent(self._quorum, tensors, params, key)

    # --------------------------------------------------------------- healing
    def send_bytes(self, payload: bytes, dst: int) -> None:
        """Leader to leader over lane 0: length, then the bytes followed by their tag (bound to this quorum,
        this sender and the receiver)."""
        assert self._quorum is not None
        pg, me = self.lanes.groups[0], self._quorum.me
        sealed = payload + self._seal.tag(f"{self._seal.nonce}/heal/{dst}", me, payload)
        n = torch.tensor([len(sealed)], dtype=torch.int64)
        buf = torch.frombuffer(bytearray(sealed), dtype=torch.uint8)
        Pending(self.clock, [pg.send([n], dst, 11)], self.clock.account(8), what="heal header").wait()
        Pending(self.clock, [pg.send([buf], dst, 12)], self.clock.account(len(sealed)), what="heal payload").wait()

    def recv_bytes(self, src: int, max_bytes: int = 1 << 40) -> bytes:
        """The payload `src` sent, checked: its length against `max_bytes` before anything is allocated, then
        its tag (HealError: the payload is refused, nothing in it is used)."""
        assert self._quorum is not None
        pg, who = self.lanes.groups[0], self._quorum.members[src].name
        n = torch.zeros(1, dtype=torch.int64)
        Pending(self.clock, [pg.recv([n], src, 11)], 0.0, what="heal header").wait()
        size = int(n.item())
        if not TAG <= size <= max_bytes + TAG:
            raise HealError(f"healing payload from cluster {who}: {size} bytes where at most {max_bytes} fit this "
                            "model: refused before reading it")
        buf = torch.empty(size, dtype=torch.uint8)
        Pending(self.clock, [pg.recv([buf], src, 12)], 0.0, what="heal payload").wait()
        raw = bytes(buf.numpy().tobytes())
        payload, mac = raw[:-TAG], raw[-TAG:]
        if not self._seal.ok(f"{self._seal.nonce}/heal/{self._quorum.me}", src, payload, mac):
            raise HealError(f"healing payload from cluster {who} does not verify (another key, or altered): refused")
        return payload


MARK_TAG = 13  # the arrival marks of a small exchange (`_mark`); heal bytes use 11 and 12


def _arrived(work: Any, buf: Tensor) -> bool:
    """Did a mark's receive bring its byte (never blocks: a receive still pending did not)?"""
    try:
        if not work.is_completed():
            return False
        work.wait()
    except Exception:  # noqa: BLE001 - a failed receive brought nothing
        return False
    return bool(buf[0] == 1)


def lighthouse_transport(name: str, cluster: ClusterGroup, lighthouse: str | None, host: str = "127.0.0.1",
                         chunks: int = 4, link: LinkModel | None = None, quorum_timeout_s: float = 300.0,
                         collective_timeout_s: float = 30.0, compression: CompressionConfig | None = None,
                         key: bytes = auth.INSECURE, key_source: str = "federation.key_file",
                         refuse_after_s: float = 25.0, credentials: Credentials | None = None) -> LaneTransport:
    """A cluster's transport across hosts: the federation's gate at `lighthouse` (None: a lone cluster) and
    gloo lanes bound to `host`; the leader serves the lanes' rendezvous from a store on `host`. `key`
    authenticates the membership and everything the lanes carry but a plain SUM; a gate that refuses it for
    `refuse_after_s` stops this cluster with a line naming `key_source`. `credentials` (`signed.Credentials`:
    this cluster's identity and the roster) sign its membership records and check everyone else's."""
    from edit_train.cluster.mesh import bound_store
    from edit_train.federation.lanes import BoundGloo
    from edit_train.federation.quorum import QuorumClient

    timeout = datetime.timedelta(seconds=collective_timeout_s)
    store, service = None, None
    if lighthouse is not None and cluster.rank == 0:
        store = bound_store(host, 0, 1, True, timeout)
        service = QuorumClient(lighthouse, name, key, key_source=key_source, refuse_after_s=refuse_after_s,
                               credentials=credentials)
    return LaneTransport(name=name, cluster=cluster, lanes=Lanes(lambda: BoundGloo(host, timeout)),
                         federated=lighthouse is not None, service=service,
                         store_addr=f"{host}:{store.port}" if store is not None else "", chunks=chunks, link=link,
                         quorum_timeout_s=quorum_timeout_s, compression=compression, store=store, key=key,
                         connect_timeout_s=collective_timeout_s)
