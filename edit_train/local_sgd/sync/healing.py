"""Healing inside a sync: members not at the agreed anchor copy the federation's state from a live peer.

The source (a member holding the agreed state: the (sync, anchor digest) most members hold, `Quorum.agreed`)
gathers full tensors over its fast links, its leader sends one payload (safetensors + JSON, `federation.heal`)
to each healer's leader, and every rank of a healer takes its own FSDP shard of each tensor. Before anything
is adopted the payload is checked whole (`check_payload`): every value finite and of this model's shapes and
dtypes, the sync index the agreed one, the steps within the federation's, and the anchor's digest the one the
source and the members agreeing with it claimed. A failed or refused transfer changes nothing.

What is copied: in the local-SGD phase the outer state (anchor, momentum) and the aggregation rule's
statistics, and the healer re-bases θ ← θ̄_new + (θ − θ̄_old) (its local progress is kept); during ddp or
the synchronous warm-up, the replica itself and its inner optimizer.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from edit_train.local_sgd.aggregation.claims import agreed_steps
from edit_train.local_sgd.errors import FederationError, HealError
from edit_train.local_sgd.sync.outer import OuterState
from edit_train.local_sgd.protocols import Quorum, Residuals, Transport
from edit_train.local_sgd.sync.round import Unit, rebase

log = logging.getLogger(__name__)

# name -> (this rank's local tensor, the parameter it shards like, or None when replicated)
LocalState = dict[str, tuple[Tensor, Tensor | None]]
Encode = Callable[[dict[str, Any], dict[str, Tensor]], bytes]
Decode = Callable[[bytes, str], tuple[dict[str, Any], dict[str, Tensor]]]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Healer:
    """Moves state from the quorum's source to the members behind it (the payload format is the
    transport side's: `encode`/`decode`, e.g. `edit_train.federation.heal`)."""

    def __init__(self, transport: Transport, collect: Callable[[], tuple[dict[str, Any], LocalState]],
                 apply: Callable[[dict[str, Any], dict[str, Tensor]], None], encode: Encode, decode: Decode,
                 judge: Callable[[dict[str, Tensor]], str | None] | None = None) -> None:
        self.t, self.collect, self.apply = transport, collect, apply
        self.encode, self.decode = encode, decode
        # a received anchor probed on this cluster's own data before adoption: why not, or None (adopt)
        self.judge = judge
        self.refused: list[str] = []  # sources whose payload this cluster refused (it says so when it asks again)
        self.kept_own: list[str] = []  # sources whose state only they held: this cluster kept its own instead

    def run(self, q: Quorum, max_steps: int = 0, steps: int | None = None, rejoining: bool = False) -> str | None:
        """Heal whoever is behind in `q` (`max_steps`: the federation's steps, 0 = no bound; `steps`: the step
        a healed cluster continues from, default `agreed_steps(q)`). Returns the source's name if this cluster
        healed. A received anchor is probed on this cluster's own data first where it has a probe (`judge`): one
        worse than its own by more than the probe tolerance is refused. Ties keep what you have: a state only one
        other member holds (with two clusters: a newer sync only the other claims) is adopted only by a cluster
        that is `rejoining` (restarted or resumed, not yet in a shared sync; a fresh start never is), and then only if the probe did
        not find it worse; otherwise the payload is taken off the wire and dropped, and this cluster keeps its
        own state and syncs on. Nobody heals to a state that no strict majority of the other members holds (three
        clusters each claiming another state: the newest is one member's word)."""
        sources = {i: q.source_for(i) for i in q.behind()}
        mine = [i for i, s in sources.items() if s == q.me]
        if mine:
            self._send(q, mine)
        if q.me not in sources:
            return None
        src = q.members[sources[q.me]].name
        try:
            healed = self._receive(q, sources[q.me], max_steps, agreed_steps(q) if steps is None else steps,
                                   rejoining)
        except HealError:
            self.refused = [*[n for n in self.refused if n != src], src][-4:]
            raise
        self.refused = []
        return src if healed else None

    def _send(self, q: Quorum, behind: list[int]) -> None:
        c = self.t.cluster
        meta, local = self.collect()
        full = {k: c.full(t, like).detach().cpu() for k, (t, like) in local.items()}
        ok = True
        if c.rank == 0:
            payload = self.encode({"from": self.t.name, **meta}, full)
            for dst in behind:
                try:
                    self.t.send_bytes(payload, dst)
                except FederationError as exc:
                    log.warning("cluster %s: healing %s failed: %s", self.t.name, q.members[dst].name, exc)
                    ok = False
            log.info("cluster %s: sent state of sync %d (%.1f MB) to %s", self.t.name, q.agreed_sync,
                     len(payload) / 1e6, [q.members[d].name for d in behind])
        if not c.agree(ok):
            raise FederationError("healing a peer failed")

    def _receive(self, q: Quorum, source: int, max_steps: int, steps: int, rejoining: bool = False) -> bool:
        c, src = self.t.cluster, q.members[source].name
        _, local = self.collect()
        payload: bytes | None = None
        if c.rank == 0:
            try:  # refused before anything is allocated if it is larger than this model's state can be
                payload = self.t.recv_bytes(source, max_bytes=payload_cap(local))
            except FederationError as exc:
                log.warning("cluster %s: healing from %s failed: %s", self.t.name, src, exc)
                payload = b""
        payload = c.broadcast_bytes(payload)
        if not payload:
            raise FederationError(f"healing from {src} failed")
        meta, tensors = self.decode(payload, f"cluster {src}")
        sync, digest = q.agreed
        check_payload(meta, tensors, local, f"cluster {src}", Expect(sync, max_steps, digest))
        meta = {**meta, "total_steps": steps}  # what the quorum's claims agree on, not what the source says
        mine: dict[str, Tensor] = {}
        for k, t in tensors.items():  # optimizer state this rank does not hold yet is sharded like its owner
            entry = None if k.startswith("penalty/") else local.get(k) or _owner(k, local)  # rule state: whole
            like = entry[0] if entry is not None and t.dim() > 0 else None
            try:
                mine[k] = c.shard(t, like) if like is not None else t
            except ValueError as exc:
                raise HealError(f"healing payload from {src}: {k}: {exc}") from None
        worse = self.judge(mine) if self.judge is not None and meta.get("local_phase") else None
        minority = not _held_by_most_others(q)
        if minority or (_held_by_one(q) and (worse is not None or not rejoining)):
            first = src not in self.kept_own
            self.kept_own = [*[n for n in self.kept_own if n != src], src][-4:]
            why = worse or ("no strict majority of the other members holds it" if minority else
                            "no other member holds it, and a tie keeps what this cluster has (only a restarted or "
                            "resumed cluster heals to it)")
            log.log(logging.WARNING if first else logging.INFO, "cluster %s: kept its own state (sync %d), not "
                    "cluster %s's sync %d that only it holds: %s (%s)", self.t.name, q.claim(q.me)[0], src, sync, why,
                    f"its records signed by roster key {q.members[source].signer}" if q.members[source].signer
                    else "no roster: unsigned")
            return False
        if worse is not None:
            raise HealError(f"healing payload from {src}: {worse}: refused, nothing adopted")
        try:
            self.apply(meta, mine)
        except (ValueError, KeyError, TypeError) as exc:
            raise HealError(f"healing payload from {src} does not fit this model: {exc}") from None
        log.info("cluster %s: healed from %s (sync %d)", self.t.name, src, int(meta.get("sync_index", -1)))
        return True


