"""Healing inside a sync: members behind the newest anchor copy the federation's state from a live peer.

The source (the first member holding the newest anchor) gathers full tensors over its fast links, its
leader sends one payload (safetensors + JSON, `federation.heal`) to each healer's leader over lane 0,
and every rank of a healer takes its own FSDP shard of each tensor. A failed transfer changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from edit_train.federation.comm import FederationComm
from edit_train.federation.heal import HealError, decode, encode, local_slice
from edit_train.federation.link import FederationError
from edit_train.federation.quorum import Membership

log = logging.getLogger(__name__)

# name -> (this rank's local tensor, the parameter it shards like, or None when replicated)
LocalState = dict[str, tuple[Tensor, Tensor | None]]


class Healer:
    def __init__(self, comm: FederationComm, collect: Callable[[], tuple[dict[str, Any], LocalState]],
                 apply: Callable[[dict[str, Any], dict[str, Tensor]], None]) -> None:
        self.comm = comm
        self.collect = collect
        self.apply = apply

    def run(self, m: Membership) -> str | None:
        """Heal whoever is behind in `m`. Returns the source's name if this cluster healed."""
        behind = m.behind()
        if not behind:
            return None
        if m.me == m.source:
            self._send(m, behind)
            return None
        if m.me in behind:
            self._receive(m)
            return m.members[m.source].name
        return None

    def _send(self, m: Membership, behind: list[int]) -> None:
        meta, local = self.collect()
        full = {k: self.comm._full(t, like).detach().cpu() for k, (t, like) in local.items()}
        ok = True
        if self.comm.rank == 0:
            payload = encode({"from": self.comm.name, **meta}, full)
            for dst in behind:
                try:
                    self.comm.send_bytes(payload, dst)
                except FederationError as exc:
                    log.warning("cluster %s: healing %s failed: %s", self.comm.name, m.members[dst].name, exc)
                    ok = False
            log.info("cluster %s: sent state of sync %d (%.1f MB) to %s", self.comm.name, m.max_sync,
                     len(payload) / 1e6, [m.members[d].name for d in behind])
        if not self.comm._agree(ok):
            raise FederationError("healing a peer failed")

    def _receive(self, m: Membership) -> None:
        src = m.members[m.source].name
        payload: bytes | None = None
        if self.comm.rank == 0:
            try:
                payload = self.comm.recv_bytes(m.source)
            except FederationError as exc:
                log.warning("cluster %s: healing from %s failed: %s", self.comm.name, src, exc)
                payload = b""
        payload = self.comm.share_bytes(payload)
        if not payload:
            raise FederationError(f"healing from {src} failed")
        meta, tensors = decode(payload, peer=f"cluster {src}")
        _, local = self.collect()
        mine: dict[str, Tensor] = {}
        for k, t in tensors.items():
            like = local.get(k, (None, None))[0]
            mine[k] = local_slice(t, like, self.comm.rank, self.comm.size) if like is not None else t
        self.apply(meta, mine)
        log.info("cluster %s: healed from %s (sync %d)", self.comm.name, src, int(meta.get("sync_index", -1)))


__all__ = ["Healer", "HealError", "LocalState"]
