"""Topology: the 2-D `(group, shard)` device mesh and FSDP2 wrapping.

A *worker group* (one model replica, one cluster in production) is the ranks sharing a `group` index;
it shards the model with FSDP2 over the `shard` dim. The *sync group* of a rank is the ranks with the
same `shard` index: cross-group collectives run there, each rank moving only its own shard.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)


class TopologyError(ValueError):
    """World size / cluster shape mismatch (a user-fixable launch error)."""


@dataclass
class Topology:
    world_size: int
    rank: int
    groups: int
    shard_size: int
    device: torch.device
    backend: str | None
    mesh: Any = None  # DeviceMesh with dims ("group", "shard"), None when world_size == 1

    @property
    def group_index(self) -> int:
        return self.rank // self.shard_size

    @property
    def shard_rank(self) -> int:
        return self.rank % self.shard_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_group_leader(self) -> bool:
        return self.shard_rank == 0

    @property
    def shard_pg(self) -> dist.ProcessGroup | None:
        """Intra-group process group (the ranks of this rank's worker group)."""
        return self.mesh.get_group("shard") if self.mesh is not None else None

    @property
    def sync_pg(self) -> dist.ProcessGroup | None:
        """Cross-group process group (same shard index in every group)."""
        return self.mesh.get_group("group") if self.mesh is not None else None


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


def check_shape(world_size: int, groups: int, shard_size: int) -> None:
    if groups * shard_size != world_size:
        raise TopologyError(
            f"cluster.groups ({groups}) x cluster.shard_size ({shard_size}) = {groups * shard_size} "
            f"but the world has {world_size} processes; launch groups*shard_size processes "
            f"or change cluster.groups / cluster.shard_size")


def init_topology(groups: int, shard_size: int, device: str = "auto", backend: str = "auto",
                  timeout_s: float = 600.0) -> Topology:
    """Initialise torch.distributed from the torchrun environment (if any) and build the mesh."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    check_shape(world_size, groups, shard_size)
    dev = pick_device(device)
    if world_size == 1:
        return Topology(1, 0, groups, shard_size, dev, None)
    be = pick_backend(dev, backend)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        device_id = dev if dev.type == "cuda" else None
        if "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ:
            # Under an elastic agent the store outlives a failed round, and a restarted round would read
            # the dead round's keys (gloo then dials the old ranks). Every worker of a round bumps one
            # counter once, so all of them derive the same round number and a namespace of their own —
            # whether the agent counted it as a restart or (c10d) as a membership change.
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                 is_master=rank == 0 and not agent_store, timeout=timeout)
            round_ = (base.add("edit-train/workers", 1) - 1) // world_size
            store = dist.PrefixStore(f"edit-train/round_{round_}", base)
            dist.init_process_group(backend=be, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=device_id)
        else:
            dist.init_process_group(backend=be, timeout=timeout, device_id=device_id)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (groups, shard_size), mesh_dim_names=("group", "shard"))
    log.info("rank %d: group %d shard %d backend %s", rank, rank // shard_size, rank % shard_size, be)
    return Topology(world_size, rank, groups, shard_size, dev, be, mesh)


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
    """Apply FSDP2 `fully_shard` over the `shard` dim: each decoder layer, the embeddings and the head
    its own unit, the root owning the rest. Every group is an independent replica; whatever crosses
    groups (ddp's gradients, local SGD's pseudo-gradients) goes through `dist.comm.CrossGroupComm`.
    """
    if not topo.distributed or topo.shard_size == 1:
        return model  # one rank per group: nothing to shard, and FSDP's per-unit hooks would only cost time
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": topo.mesh["shard"]}
    if mp_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    for unit in fsdp_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a (possibly DTensor) parameter or state tensor."""
    return t.to_local() if hasattr(t, "to_local") else t