def _held_by_most_others(q: Quorum) -> bool:
    """Does a strict majority of the other members hold the agreed state (two clusters: the other one)? A cluster
    heals only to such a state, and then from one of its holders."""
    agreed = q.agreed
    holders = sum(1 for i in range(len(q.members)) if i != q.me and q.claim(i) == agreed)
    return 2 * holders > len(q.members) - 1


def _held_by_one(q: Quorum) -> bool:
    """Is the agreed state claimed by a single member, not this cluster (two clusters: a tie, the newer won)?"""
    agreed = q.agreed
    holders = [i for i in range(len(q.members)) if q.claim(i) == agreed]
    return len(holders) == 1 and holders[0] != q.me


# ------------------------------------------------------------ what a heal may carry
def _full_shape(entry: tuple[Tensor, Tensor | None]) -> tuple[int, ...]:
    t, like = entry
    return tuple(like.shape) if like is not None else tuple(t.shape)


def payload_cap(local: LocalState) -> int:
    """The most bytes a heal payload for this state can take: every tensor whole, in 8-byte elements (an
    optimizer state the receiver does not have yet is at most its parameter's size), plus headers."""
    params = sum(math.prod(_full_shape(e)) for k, e in local.items() if k.startswith(("param/", "outer/")))
    return 8 * (3 * params + sum(math.prod(_full_shape(e)) for e in local.values())) + (1 << 22)


