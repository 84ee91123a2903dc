"""Cross-cluster process groups for one quorum: torchft's reconfigurable gloo groups, one per *lane*.

Layout is by unit, not by rank. A unit's pseudo-gradient is cut into the federation's `chunks` fixed
pieces; cluster c hands chunk j to its rank `j % size_c`; lane j is the group of chunk j's owners, one
rank per participating cluster (its rank in the lane = the cluster's position in the sorted quorum).
When every cluster has the same size the federation pairs rank r with rank r instead (lane r), so each
rank reduces its own FSDP shard in place with no resharding (the cheaper layout).

Lane 0 always joins the cluster leaders: it carries the small control exchanges (norms, votes) and healing.
Gloo over TCP with tensors staged on CPU, so clusters of different accelerators can sync.

The lanes rendezvous in the store of the quorum's first member (sorted by name): its leader's TCPStore, at the
address its signed member record names. A member could name a store that accepts connections and never
answers: torch's TCPStore client then waits for the handshake forever, whatever its timeout. So a lane probes
the store first (`store_answers`, `STORE_PROBE_S`, never longer than the connect deadline); a store that does
not answer fails the connect at once with `SilentStore`, and `SilentStores` — on the leader, before the lanes
of the next quorums connect — leaves its member out (one line naming it and its roster key) for the next
`LEAVE_OUT_SYNCS` quorums, twice as many each time it happens again. Every honest member probes the same store
and leaves out the same member; the rest connect among themselves under a nonce derived from who is left
(`claims.nonce_of`), with the next member's store.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torchft.process_group import ProcessGroupGloo

from edit_train.local_sgd.aggregation.claims import nonce_of
from edit_train.local_sgd.errors import FederationError
from edit_train.local_sgd.protocols import Quorum

log = logging.getLogger(__name__)

STORE_PROBE_S = 5.0  # a lane store that does not answer a handshake within this (or the connect deadline) is silent
LEAVE_OUT_SYNCS = 8  # quorums a member whose store was silent is left out of (doubled each time again)


class SilentStore(FederationError):
    """The lanes' store accepted the connection (or not) and did not answer within the probe's time."""


def store_answers(address: str, timeout_s: float) -> bool:
    """Does the TCPStore at `address` (host:port[/prefix]) answer a client's handshake and one query within
    `timeout_s`? The client runs on a daemon thread: against a listener that never answers it would wait for
    ever (torch's handshake has no deadline); it is abandoned, not waited for."""
    host, _, port = address.split("/", 1)[0].rpartition(":")
    answered: list[bool] = []

    def probe() -> None:
        try:
            store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
            store.check(["edit-train/probe"])
            answered.append(True)
        except Exception:  # noqa: BLE001 - refused, reset, timed out: not answering
            answered.append(False)

    t = threading.Thread(target=probe, name="edit-train-store-probe", daemon=True)
    t.start()
    t.join(timeout_s)
    return bool(answered and answered[0])


class Work(Protocol):
    """A collective in flight on a lane (torch's `Work`)."""

    def is_completed(self) -> bool: ...

    def wait(self) -> Any: ...


class LaneGroup(Protocol):
    """One lane's process group for one quorum: what the transport and `compressed_reduce` call on it. torchft's
    reconfigurable gloo group (`BoundGloo`) across hosts; `inproc.ThreadGroup` between threads."""

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None: ...

    def abort(self, errored: bool = False) -> None: ...

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def allreduce(self, tensors: list[Tensor], opts: Any) -> Work: ...

    def allgather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> Work: ...

    def alltoall_base(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int],
                      opts: Any = None) -> Work: ...

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> Work: ...

    def recv(self, tensors: list[Tensor], src: int, tag: int) -> Work: ...


class BoundGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, listening on one address (`host`) instead of whatever the
    hostname resolves to, so a local run keeps every socket on 127.0.0.1."""

    def __init__(self, host: str, timeout: datetime.timedelta) -> None:
        super().__init__(timeout=timeout)
        self._host = host

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, *args: Any, **kw: Any) -> None:
        """torchft's configure, once the store answered a probe (`SilentStore` otherwise, at once)."""
        limit = min(STORE_PROBE_S, self._timeout.total_seconds())
        if not store_answers(store_addr, limit):
            raise SilentStore(f"the lanes' store at {store_addr.split('/', 1)[0]} did not answer within {limit:g} s")
        super().configure(store_addr, replica_id, rank, world_size, *args, **kw)

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        from torch.distributed import ProcessGroup as BaseProcessGroup
        from torch.distributed.distributed_c10d import ProcessGroupGloo as BaseGloo

        opts = BaseGloo._Options()
        opts._timeout = self._timeout
        opts._devices = [BaseGloo.create_device(hostname=self._host)]
        backend = BaseGloo(store, rank, world_size, opts)
        backend._set_sequence_number_for_group()
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.GLOO, backend)
        if torch.cuda.is_available():
            pg._register_backend(torch.device("cuda"), BaseProcessGroup.BackendType.GLOO, backend)
        return pg


def lanes_of(rank: int, size: int, quorum: Quorum, chunks: int) -> list[int]:
    """The lanes this rank takes part in."""
    if quorum.paired:
        return [rank]
    return [j for j in range(chunks) if j % size == rank]


