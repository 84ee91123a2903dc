"""Turn the user's `Config` into the algorithm core's own config objects (the core knows no Hydra)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from edit_train.cluster.mesh import Topology, fsdp_units
from edit_train.config import (ClusterSpec, Config, ConfigError, FederationConfig, cluster_specs, outer_step,
                               to_container)
from edit_train.fields import check_host_here
from edit_train.codec.dense import CompressionConfig
from edit_train.data.tokenizer import tokenizer_id
from edit_train.federation import auth, heal
from edit_train.federation.link import LinkModel
from edit_train.federation.registry import TransportRequest, make_transport
from edit_train.local_sgd.sync.algorithms import LocalSGD, LocalSGDConfig
from edit_train.local_sgd.moe.experts import RoutedCounts
from edit_train.local_sgd.moe.expert_bias import BiasHook
from edit_train.local_sgd.protocols import Transport
from edit_train.local_sgd.sync.membership import MembershipConfig
from edit_train.local_sgd.sync.schedule import ScheduleConfig, lr_boundaries
from edit_train.local_sgd.aggregation.scale import LrShape
from edit_train.train.lr import lr_at
from edit_train.train.metrics import MetricsLogger
from edit_train.train.progress import restart_count

if TYPE_CHECKING:
    from edit_train.federation.signed import Credentials

log = logging.getLogger(__name__)


def fingerprint(cfg: Config, tokenizer: str | None = None) -> str:
    """What every cluster of a federation must agree on, as `part=value` words the refusal can name: the model,
    algorithm core, sync mode and chunking (one hash), and the content of this cluster's tokenizer (default
    data.tokenizer; its data source is its own). A cluster whose fingerprint differs from the majority's refuses
    itself (local_sgd/aggregation/claims.py), so a site with another tokenizer stops, not the others."""
    c = to_container(cfg)
    keep = {"model": c["model"], "algo": c["algo"], "chunks": c["federation"]["chunks"], "mode": c["sync"]["mode"]}
    if cfg.algo.outer.unset:  # the outer step the default by cluster count chose: clusters configured alike agree
        keep["algo"]["outer"] = dataclasses.asdict(outer_step(cfg).config)
    keep["model"].pop("init_from", None)
    keep["model"].pop("loss_chunk", None)  # how the loss is computed, not what: clusters may differ
    if boundaries := sync_boundaries(cfg):  # syncs that follow the lr: where they go, from train's lr schedule
        keep["boundaries"] = list(boundaries)
    digest = hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]
    return f"model/algo/sync={digest} tokenizer={tokenizer_id(tokenizer or cfg.data.tokenizer)}"


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
    return ClusterSpec(name, int(os.environ.get("WORLD_SIZE", "1")), joiner_index(cfg, specs, name), 1.0)


def joiner_index(cfg: Config, specs: list[ClusterSpec], name: str) -> int:
    """The index of cluster `name`, added to a running federation without being in its configured list: after
    the configured clusters, in the order the operator added clusters to the roster (`Roster.added`; a removed
    one keeps its place, so no two clusters ever share an index). Without a roster nothing orders the clusters
    that join: refused in one line."""
    configured = [s.name for s in specs]
    creds = credentials(cfg, name)
    if creds is None:
        raise ConfigError(f"cluster {name} is not one of the configured clusters ({', '.join(configured)}) and the "
                          "federation has no roster to give it an index of its own: list it in cluster.clusters, or "
                          f"add it to the roster (edit-train-keygen add DIR {name}) and start it with "
                          "federation.roster_file and federation.identity_file")
    roster = creds.roster
    added = [n for n in roster.added if n not in configured]
    others = sorted(n for n in roster.clusters if n not in configured and n not in added)  # on it from the start
    return len(specs) + (added + others).index(name)


def own_tokenizer(cfg: Config, name: str) -> str | None:
    """Cluster `name`'s own tokenizer (cluster.clusters[i].data.tokenizer), None when it uses data.tokenizer."""
    return next((s.tokenizer for s in cluster_specs(cfg) if s.name == name), "") or None