_META = {"sync_index": int, "total_steps": int, "global_step": int, "local_phase": bool, "rule": dict, "from": str}
DIGEST_S = [0.0]  # seconds this process spent hashing anchors (with the signatures: the summary's trust_s)


@dataclass(frozen=True)
class Expect:
    """What a heal payload must match: the agreed sync index, the federation's steps (0: no bound) and the
    agreed anchor digest ("" when the members claimed none)."""

    sync: int | None = None
    max_steps: int = 0
    digest: str = ""


def anchor_digest(tensors: dict[str, Tensor]) -> str:
    """SHA-256 (128 bits shown) over every anchor tensor of a state, whole: its key, dtype, shape and bytes."""
    t0 = time.perf_counter()
    h = hashlib.sha256()
    for key in sorted(k for k in tensors if "/anchor/" in k):
        t = tensors[key].detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")
    DIGEST_S[0] += time.perf_counter() - t0
    return h.hexdigest()[:32]


def _owner(key: str, local: LocalState) -> tuple[Tensor, Tensor | None] | None:
    """The local entry an optimizer state tensor belongs to: its unit's anchor, or its parameter."""
    if key.startswith("outer/"):
        unit_kind, _, index = key[len("outer/"):].rpartition("/")
        return local.get(f"outer/{unit_kind.rpartition('/')[0]}/anchor/{index}")
    if key.startswith("optim/"):
        return local.get("param/" + key[len("optim/"):].rpartition("/")[0])
    return None


def check_payload(meta: dict[str, Any], tensors: dict[str, Tensor], local: LocalState, peer: str,
                  expect: Expect = Expect()) -> None:
    """Everything of a heal payload before any of it is adopted: the metadata's fields, types and ranges (the
    agreed sync index, steps within the federation's), every tensor's key (known to this model), shape, dtype
    and values (finite; counts within range), and the anchor's digest (HealError naming the first problem)."""
    for k, kind in _META.items():
        v = meta.get(k)
        if k in meta and not (isinstance(v, kind) and (kind is not int or not isinstance(v, bool))):
            raise HealError(f"healing payload from {peer}: {k} is {type(v).__name__}, not {kind.__name__}")
        if kind is int and isinstance(v, int) and not 0 <= v < 1 << 62:
            raise HealError(f"healing payload from {peer}: {k} = {v} is out of range")
        if k != "sync_index" and kind is int and isinstance(v, int) and 0 < expect.max_steps < v:
            raise HealError(f"healing payload from {peer}: {k} = {v} is more than the federation's "
                            f"{expect.max_steps} steps")
    if expect.sync is not None and meta.get("sync_index", expect.sync) != expect.sync:
        raise HealError(f"healing payload from {peer}: sync_index = {meta.get('sync_index')}, the state agreed "
                        f"on is sync {expect.sync}")
    for key, t in tensors.items():
        _check_tensor(key, t, local, peer)
    if meta.get("local_phase"):
        missing = [k for k in local if "/anchor/" in k and k not in tensors]
        if missing:
            raise HealError(f"healing payload from {peer}: no {missing[0]!r}")
    if expect.digest and meta.get("local_phase") and anchor_digest(tensors) != expect.digest:
        raise HealError(f"healing payload from {peer}: its anchor does not match the digest {expect.digest} of "
                        "the state agreed on: refused, nothing adopted")


