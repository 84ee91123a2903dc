"""Healing inside a sync: members behind the newest anchor copy the federation's state from a live peer.

The source (the first member holding the newest anchor) gathers full tensors over its fast links, its
leader sends one payload (safetensors + JSON, `federation.heal`) to each healer's leader over lane 0,
and every rank of a healer takes its own FSDP shard of each tensor. A failed transfer changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from edit_train.federation.comm import FederationComm
from edit_train.cluster.mesh import local_tensor
from edit_train.federation.heal import HealError, decode, encode, local_slice
from edit_train.federation.link import FederationError
from edit_train.federation.quorum import Membership

if TYPE_CHECKING:
    from edit_train.local_sgd.algorithms import LocalSGD

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
        if not self.comm.agree(ok):
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


# ------------------------------------------------------------ what a heal copies
def collect_state(algo: LocalSGD) -> tuple[dict[str, Any], LocalState]:
    """What a source sends: the outer state (anchor, momentum) and penalty statistics in the local-SGD
    phase; the replica and its inner optimizer during ddp / the synchronous warm-up."""
    meta: dict[str, Any] = {"sync_index": algo.sync_index, "total_steps": algo.total_steps,
                            "global_step": algo.global_step, "roster": list(algo.aggregator.roster),
                            "local_phase": algo.engine is not None}
    local: LocalState = {}
    if algo.engine is not None:
        for key, t in algo.engine.outer.state_dict().items():
            unit, kind, i = key.rsplit("/", 2)
            param = algo.units[algo.engine.index[unit]].params[int(i)]
            local[f"outer/{key}"] = (t, param if t.dim() > 0 else None)
        for key, t in algo.aggregator.state_tensors().items():
            local[f"penalty/{key}"] = (t, None)
    else:  # ddp / warm-up: the replica itself and its inner optimizer
        for name, p in algo.model.named_parameters():
            local[f"param/{name}"] = (local_tensor(p.data), p)
        if algo.optimizer is not None:
            names = {id(p): n for n, p in algo.model.named_parameters()}
            for p, st in algo.optimizer.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        local[f"optim/{names[id(p)]}/{k}"] = (local_tensor(v), p)
                    elif isinstance(v, torch.Tensor):
                        local[f"optim/{names[id(p)]}/{k}"] = (v.detach().reshape(()), None)
    return meta, local


@torch.no_grad()
def apply_state(algo: LocalSGD, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """A healer re-bases on what it received, keeping its local progress."""
    if meta.get("local_phase") and algo.engine is None:
        algo._start_local_phase()
    if algo.engine is not None and meta.get("local_phase"):
        outer = algo.engine.outer
        old = {u.name: [a.detach().clone() for a in outer.anchors[u.name]] for u in algo.units}
        outer.load_state_dict({k[len("outer/"):]: v for k, v in tensors.items() if k.startswith("outer/")})
        algo.aggregator.load(meta.get("roster", []),
                             {k[len("penalty/"):]: v for k, v in tensors.items() if k.startswith("penalty/")})
        # this rank's error-feedback residuals were what it owed the old anchor's syncs: a re-based cluster
        # starts them empty (a peer's residuals are that peer's debt, so they are not copied either)
        algo.comm.feedback.clear()
        for u in algo.units:  # θ ← θ̄_new + (θ − θ̄_old): local progress is kept
            for p, a_old, a_new in zip(u.live(), old[u.name], outer.anchors[u.name]):
                p.sub_(a_old.to(p.device, p.dtype)).add_(a_new.to(p.device, p.dtype))
                if not torch.isfinite(p).all():
                    p.copy_(a_new)
    else:
        params = dict(algo.model.named_parameters())
        for key, v in tensors.items():
            if key.startswith("param/"):
                local_tensor(params[key[6:]].data).copy_(v)
            elif key.startswith("optim/") and algo.optimizer is not None:
                name, _, field = key[6:].rpartition("/")
                p = params[name]
                st = algo.optimizer.state[p]
                if field == "step":
                    st[field] = v.to(torch.float32).clone()
                elif field in st:
                    local_tensor(st[field]).copy_(v)
    algo.sync_index = int(meta.get("sync_index", algo.sync_index))
    if algo._joining or algo.total_steps == 0 or algo.lockstep:
        # lockstep schedules end at train.steps on every cluster: a cluster that healed (restarted, joined
        # late, or ran ahead/behind while cut off) continues from the federation's step
        algo.adopt_step = int(meta.get("total_steps", 0))
        algo.total_steps = algo.adopt_step
        algo.global_step = max(algo.global_step, int(meta.get("global_step", 0)))

