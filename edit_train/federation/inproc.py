"""A whole federation in one process: clusters are threads, the Lighthouse and the gloo lanes are a hub.

`InProcessFederation` stands in for the network only. Each cluster gets the real `LaneTransport` (quorum
forming, lane layout, compression, the WAN-link model), whose quorum service and lane groups are the hub's:

* quorums are issued like torchft's Lighthouse does: once every live cluster has asked (and at least
  `min_clusters`), or `join_timeout_s` after the first ask; a cluster that closed, was killed or is
  partitioned is not live;
* a lane group offers the process-group calls the transport and `compressed_reduce` make (allreduce SUM/MIN,
  allgather, alltoall_base, send/recv) with asynchronous works; every rank computes a reduction itself from
  the posted inputs in rank order, so every cluster gets the bit-identical result;
* `kill(name)` (or `kill_at(name, op, count)`, at a chosen collective) makes a cluster vanish mid-sync: its
  groups fail for everyone still waiting on them, and its own thread gets `ClusterKilled` at its next call.

Tests use it to run whole sync rounds of 2–4 clusters in milliseconds; nothing here is used by a real run.
"""

from __future__ import annotations

import itertools
from collections import Counter
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import ReduceOp

from edit_train.codec.dense import CompressionConfig
from edit_train.federation.lanes import Lanes
from edit_train.federation.link import LinkModel
from edit_train.federation.transport import LaneTransport
from edit_train.local_sgd.errors import FederationError
from edit_train.local_sgd.protocols import ClusterGroup, Member, Quorum


class ClusterKilled(BaseException):
    """Raised in a killed cluster's own thread (not an error the core handles: the cluster is gone)."""


@dataclass
class _Channel:
    """One configured lane: its ranks' posted inputs per operation, and whether a member vanished."""

    world: int
    owners: dict[int, str] = field(default_factory=dict)  # rank -> cluster name
    posts: dict[tuple[Any, ...], dict[int, Any]] = field(default_factory=dict)
    failed: str | None = None
    left: set[int] = field(default_factory=set)


class _Work:
    def __init__(self, hub: InProcessFederation, ch: _Channel, key: tuple[Any, ...], need: int,
                 finish: Callable[[dict[int, Any]], None]) -> None:
        self.hub, self.ch, self.key, self.need, self.finish = hub, ch, key, need, finish
        self._done = False

    def is_completed(self) -> bool:
        with self.hub.cond:
            return len(self.ch.posts.get(self.key, {})) >= self.need or self.ch.failed is not None

    def wait(self) -> None:
        if self._done:
            return
        posted = self.hub.await_posts(self.ch, self.key, self.need)
        self.finish(posted)
        self._done = True


class ThreadGroup:
    """A lane group whose ranks are clusters (threads) of this process."""

    def __init__(self, hub: InProcessFederation, owner: str) -> None:
        self.hub, self.owner = hub, owner
        self.ch: _Channel | None = None
        self._rank = 0
        self._seq = itertools.count()
        self._sent: dict[tuple[int, int], int] = {}

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        self.ch, self._rank = self.hub.rendezvous(store_addr, self.owner, rank, world_size), rank
        self._seq = itertools.count()

    def abort(self, errored: bool = False) -> None:
        if self.ch is not None:
            self.hub.leave(self.ch, self._rank, self.owner)
        self.ch = None

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.ch.world if self.ch is not None else 1

    def _post(self, kind: str, value: Any, key: tuple[Any, ...] | None = None) -> tuple[_Channel, tuple[Any, ...]]:
        if self.ch is None:
            raise RuntimeError("lane group is not configured")
        key = key or (next(self._seq), kind)
        self.hub.post(self.ch, key, self._rank, value, self.owner, kind)
        return self.ch, key

    def allreduce(self, tensors: list[Tensor], opts: Any) -> _Work:
        (t,) = tensors
        ch, key = self._post("allreduce", t.detach().clone())
        minimum = opts.reduceOp == ReduceOp.MIN

        def finish(posted: dict[int, Any]) -> None:
            acc = posted[0].clone()
            for r in range(1, ch.world):
                acc = torch.minimum(acc, posted[r]) if minimum else acc.add_(posted[r])
            t.copy_(acc)
        return _Work(self.hub, ch, key, ch.world, finish)

    def allgather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> _Work:
        (outs,), (t,) = outputs, inputs
        ch, key = self._post("allgather", t.detach().clone())

        def finish(posted: dict[int, Any]) -> None:
            for r, o in enumerate(outs):
                o.copy_(posted[r])
        return _Work(self.hub, ch, key, ch.world, finish)

    def alltoall_base(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int],
                      opts: Any = None) -> _Work:
        parts = list(torch.split(inp.detach().clone(), in_splits))
        ch, key = self._post("alltoall", parts)
        me = self._rank

        def finish(posted: dict[int, Any]) -> None:
            out.copy_(torch.cat([posted[r][me] for r in range(ch.world)]))
        return _Work(self.hub, ch, key, ch.world, finish)

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> _Work:
        n = self._sent.get((dst, tag), 0)
        self._sent[(dst, tag)] = n + 1
        ch, key = self._post("send", tensors[0].detach().clone(), ("p2p", self._rank, dst, tag, n))
        return _Work(self.hub, ch, key, 1, lambda _posted: None)

    def recv(self, tensors: list[Tensor], src: int, tag: int) -> _Work:
        if self.ch is None:
            raise RuntimeError("lane group is not configured")
        n = self._sent.get((-src - 1, tag), 0)
        self._sent[(-src - 1, tag)] = n + 1
        key = ("p2p", src, self._rank, tag, n)
        (t,) = tensors

        def finish(posted: dict[int, Any]) -> None:
            t.copy_(posted[src].reshape(t.shape))
        return _Work(self.hub, self.ch, key, 1, finish)