def _check_tensor(key: str, t: Tensor, local: LocalState, peer: str) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise HealError(f"healing payload from {peer}: {key!r} is not finite")
    if not t.is_floating_point():  # the rule's counts (int64) are the only other state a heal carries
        if t.dtype not in (torch.int64, torch.int32):
            raise HealError(f"healing payload from {peer}: {key!r} is {t.dtype}, not a floating-point state or a count")
        if t.numel() and not (bool((t >= 0).all()) and bool((t < 1 << 53).all())):
            raise HealError(f"healing payload from {peer}: {key!r} holds counts out of range")
    if key.startswith("penalty/"):  # the rule's statistics: their shapes follow the clusters the rule has met (the
        return  # source may know more than we do), so the rule's own load() checks them against their roster
    entry = local.get(key)
    if entry is None:  # optimizer state the receiver does not hold yet: shaped like its parameter
        owner = _owner(key, local)
        if owner is None or (t.dim() > 0 and tuple(t.shape) != _full_shape(owner)):
            raise HealError(f"healing payload from {peer}: unexpected tensor {key!r} {tuple(t.shape)}")
        if not t.is_floating_point():  # optimizer moments and step counts are floats here
            raise HealError(f"healing payload from {peer}: {key!r} is {t.dtype}, not a floating-point state")
    elif tuple(t.shape) != _full_shape(entry) or t.dtype != entry[0].dtype:
        raise HealError(f"healing payload from {peer}: {key!r} is {t.dtype} {tuple(t.shape)}, this model has "
                        f"{entry[0].dtype} {_full_shape(entry)}")


# ------------------------------------------------------------ what a heal copies
@dataclass
class Replica:
    """The replica a heal reads from or writes to."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    units: list[Unit]


def collect_state(replica: Replica, outer: OuterState | None, rule_tensors: dict[str, Tensor]) -> LocalState:
    """The outer state and rule statistics in the local-SGD phase (`outer` given); the replica and its
    inner optimizer during ddp / the synchronous warm-up."""
    local: LocalState = {}
    if outer is not None:
        index = {u.name: u for u in replica.units}
        for key, t in outer.state_dict().items():
            unit, _, i = key.rsplit("/", 2)
            local[f"outer/{key}"] = (t, index[unit].params[int(i)] if t.dim() > 0 else None)
        for key, t in rule_tensors.items():
            local[f"penalty/{key}"] = (t, None)
        return local
    for name, p in replica.model.named_parameters():
        local[f"param/{name}"] = (_local(p.data), p)
    if replica.optimizer is not None:
        names = {id(p): n for n, p in replica.model.named_parameters()}
        for p, st in replica.optimizer.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    local[f"optim/{names[id(p)]}/{k}"] = (_local(v), p) if v.dim() > 0 else (v.detach().reshape(()), None)
    return local


def prefixed(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


@torch.no_grad()
def adopt_outer(replica: Replica, outer: OuterState, tensors: dict[str, Tensor], feedback: Residuals) -> None:
    """A healer in the local-SGD phase re-bases on the received anchor, keeping its local progress."""
    old = {u.name: [a.detach().clone() for a in outer.anchors[u.name]] for u in replica.units}
    try:
        outer.load_state_dict(prefixed(tensors, "outer/"))
    except ValueError as exc:
        raise HealError(f"healing: {exc}") from None
    # this rank's error-feedback residuals were what it owed the old anchor's syncs: a re-based cluster
    # starts them empty (a peer's residuals are that peer's debt, so they are not copied either)
    feedback.clear()
    for u in replica.units:
        rebase(u.live(), outer.anchors[u.name], old[u.name])


def step_device(optimizer: torch.optim.Optimizer, param: Tensor) -> torch.device:
    """Where torch keeps an optimizer's ``step`` counter: on the parameter's device for a fused or capturable
    optimizer (its kernels read it there), else on the CPU."""
    fast = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return param.device if fast else torch.device("cpu")


@torch.no_grad()
def adopt_replica(replica: Replica, tensors: dict[str, Tensor]) -> None:
    """A healer during ddp / warm-up copies the replica and its inner optimizer."""
    params = dict(replica.model.named_parameters())
    for key, v in tensors.items():
        if key.startswith("param/") and key[6:] in params:
            _local(params[key[6:]].data).copy_(v)
        elif key.startswith("optim/") and replica.optimizer is not None:
            name, _, field = key[6:].rpartition("/")
            if name not in params:
                continue
            st = replica.optimizer.state[params[name]]
            if field == "step":
                st[field] = v.to(device=step_device(replica.optimizer, params[name]), dtype=torch.float32).clone()
            elif field in st:
                _local(st[field]).copy_(v)