def local_sgd_config(cfg: Config, tokens_per_step: int = 0, tokenizer: str | None = None,
                     roster: str = "") -> LocalSGDConfig:
    """The core's config; `tokenizer`: this cluster's own (cluster.clusters[i].data.tokenizer), if it has one;
    `roster`: where the federation's terms came from (this cluster's config was checked against it)."""
    a = cfg.algo
    schedule = ScheduleConfig(kind=a.schedule, interval=a.interval, warmup_steps=a.warmup_steps,
                              sync_time_s=a.sync_time_s, min_steps=a.min_steps, boundaries=sync_boundaries(cfg))
    membership = MembershipConfig(fingerprint=fingerprint(cfg, tokenizer),
                                  expected=tuple(s.name for s in cluster_specs(cfg)),
                                  quorum_timeout_s=cfg.federation.quorum_timeout_s,
                                  join_timeout_s=cfg.federation.join_timeout_s, restarted=restart_count() > 0,
                                  authoritative=bool(roster),
                                  terms_source=roster or "this cluster's configuration")
    return LocalSGDConfig(local_sgd=a.local_sgd, schedule=schedule, outer=outer_step(cfg).config, rule=a.rule,
                          mode=cfg.sync.mode, prefetch=cfg.sync.prefetch, total_steps=cfg.train.steps,
                          time_budget_s=cfg.train.time_budget_s, eval_every=cfg.train.eval_every,
                          checkpoint_every=cfg.checkpoint.every,
                          membership=membership, shares_loss=cfg.train.spike_factor > 0,
                          tokens_per_step=tokens_per_step, gather_max=cfg.sync.gather_max,
                          max_tokens_per_step=max_tokens_per_step(cfg),
                          lr_shape=LrShape(cfg.train.lr_warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio),
                          expert_bias=a.expert_bias)


def sync_boundaries(cfg: Config) -> tuple[int, ...]:
    """algo.interval_power > 0: where a step schedule's syncs go, from this run's lr schedule (`fingerprint`
    holds them: every cluster must sync at the same steps); () for every algo.interval steps."""
    a, t = cfg.algo, cfg.train
    if not (a.local_sgd and a.schedule == "step" and a.interval_power > 0):
        return ()
    lrs = [lr_at(s, t.lr, t.steps, t.lr_warmup_steps, t.min_lr_ratio) for s in range(t.steps)]
    return lr_boundaries(lrs, a.warmup_steps, a.interval, a.interval_power)


def max_tokens_per_step(cfg: Config) -> int:
    """The most tokens any configured cluster takes per step: what another cluster's claimed tokens are bounded
    by (its local steps x this)."""
    t = cfg.train
    return max((((s.batch_size or t.batch_size) * s.ranks) * t.seq_len * t.grad_accum for s in cluster_specs(cfg)),
               default=0)


KEY_REFUSED_GRACE_S = 20.0  # past the grace window: how long a gate may refuse our key before this cluster stops


def key_refused_after_s(f: FederationConfig) -> float:
    """How long a gate may answer nothing but "unknown key" before this cluster stops (worker and key check)."""
    return f.join_timeout_s + KEY_REFUSED_GRACE_S


def key_source(key_file: str) -> str:
    """Where this cluster's federation key came from, as a user would look for it."""
    if key_file:
        return f"federation.key_file={key_file}"
    env = os.environ.get(auth.KEY_ENV, "")
    return f"{auth.KEY_ENV}={env}" if env else "no key file: the insecure public key"


def credentials(cfg: Config, name: str) -> Credentials | None:
    """This cluster's identity and the federation's roster (None: no roster configured), with this cluster's
    configuration checked against what the roster says the federation is (one line at start otherwise)."""
    from edit_train.federation.signed import load_credentials

    f = cfg.federation
    try:
        creds = load_credentials(f.identity_file, f.roster_file, name)
    except auth.KeyFileError as exc:
        raise ConfigError(str(exc)) from None
    if creds is None:
        return None
    r, mine = creds.roster, (fingerprint(cfg, own_tokenizer(cfg, name)), cfg.train.steps, cfg.algo.name)
    for what, theirs, ours in zip(("configuration fingerprint", "train.steps", "algo"),
                                  (r.fingerprint, r.total_steps, r.algorithm), mine):
        if theirs != ours:
            raise ConfigError(f"cluster {name}: the roster (federation.roster_file) says the federation runs "
                              f"{what} {theirs!r}, this cluster {ours!r}: start it with the federation's config")
    return creds