class _Client:
    """One cluster leader's quorum service."""

    def __init__(self, hub: InProcessFederation, name: str) -> None:
        self.hub, self.name = hub, name

    def request(self, sync: int, size: int, store: str, data: dict[str, Any], timeout_s: float) -> Quorum | None:
        return self.hub.request(Member(self.name, sync, size, store, dict(data)), timeout_s)

    def partition(self, seconds: float) -> None:
        self.hub.partitioned_until[self.name] = time.monotonic() + seconds

    def close(self) -> None:
        self.hub.close(self.name)


class InProcessFederation:
    """The network of a federation whose clusters are threads of this process."""

    _installed: InProcessFederation | None = None

    @classmethod
    def install(cls, hub: InProcessFederation | None) -> InProcessFederation | None:
        """Make `hub` the one `sync.transport=inproc` connects to (None: uninstall); returns it."""
        cls._installed = hub
        return hub

    @classmethod
    def installed(cls) -> InProcessFederation | None:
        return cls._installed

    def __init__(self, min_clusters: int = 1, join_timeout_s: float = 5.0, timeout_s: float = 30.0) -> None:
        self.min_clusters, self.join_timeout_s, self.timeout_s = min_clusters, join_timeout_s, timeout_s
        self.cond = threading.Condition()
        self.live: set[str] = set()
        self.killed: set[str] = set()
        self.partitioned_until: dict[str, float] = {}
        self._asks: dict[str, Member] = {}
        self._first_ask = 0.0
        self._issued: dict[str, Quorum] = {}
        self._quorum_ids = itertools.count(1)
        self._channels: dict[str, _Channel] = {}
        self._kill_at: dict[tuple[str, str], int] = {}
        self.calls: Counter[tuple[str, str]] = Counter()  # (cluster, allreduce | allgather | alltoall | send): issued

    # ------------------------------------------------------------------ clusters
    def transport(self, name: str, cluster: ClusterGroup, *, chunks: int = 4, link: LinkModel | None = None,
                  compression: CompressionConfig | None = None) -> LaneTransport:
        """A cluster's real transport over this hub (its ranks: `cluster`; rank 0 asks for quorums)."""
        with self.cond:
            self.live.add(name)
            self.killed.discard(name)
        service = _Client(self, name) if cluster.rank == 0 else None
        return LaneTransport(name=name, cluster=cluster, lanes=Lanes(lambda: ThreadGroup(self, name)), federated=True,
                             service=service, store_addr=f"inproc:{name}", chunks=chunks, link=link,
                             quorum_timeout_s=self.timeout_s, compression=compression)

    def close(self, name: str) -> None:
        with self.cond:
            self.live.discard(name)
            self.cond.notify_all()

    def kill(self, name: str) -> None:
        """Cluster `name` vanishes: it is not live, and every group it is in fails for the others."""
        with self.cond:
            self.live.discard(name)
            self.killed.add(name)
            self._asks.pop(name, None)
            for ch in self._channels.values():
                if name in ch.owners.values():
                    ch.failed = ch.failed or f"connection to cluster {name} closed"
            self.cond.notify_all()

    def kill_at(self, name: str, op: str, count: int) -> None:
        """Kill `name` when it issues its `count`-th `op` (allreduce, allgather, alltoall, send) from now."""
        self._kill_at[(name, op)] = count

    def _alive(self, name: str) -> None:
        if name in self.killed:
            raise ClusterKilled(name)

    # ------------------------------------------------------------------ quorums
    def _partitioned(self, name: str) -> bool:
        return time.monotonic() < self.partitioned_until.get(name, 0.0)

    def request(self, me: Member, timeout_s: float) -> Quorum | None:
        if self._partitioned(me.name):
            return None
        deadline = time.monotonic() + min(timeout_s, self.timeout_s)
        with self.cond:
            self._alive(me.name)
            self.live.add(me.name)
            self._issued.pop(me.name, None)
            if not self._asks:
                self._first_ask = time.monotonic()
            self._asks[me.name] = me
            self.cond.notify_all()
            while me.name not in self._issued:
                self._alive(me.name)
                self._maybe_issue()
                if me.name in self._issued:
                    break
                if time.monotonic() >= deadline:
                    self._asks.pop(me.name, None)
                    raise FederationError(f"cluster {me.name}: no quorum within {timeout_s:.0f}s")
                self.cond.wait(0.01)
            return self._issued.pop(me.name)

    def _maybe_issue(self) -> None:
        live = {n for n in self.live if not self._partitioned(n)}
        asked = set(self._asks)
        grace = time.monotonic() - self._first_ask >= self.join_timeout_s
        if len(asked) < self.min_clusters or not (live <= asked or grace):
            return
        members = sorted(self._asks.values(), key=lambda m: m.name)
        qid = next(self._quorum_ids)
        for i, m in enumerate(members):
            self._issued[m.name] = Quorum(qid, f"q{qid}", list(members), i)
        self._asks.clear()
        self.cond.notify_all()

    # ------------------------------------------------------------------ lanes
    def rendezvous(self, prefix: str, owner: str, rank: int, world: int) -> _Channel:
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            ch = self._channels.setdefault(prefix, _Channel(world))
            ch.owners[rank] = owner
            self.cond.notify_all()
            while len(ch.owners) < world:
                self._alive(owner)
                if time.monotonic() >= deadline or ch.failed:
                    raise RuntimeError(f"{prefix}: peers did not connect")
                self.cond.wait(0.01)
            return ch

    def leave(self, ch: _Channel, rank: int, owner: str) -> None:
        """A rank dropped its group: the others' pending operations on it fail (as a closed socket would);
        what every rank already posted can still be collected."""
        with self.cond:
            ch.failed = ch.failed or f"connection to cluster {owner} closed"
            ch.left.add(rank)
            if len(ch.left) >= ch.world:
                self._channels = {k: v for k, v in self._channels.items() if v is not ch}
            self.cond.notify_all()

    def post(self, ch: _Channel, key: tuple[Any, ...], rank: int, value: Any, owner: str, kind: str) -> None:
        with self.cond:
            self._alive(owner)
            self.calls[(owner, kind)] += 1
            left = self._kill_at.get((owner, kind))
            if left is not None:
                self._kill_at[(owner, kind)] = left - 1
                if left <= 1:
                    del self._kill_at[(owner, kind)]
                    self.kill(owner)  # the condition's lock is re-entrant
                    raise ClusterKilled(owner)
            ch.posts.setdefault(key, {})[rank] = value
            self.cond.notify_all()

    def await_posts(self, ch: _Channel, key: tuple[Any, ...], need: int) -> dict[int, Any]:
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while len(ch.posts.get(key, {})) < need:
                if ch.failed is not None:
                    raise RuntimeError(ch.failed)
                if time.monotonic() >= deadline:
                    raise RuntimeError("timed out")
                self.cond.wait(0.01)
            return dict(ch.posts[key])