class Lanes:
    """The configured lane groups of this rank for the current quorum. `make_group()` builds one
    reconfigurable group (torchft's `configure(store_addr, replica_id, rank, world_size)` / `abort()`):
    gloo over TCP here, threads in `federation.inproc`."""

    def __init__(self, make_group: Callable[[], LaneGroup]) -> None:
        self.make_group = make_group
        self.groups: dict[int, LaneGroup] = {}
        self.quorum: Quorum | None = None

    def configure(self, quorum: Quorum, rank: int, size: int, chunks: int) -> None:
        """(Re)build this rank's lane groups for `quorum` (blocks until every peer connected)."""
        self.abort()
        self.quorum = quorum
        store = quorum.members[0].store
        groups: dict[int, LaneGroup] = {}
        for j in lanes_of(rank, size, quorum, chunks):
            pg = self.make_group()
            try:
                pg.configure(f"{store}/edit-train/{quorum.nonce}/lane{j}", f"lane{j}", quorum.me,
                             len(quorum.members))
            except SilentStore as exc:
                raise SilentStore(f"lane {j} of quorum {quorum.quorum_id} with {quorum.names} could not connect: "
                                  f"{exc} (cluster {quorum.members[0].name}'s)") from exc
            except Exception as exc:  # noqa: BLE001
                raise FederationError(f"lane {j} of quorum {quorum.quorum_id} with {quorum.names} could "
                                      f"not connect: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
            groups[j] = pg
        if self.quorum is not quorum:  # given up on meanwhile (its deadline passed): never used
            for pg in groups.values():
                pg.abort(errored=False)
            raise FederationError(f"quorum {quorum.quorum_id}: lanes connected after their deadline")
        self.groups = groups

    def abort(self) -> None:
        for pg in self.groups.values():
            try:
                pg.abort(errored=False)
            except Exception:  # noqa: BLE001
                pass
        self.groups.clear()
        self.quorum = None


class SilentStores:
    """The members whose lanes' store did not answer (`SilentStore`), or who never came to a collective the others
    waited for until it failed (`stalled`), each left out of this cluster's next quorums: `LEAVE_OUT_SYNCS`, twice
    as many each time again. The leader's: `blame` after a connect failed,
    `vet` on every issued quorum before its lanes connect."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.asked = 0  # quorums vetted so far
        self.until: dict[str, int] = {}  # member -> the last quorum (count) it is left out of
        self.times: dict[str, int] = {}  # member -> how often its store was silent (or it stalled a collective)
        self.blamed: list[str] = []  # members blamed for a stalled collective, not yet in an event

    def blame(self, q: Quorum, exc: BaseException) -> None:
        """The lanes of `q` failed with `exc`: a silent store is its first member's (never this cluster's own)."""
        host = q.members[0]
        if not isinstance(exc, SilentStore) or host.name == self.me:
            return
        k = self.times[host.name] = self.times.get(host.name, 0) + 1
        n = min(LEAVE_OUT_SYNCS * 2 ** (k - 1), 1 << 16)
        self.until[host.name] = self.asked + n
        signed = f"its records signed by roster key {host.signer}" if host.signer else "no roster: unsigned"
        log.warning("cluster %s: cluster %s's lanes' store at %s accepted no handshake within %g s (quorum %d): "
                    "left out of the next %d syncs (%s)", self.me, host.name, host.store, STORE_PROBE_S,
                    q.quorum_id, n, signed)

    def stalled(self, q: Quorum, who: list[int], what: str) -> str:
        """Members `who` of `q` never came to `what` (a collective this cluster waited for until it failed; every
        other member had come): each left out of the next quorums like a silent store. The clause that names them."""
        said = []
        for i in who:
            m = q.members[i]
            if m.name == self.me:
                continue
            k = self.times[m.name] = self.times.get(m.name, 0) + 1
            n = min(LEAVE_OUT_SYNCS * 2 ** (k - 1), 1 << 16)
            self.until[m.name] = self.asked + n
            self.blamed.append(m.name)
            signed = f"roster key {m.signer}" if m.signer else "no roster: unsigned"
            said.append(f"cluster {m.name} ({signed}) never came to the {what} of quorum {q.quorum_id}: left out of "
                        f"the next {n} syncs")
            log.warning("cluster %s: cluster %s never came to the %s of quorum %d (every other member had): left out "
                        "of the next %d syncs (%s)", self.me, m.name, what, q.quorum_id, n,
                        f"its records signed by {signed}" if m.signer else signed)
        return "; ".join(said)

    def take_blamed(self) -> list[str]:
        """The members blamed for a stalled collective since the last call (the `sync_aborted` event names them)."""
        out, self.blamed = self.blamed, []
        return out

    def vet(self, q: Quorum) -> Quorum:
        """`q` less the members left out for a silent store (the rest under a nonce of their own)."""
        self.asked += 1
        me = q.members[q.me]
        out = sorted(m.name for m in q.members if m.name != me.name and self.until.get(m.name, 0) >= self.asked)
        if not out:
            return q
        keep = [m for m in q.members if m.name not in out]
        return Quorum(q.quorum_id, nonce_of(q.nonce, keep), keep, keep.index(me), [*q.left_out, *out])
