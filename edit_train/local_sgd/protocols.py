"""The two seams of the sync core, as typed protocols, and the quorum they hand around.

* `ClusterGroup` — what happens *inside* one cluster (its ranks, over its fast links): agree on a branch,
  sum or max a tensor, broadcast bytes/JSON from the leader, gather a full tensor from FSDP shards.
  Implemented once in `edit_train.cluster.group` (torch.distributed, or a lone rank).
* `Transport` — what crosses clusters: form the quorum of a sync, all-gather a small vector, reduce a
  unit's tensor, vote to commit, carry heal bytes between leaders. Implemented by
  `edit_train.federation.transport.LaneTransport` (torchft Lighthouse + gloo lanes, optional compression
  and a simulated WAN link) and, in one process, over `edit_train.federation.inproc` (threads).

Every call of a `Transport` is made by every rank of the cluster at the same point and returns the same
answer on all of them (the transport agrees inside the cluster). Collectives return a `Handle`: `ready()`
never blocks, `wait()` returns the result (or raises `FederationError`) and leaves the seconds it blocked
in `blocked_s`.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

__all__ = ["Member", "Quorum", "Handle", "ClusterGroup", "Contributions", "Residuals", "Transport"]

T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Member:
    """One cluster of an issued quorum, as it described itself when it asked."""

    name: str
    sync: int  # anchor version this cluster holds
    size: int  # ranks
    store: str  # host:port of the member leader's store (lanes rendezvous there)
    data: dict[str, Any] = field(default_factory=dict)  # local_steps, incarnation, fp, total_steps, anchor (digest)
    signer: str = ""  # the id of the roster key that signed this record, as the receiver checked it ("": no roster)
    speed: float = 0.0  # its hardware speed as the receiver's roster declares it (0: none declared; judge.time_caps)

    @property
    def contributes(self) -> bool:
        """A member that took no local step since its anchor has nothing to contribute (a fresh or
        just-restarted cluster): it takes part in the collectives with weight 0."""
        return int(self.data.get("local_steps", 0)) > 0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "sync": self.sync, "size": self.size, "store": self.store, "data": self.data,
                "signer": self.signer, "speed": self.speed}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Member:
        return Member(str(d["name"]), int(d["sync"]), int(d["size"]), str(d["store"]), dict(d.get("data") or {}),
                      str(d.get("signer", "")), float(d.get("speed", 0.0)))


@dataclass
class Quorum:
    """One issued quorum, as every rank of every cluster sees it (sorted by cluster name)."""

    quorum_id: int
    nonce: str  # unique per issued quorum: namespaces the process groups configured for it
    members: list[Member]
    me: int  # my position in `members`
    left_out: list[str] = field(default_factory=list)  # in the issued quorum, refused by this one's members

    @staticmethod
    def solo(name: str, sync: int, size: int, data: dict[str, Any]) -> Quorum:
        """A cluster alone (no federation)."""
        return Quorum(0, "solo", [Member(name, sync, size, "", data)], 0)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.members]

    @property
    def shared(self) -> bool:
        """More than one cluster: collectives cross clusters and a sync must be voted on."""
        return len(self.members) > 1

    def claim(self, i: int) -> tuple[int, str]:
        """What member `i` says it holds: its anchor version and the digest of its anchor ("" for none)."""
        m = self.members[i]
        return m.sync, str(m.data.get("anchor", ""))

    @property
    def agreed(self) -> tuple[int, str]:
        """The state the federation continues from: the (sync, anchor digest) most members hold; a tie goes
        to the newest, then the smallest digest. What one member claims alone never outweighs what two hold
        (a liar, or a corrupted cluster, claiming the newest sync is not followed where others' view exists)."""
        counts = Counter(self.claim(i) for i in range(len(self.members)))
        return min(counts, key=lambda c: (-counts[c], -c[0], c[1]))

    @property
    def agreed_sync(self) -> int:
        return self.agreed[0]

    def source_for(self, healer: int) -> int:
        """Position of the member `healer` copies from: one holding the agreed state, not one whose payload the
        healer said it refused (`data["refused"]`, its own claim), chosen by the quorum's nonce among the rest."""
        agreed = self.agreed
        holders = [i for i in range(len(self.members)) if self.claim(i) == agreed]
        refused = str(self.members[healer].data.get("refused", "")).split(",")
        holders = [i for i in holders if self.members[i].name not in refused] or holders
        turn = int.from_bytes(hashlib.sha256(f"{self.nonce}/{healer}".encode()).digest()[:4], "big")
        return holders[turn % len(holders)]

    def behind(self) -> list[int]:
        """Members at another anchor version than the agreed one (older, or ahead of what the others hold):
        they heal from the source. A member at the agreed version with another digest (a cluster on another
        device rounds differently) is not healed."""
        sync = self.agreed_sync
        return [i for i, m in enumerate(self.members) if m.sync != sync]

    @property
    def paired(self) -> bool:
        """Equal-size clusters pair rank r with rank r (cheapest); otherwise the federation's chunks."""
        return len({m.size for m in self.members}) == 1

    def to_json(self) -> dict[str, Any]:
        return {"quorum_id": self.quorum_id, "nonce": self.nonce, "me": self.me,
                "members": [m.to_json() for m in self.members], "left_out": list(self.left_out)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Quorum:
        return Quorum(int(d["quorum_id"]), str(d["nonce"]), [Member.from_json(m) for m in d["members"]], int(d["me"]),
                      [str(n) for n in d.get("left_out", [])])


@dataclass
class Contributions:
    """Every cluster's contribution to one unit, as one rank holds it: `parts[i]` is cluster i's
    tensors in this rank's local layout; `whole[i]` its unit's whole flat Δ when every rank of every cluster
    holds it (None when the layouts are the same everywhere and each rank holds its own shard)."""

    parts: list[list[Tensor]]
    whole: Tensor | None = None
    rows: Tensor | None = None  # [cluster, this rank's elements]: `parts` flattened, when the transport has it


class Handle(Protocol[T_co]):
    """A collective in flight."""

    blocked_s: float  # seconds the last wait() blocked

    def ready(self) -> bool: ...

    def wait(self) -> T_co: ...


class ClusterGroup(Protocol):
    """The ranks of one cluster (one model replica, sharded over fast links)."""

    rank: int
    size: int
    device: torch.device

    def agree(self, ok: bool) -> bool: ...  # True only if every rank says ok

    def sum_(self, t: Tensor) -> Tensor: ...  # in place

    def max_(self, t: Tensor) -> Tensor: ...  # in place

    def all_gather(self, t: Tensor) -> Tensor: ...  # [ranks, *t.shape], in rank order

    def broadcast_(self, t: Tensor) -> Tensor: ...  # the leader's (rank 0's) tensor, in place

    def broadcast_bytes(self, payload: bytes | None) -> bytes: ...  # the leader's (rank 0's) payload

    def broadcast_json(self, obj: Any) -> Any: ...

    def all_gather_json(self, obj: Any) -> list[Any]: ...

    def full(self, local: Tensor, like: Tensor | None) -> Tensor: ...  # the whole tensor of an FSDP shard

    def shard(self, full: Tensor, like: Tensor) -> Tensor: ...  # this rank's shard of a whole tensor


class Residuals(Protocol):
    """Error-feedback residuals of a lossy transport (this rank's debt to the anchor it trained from)."""

    def state_dict(self) -> dict[str, Tensor]: ...

    def load_state_dict(self, sd: dict[str, Tensor]) -> None: ...

    def clear(self, key: str | None = None) -> None: ...

    def mark(self) -> None: ...  # a sync starts: remember the residuals

    def restore(self) -> None: ...  # that sync rolled back: its residuals are forgotten


class Transport(Protocol):
    """What crosses clusters, for one rank of one cluster."""

    name: str  # this cluster's name
    federated: bool  # False: a lone cluster (every call is local)
    exact: bool  # contributions arrive exactly as handed over (no lossy compression)
    payload_error: float  # how far a lossy SUM may lie from the sum handed over, relative (0: exact)
    gathers_sums: bool  # a SUM moves every contribution anyway (sparse payloads): gathering costs the same
    cluster: ClusterGroup
    feedback: Residuals

    @property
    def quorum(self) -> Quorum | None: ...  # the quorum of the sync in progress

    @property
    def forming(self) -> bool: ...  # a quorum is being formed in the background

    @property
    def bytes_sent(self) -> int: ...

    @property
    def blocked_s(self) -> float: ...

    def waiting(self) -> AbstractContextManager[None]: ...  # count the time inside as blocked

    # vet: the leader's check of the issued quorum before any lane connects (may leave members out, or refuse)
    def form_start(self, sync: int, data: dict[str, Any], vet: Callable[[Quorum], Quorum] | None = None) -> None: ...

    def form_poll(self, block: bool = False) -> tuple[bool, Quorum | None]: ...  # None: cut off

    def all_gather(self, vec: Tensor, what: str = "norm exchange") -> Handle[Tensor]: ...  # [members, n] float64

    # `rows` (optional): per tensor, the dim-0 rows of the whole parameter that take part (None: all); the others
    # are not sent and come back as 0. The same on every cluster.
    def reduce_(self, tensors: list[Tensor], params: list[Tensor] | None = None, key: str = "",
                rows: list[Tensor | None] | None = None) -> Handle[None]: ...

    # every cluster's contribution as this rank holds it: exactly what each one sent; `rows[i]`: what
    # cluster i sends, as for `reduce_` (every cluster knows every cluster's); the rest arrives as 0
    def gather(self, tensors: list[Tensor], params: list[Tensor] | None = None, key: str = "",
               rows: list[list[Tensor | None]] | None = None) -> Handle[Contributions]: ...

    # every cluster's commit vote, [members]: 1.0 when every rank of it says ok (the round commits on a strict
    # majority, round.py); raises when a cluster is lost
    def vote(self, ok: bool) -> Handle[Tensor]: ...

    # `sync.unsent=keep`: what this cluster's last send of unit `key` left out (laid out like `tensors`), and
    # forgotten by the transport; None when nothing was left out
    def take_unsent(self, tensors: list[Tensor], params: list[Tensor], key: str) -> list[Tensor] | None: ...

    def send_bytes(self, payload: bytes, dst: int) -> None: ...  # leader to leader

    def recv_bytes(self, src: int, max_bytes: int = 1 << 40) -> bytes: ...  # refused past max_bytes

    def carry(self, bytes_sent: int, blocked_s: float) -> None: ...  # counters of earlier incarnations (resume)

    def partition(self, seconds: float) -> None: ...  # fault injection: cut off for `seconds`

    def abort(self) -> None: ...  # drop the current quorum's groups (after a failure)

    def close(self) -> None: ...

