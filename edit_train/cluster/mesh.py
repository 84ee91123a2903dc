"""Topology of one cluster: its ranks shard one model replica with FSDP2 over fast links.

A cluster is an independent job (its own torchrun / local launcher / Slurm job and rendezvous); no
torch.distributed world ever spans two clusters. What crosses clusters goes through
`edit_train.federation` (torchft quorum + reconfigurable gloo process groups).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from edit_train.cluster.group import RankGroup

log = logging.getLogger(__name__)


class TopologyError(ValueError):
    """World size / cluster shape mismatch (a user-fixable launch error)."""


@dataclass
class Topology:
    """This rank's place in its cluster. `index` is the cluster's index in the federation's
    configured list (data partition, slowdown, faults); `name` its federation-wide name."""

    ranks: int  # how many ranks this cluster has (its size: `cluster.ranks`, `ClusterGroup.size`)
    rank: int  # rank inside the cluster
    name: str
    index: int
    device: torch.device
    backend: str | None
    mesh: Any = None  # 1-D DeviceMesh ("shard",), None when the cluster has one rank
    timeout_s: float = 600.0  # every collective inside the cluster ends by then (cluster.timeout_s)

    @property
    def distributed(self) -> bool:
        return self.ranks > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def shard_pg(self) -> dist.ProcessGroup | None:
        """The cluster's process group (its fast links)."""
        return self.mesh.get_group("shard") if self.mesh is not None else None

    @functools.cached_property
    def group(self) -> RankGroup:
        """The cluster's ranks, for what they do together (agree, sum, broadcast)."""
        return RankGroup(self.shard_pg, self.rank, self.ranks, self.device, self.timeout_s)


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TopologyError("train.device=cuda but no CUDA device is available; use train.device=auto")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def pick_backend(device: torch.device, requested: str = "auto") -> str:
    if requested != "auto":
        if requested == "nccl" and device.type != "cuda":
            raise TopologyError("cluster.backend=nccl needs CUDA devices; use cluster.backend=auto")
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def check_shape(world_size: int, ranks: int, name: str) -> None:
    if ranks != world_size:
        raise TopologyError(
            f"cluster {name!r} is configured with {ranks} rank(s) but its job has {world_size} process(es); "
            f"launch {ranks} process(es) for it (torchrun --nproc-per-node / nnodes) or change its ranks")


_LISTENERS: list[socket.socket] = []


def bound_store(host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta,
                ) -> dist.TCPStore:
    """A TCPStore whose server listens on `host` only (TCPStore's own server binds every interface;
    handing it a socket we bound ourselves keeps a local run on 127.0.0.1)."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    store = dist.TCPStore(host, sock.getsockname()[1], world_size, True, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    _LISTENERS.append(sock)  # the store serves on this socket's fd: keep it open for the process's life
    return store


def init_topology(name: str, index: int, ranks: int, device: str = "auto", backend: str = "auto",
                  timeout_s: float = 600.0) -> Topology:
    """Initialise this cluster's torch.distributed world from the launcher's environment and its mesh."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    check_shape(world_size, ranks, name)
    dev = pick_device(device)
    if world_size == 1:
        return Topology(1, 0, name, index, dev, None)
    be = pick_backend(dev, backend)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        device_id = dev if dev.type == "cuda" else None
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # Under an elastic agent the store outlives a failed round, and a restarted round would read
            # the dead round's keys (gloo then dials the old ranks). Every worker of a round bumps one
            # counter once, so all of them derive the same round number and a namespace of their own.
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            base = dist.TCPStore(addr, port, world_size, is_master=rank == 0 and not agent_store, timeout=timeout)
            round_ = (base.add("edit-train/workers", 1) - 1) // world_size
            store: dist.Store = dist.PrefixStore(f"edit-train/round_{round_}", base)
        else:  # our local launcher: rank 0 hosts the store on MASTER_ADDR only
            store = bound_store(addr, port, world_size, rank == 0, timeout)
        dist.init_process_group(backend=be, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device_id)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world_size,), mesh_dim_names=("shard",))
    log.info("cluster %s rank %d/%d backend %s", name, rank, world_size, be)
    return Topology(world_size, rank, name, index, dev, be, mesh, timeout_s)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units, in forward order (the root, which owns
    the rest, is wrapped after them by `parallelize`)."""
    units: list[nn.Module] = []
    tied = getattr(getattr(model, "lm_head", None), "weight", None) is getattr(
        getattr(model, "word_embeddings", None), "weight", object())
    if hasattr(model, "word_embeddings") and not tied:
        units.append(model.word_embeddings)
    units.extend(getattr(model, "layers", []))
    if hasattr(model, "lm_head") and not tied:
        units.append(model.lm_head)
    return units


def parallelize(model: nn.Module, topo: Topology, mp_dtype: torch.dtype | None = None) -> nn.Module:
    """Apply FSDP2 `fully_shard` over the cluster's ranks: each decoder layer, the embeddings and the
    head its own unit, the root owning the rest. Whatever crosses clusters goes through the federation."""
    if not topo.distributed:
        return model  # one rank: nothing to shard, and FSDP's per-unit hooks would only cost time
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": topo.mesh}
    if mp_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    for unit in fsdp_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model

