"""Turn the user's `Config` into the algorithm core's own config objects (the core knows no Hydra)."""

from __future__ import annotations

from torch import nn

from edit_train.config import Config
from edit_train.dist.comm import CrossGroupComm, LinkModel
from edit_train.dist.mesh import Topology, fsdp_units
from edit_train.local_sgd.algorithms import LocalSGD, LocalSGDConfig
from edit_train.local_sgd.schedule import ScheduleConfig
from edit_train.train.metrics import MetricsLogger


def local_sgd_config(cfg: Config) -> LocalSGDConfig:
    a = cfg.algo
    schedule = ScheduleConfig(kind=a.schedule, interval=a.interval, warmup_steps=a.warmup_steps,
                              sync_time_s=a.sync_time_s, min_steps=a.min_steps)
    return LocalSGDConfig(local_sgd=a.local_sgd, schedule=schedule, outer=a.outer, penalty=a.penalty,
                          mode=cfg.sync.mode, prefetch=cfg.sync.prefetch, total_steps=cfg.train.steps,
                          time_budget_s=cfg.train.time_budget_s, eval_every=cfg.train.eval_every)


def build_algorithm(cfg: Config, model: nn.Module, topo: Topology, metrics: MetricsLogger) -> LocalSGD:
    link = LinkModel(cfg.cluster.link.bandwidth_mbps, cfg.cluster.link.latency_ms)
    comm = CrossGroupComm(topo.sync_pg, topo.groups, topo.device, link)
    return LocalSGD(local_sgd_config(cfg), model, fsdp_units(model), comm, topo.group_index,
                    topo.shard_pg, topo.shard_size, emit=metrics.log, is_group_leader=topo.is_group_leader)