def pairing_warning(cfg: Config) -> str | None:
    """A line for a pairing the benchmarks measured as costly and a user may not expect: Muon inner steps with
    sparse top-k pseudo-gradients (docs/compression.md, "With Muon inner steps")."""
    if cfg.train.optimizer == "muon" and cfg.sync.compression == "topk":
        return ("train.optimizer=muon with sync.compression=topk: measured at 1.20-1.29 x the uncompressed loss "
                "(AdamW: 0.97 x at the defaults; docs/compression.md); the top-k loss ratios edit-train plan uses are "
                "AdamW's")
    return None


def build_transport(cfg: Config, topo: Topology, federated: bool, creds: Credentials | None = None) -> Transport:
    """This rank's cross-cluster transport, the one `sync.transport` names (default: torchft's Lighthouse and gloo
    lanes bound to this host's address); `creds`: this cluster's identity and the roster."""
    f = cfg.federation
    lighthouse = f.lighthouse or os.environ.get("EDIT_TRAIN_LIGHTHOUSE") or None
    if federated and lighthouse is None and cfg.sync.transport == "lighthouse":
        raise ConfigError("federation.lighthouse: this cluster is part of a federation but no Lighthouse address "
                          "is set; run `edit-train` (it starts one) or pass federation.lighthouse=HOST:PORT")
    host = os.environ.get("EDIT_TRAIN_HOST") or f.host
    if federated:
        check_host_here("federation.host", host)  # one line, exit 2, before anything binds it
    try:
        key = auth.resolve(f.key_file, f.insecure, [lighthouse or "", host]) if federated else auth.INSECURE
    except auth.KeyFileError as exc:
        raise ConfigError(str(exc)) from None
    if federated and creds is None and key != auth.INSECURE:
        log.warning("cluster %s: no roster (federation.roster_file): any holder of the federation key can speak "
                    "for any cluster; `edit-train-keygen federation DIR` makes a roster and identities", topo.name)
    if federated and topo.is_leader and (line := pairing_warning(cfg)):
        log.warning("cluster %s: %s", topo.name, line)
    request = TransportRequest(name=topo.name, cluster=topo.group, federated=federated, lighthouse=lighthouse,
                               host=host, chunks=f.chunks,
                               link=LinkModel(cfg.cluster.link.bandwidth_mbps, cfg.cluster.link.latency_ms),
                               quorum_timeout_s=f.quorum_timeout_s, collective_timeout_s=f.collective_timeout_s,
                               compression=CompressionConfig.of(cfg.sync), key=key, key_source=key_source(f.key_file),
                               refuse_after_s=key_refused_after_s(f), credentials=creds)
    try:
        return make_transport(cfg.sync.transport, request)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build_algorithm(cfg: Config, model: nn.Module, topo: Topology, metrics: MetricsLogger,
                    optimizer: torch.optim.Optimizer | None = None, federated: bool = True,
                    span: Callable[[str], AbstractContextManager[Any]] | None = None, tokens_per_step: int = 0,
                    probe_loss: Callable[[], float] | None = None,
                    wrap_transport: Callable[[Transport], Transport] | None = None,
                    routed_counts: RoutedCounts | None = None, bias_hook: BiasHook | None = None) -> LocalSGD:
    """The algorithm of this rank: its transport (`wrap_transport`: the trainer's simulation hooks, which wrap it
    when a Byzantine fault is configured for this cluster, sim/byzantine.py), the probe of each update's
    usefulness, the core's config."""
    creds = credentials(cfg, topo.name) if federated else None
    transport: Any = build_transport(cfg, topo, federated, creds)
    if wrap_transport is not None:
        transport = wrap_transport(transport)
    roster = f"the roster (federation.roster_file, version {creds.roster.version})" if creds is not None else ""
    return LocalSGD(local_sgd_config(cfg, tokens_per_step, own_tokenizer(cfg, topo.name), roster), model,
                    fsdp_units(model), transport,
                    (heal.encode, heal.decode), emit=metrics.log, cluster_index=topo.index,
                    optimizer=optimizer, span=span or (lambda _n: nullcontext()), probe_loss=probe_loss,
                    routed_counts=routed_counts, bias_hook=bias_hook)
