"""Turn the user's `Config` into the algorithm core's own config objects (the core knows no Hydra)."""

from __future__ import annotations

import hashlib
import json
import os
import zlib

import torch
from torch import nn

from edit_train.cluster.mesh import Topology, fsdp_units
from edit_train.config import ClusterSpec, Config, ConfigError, cluster_specs, to_container
from edit_train.federation.comm import FederationComm
from edit_train.federation.compress import CompressionConfig
from edit_train.federation.link import LinkModel
from edit_train.local_sgd.algorithms import LocalSGD, LocalSGDConfig
from edit_train.local_sgd.schedule import ScheduleConfig
from edit_train.train.metrics import MetricsLogger


def fingerprint(cfg: Config) -> str:
    """What every cluster of a federation must agree on (model, algorithm core, chunking)."""
    c = to_container(cfg)
    keep = {"model": c["model"], "algo": c["algo"], "chunks": c["federation"]["chunks"], "mode": c["sync"]["mode"]}
    keep["model"].pop("init_from", None)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def my_cluster(cfg: Config, specs: list[ClusterSpec]) -> ClusterSpec:
    """This job's cluster: EDIT_TRAIN_CLUSTER (set by our launchers) or cluster.only, else the only one."""
    name = os.environ.get("EDIT_TRAIN_CLUSTER") or cfg.cluster.only
    if not name:
        if len(specs) == 1:
            return specs[0]
        raise ConfigError(f"this job does not know which of the clusters {[s.name for s in specs]} it is: set "
                          "EDIT_TRAIN_CLUSTER=<name> (torchrun/Slurm) or cluster.only=<name>")
    for s in specs:
        if s.name == name:
            return s
    # a cluster that joins a running federation without being in its list: its own data part by name
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    return ClusterSpec(name, ranks, zlib.crc32(name.encode()) % max(len(specs), 1), 1.0)


def local_sgd_config(cfg: Config) -> LocalSGDConfig:
    a = cfg.algo
    schedule = ScheduleConfig(kind=a.schedule, interval=a.interval, warmup_steps=a.warmup_steps,
                              sync_time_s=a.sync_time_s, min_steps=a.min_steps)
    return LocalSGDConfig(local_sgd=a.local_sgd, schedule=schedule, outer=a.outer, penalty=a.penalty,
                          mode=cfg.sync.mode, prefetch=cfg.sync.prefetch, total_steps=cfg.train.steps,
                          time_budget_s=cfg.train.time_budget_s, eval_every=cfg.train.eval_every,
                          fingerprint=fingerprint(cfg), expected=tuple(s.name for s in cluster_specs(cfg)),
                          start_timeout_s=cfg.federation.quorum_timeout_s, regroup_s=cfg.federation.join_timeout_s,
                          shares_loss=cfg.train.spike_factor > 0)


def build_algorithm(cfg: Config, model: nn.Module, topo: Topology, metrics: MetricsLogger,
                    optimizer: torch.optim.Optimizer | None = None, federated: bool = True) -> LocalSGD:
    f = cfg.federation
    link = LinkModel(cfg.cluster.link.bandwidth_mbps, cfg.cluster.link.latency_ms)
    lighthouse = f.lighthouse or os.environ.get("EDIT_TRAIN_LIGHTHOUSE") or None
    if federated and lighthouse is None:
        raise ConfigError("federation.lighthouse: this cluster is part of a federation but no Lighthouse address "
                          "is set; run `edit-train` (it starts one) or pass federation.lighthouse=HOST:PORT")
    comm = FederationComm(topo.name, topo.rank, topo.world_size, topo.shard_pg, topo.device,
                          lighthouse=lighthouse if federated else None,
                          host=os.environ.get("EDIT_TRAIN_HOST") or f.host, chunks=f.chunks, link=link,
                          quorum_timeout_s=f.quorum_timeout_s, collective_timeout_s=f.collective_timeout_s,
                          compression=CompressionConfig(cfg.sync.compression, cfg.sync.block_size,
                                                        cfg.sync.scale_dtype, cfg.sync.error_feedback))
    return LocalSGD(local_sgd_config(cfg), model, fsdp_units(model), comm, topo.shard_pg, topo.shard_size,
                    emit=metrics.log, is_group_leader=topo.is_group_leader, group_index=topo.group_index,
                    optimizer=optimizer)
