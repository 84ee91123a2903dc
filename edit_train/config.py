"""Structured configs for `edit-train`, registered in Hydra's ConfigStore, plus validation.

The dataclasses are the schema: a typo'd key or a wrong type on the command line fails in Hydra with
a message naming the key. `validate(cfg)` checks the cross-field rules Hydra cannot express.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from edit_train.codec.sparse_format import TOPK_BITS, TOPK_DENSITY, TOPK_GROUP
from edit_train.data.prepare import DEFAULT_VAL_FRACTION
from edit_train.fields import ConfigError, _check_cluster_name, _check_host, _check_finite, _need
from edit_train.local_sgd.sync.outer import OuterConfig
from edit_train.local_sgd.aggregation.rules import RuleConfig
from edit_train.model.config import ModelConfig


@dataclass
class RunConfig:
    dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    name: str = "demo"  # experiment name (W&B group)
    max_restarts: int = 0  # local launcher: restart a failed cluster job this many times (it heals from a peer)
    restart_delay_s: float = 2.0  # local launcher: wait this long before restarting a failed cluster


@dataclass
class DataConfig:
    source: str = "stdlib"  # "stdlib", text files (a file, directory or glob), .jsonl, .parquet, or token files
    tokenizer: str = "byte"  # "byte" or a path to a HF tokenizer.json (or a directory holding one)
    text_column: str = "text"  # the text field of .jsonl lines / the text column of .parquet files
    token_dtype: str | None = None  # uint16 | uint32: data.source is pre-tokenized token files of this dtype
    workers: int = 0  # processes tokenizing a corpus at once; 0 = every core this process may use
    cache_dir: str | None = None  # default: $EDIT_TRAIN_CACHE or ~/.cache/edit-train
    val_fraction: float = DEFAULT_VAL_FRACTION  # 0.02; edit-train-prepare's default too (same cache entry)
    seed: int = 0
    # shared: the clusters split `source` (or their own cluster.clusters[i].data.source); by_family: cluster i of
    # N trains on its standard-library families (data/families.py GROUPS) and every cluster validates on all;
    # by_language: cluster i of N trains on one language (data/languages.py GROUPS), validation on all four
    split: str = "shared"
    # how many parts the clusters sharing a source cut it into (0: one per configured cluster); the parts beyond
    # the configured clusters are kept for clusters added mid-run (edit-train-keygen add), in the order added
    parts: int = 0


@dataclass
class TrainConfig:
    steps: int = 420  # a_edit: the run is ceil((steps - algo.warmup_steps) / algo.interval) syncs (pacer.run_syncs)
    time_budget_s: float = 0.0  # > 0: also stop (at an agreed point) once this many seconds have passed
    batch_size: int = 16  # sequences per rank per micro-batch
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    lr_warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    optimizer: str = "adamw"  # adamw | muon (decoder-layer matrices and expert stacks; the rest AdamW: train/muon.py)
    muon_momentum: float = 0.95  # train.optimizer=muon: Muon's momentum
    grad_clip: float = 1.0
    precision: str = "fp32"  # fp32 | bf16 (FSDP2 bf16 params + fp32 reduce on sharded CUDA clusters, else autocast)
    activation_checkpointing: str = "none"  # none | full (every decoder layer) | moe (the MoE blocks only)
    compile: bool = False  # torch.compile each decoder layer
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0 = from the table of known GPUs (none on CPU)
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # intra-op threads per rank; 0 = the cores this job may use / training processes on the host
    progress: bool = True
    spike_factor: float = 3.0  # loss > factor x running mean is a spike (0 = off)
    spike_patience: int = 3  # consecutive spiking steps before the batch is skipped and re-queued
    spike_requeue_after: int = 50  # steps later the skipped batch is trained again


@dataclass
class AlgoConfig:
    name: str = "ddp"  # ddp | post_local_sgd | diloco | edit | a_edit
    local_sgd: bool = False  # False: gradients all-reduced across clusters every step (ddp)
    schedule: str = "step"  # step | time
    interval: int = 32  # local steps between syncs (schedule=step)
    # schedule=step: p > 0 puts the same number of syncs at equal quantiles of Σ lr^p (intervals ∝ 1/lr^p: short
    # while the lr is high, long as it decays; docs/algorithms.md "Intervals that follow the lr"); 0: every interval
    interval_power: float = 0.0
    warmup_steps: int = 0  # fully synchronous steps before local SGD starts
    sync_time_s: float = 10.0  # A-EDiT wall-clock budget tau (schedule=time)
    min_steps: int = 1
    # a Ling 2.0 router's aux-loss-free expert bias at a sync (local_sgd/moe/expert_bias.py, docs/noniid.md): mean (the
    # anchor's is the clusters' mean) | global (the update rule on the federation's summed load) | local (each
    # cluster keeps its own; the anchor and export carry the global one)
    expert_bias: str = "global"  # docs/noniid.md: why global
    outer: OuterConfig = field(default_factory=OuterConfig)
    rule: RuleConfig = field(default_factory=RuleConfig)


@dataclass
class SyncConfig:
    mode: str = "layerwise"  # layerwise | at_end | overlap
    prefetch: bool = True
    compression: str = "none"  # none | bf16 | int8 | fp8 | topk: pseudo-gradients on the cross-cluster link
    block_size: int = 256  # int8/fp8: values per absmax scale; topk: values per chunk (one scale each)
    scale_dtype: str = "fp32"  # fp32 | bf16 scales (counted in the bytes)
    error_feedback: bool = True  # keep what quantization dropped and add it to the next sync
    # β < 1: the kept residual decays by β per sync (error feedback as momentum); unset: 0.6 for topk, 1 otherwise
    error_feedback_decay: Optional[float] = None
    topk_density: float = TOPK_DENSITY  # topk: share of each chunk sent (round(density * block_size / g) groups)
    bits: int = TOPK_BITS  # topk: bits per sent value (1, 2, 4 or 8)
    topk_group: int = TOPK_GROUP  # topk: values selected together (a power of two <= 128 dividing block_size)
    unsent: str = "resend"  # topk: what top-k left out is resent later (resend) or kept in the cluster's params (keep)
    gather_max: int = 4  # up to this many clusters each may receive every contribution (0 = never; docs/sync_math.md)
    transport: str = "lighthouse"  # lighthouse | inproc | "package.module:factory" (federation/registry.py)


@dataclass
class LinkConfig:
    bandwidth_mbps: float = 0.0  # 0 = unlimited (no simulated WAN)
    latency_ms: float = 0.0


@dataclass
class ClusterConfig:
    name: str = "local"
    count: int = 1  # N equal clusters of `ranks` ranks each (named c0..cN-1), unless `clusters` lists them
    ranks: int = 1
    # [{name, ranks, slowdown, batch_size, device, data: {source, tokenizer}}]: clusters of any size, own data
    clusters: list[dict[str, Any]] = field(default_factory=list)
    only: str = ""  # start only this cluster (joins a federation whose Lighthouse is federation.lighthouse)
    slowdown: list[float] = field(default_factory=list)  # one factor >= 1 per cluster (simulated slower hardware)
    slowdown_schedule: list[dict[str, Any]] = field(default_factory=list)  # [{cluster, step, factor}] mid-run changes
    link: LinkConfig = field(default_factory=LinkConfig)
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 600.0  # a collective among this cluster's own ranks that takes longer fails (a rank died)


@dataclass
class SimConfig:
    # apply the simulated settings (cluster.slowdown, cluster.link, cluster.slowdown_schedule, faults) in a cluster
    # job of a real federation too; by default only a local run applies them (edit_train/sim/switch.py)
    force: bool = False


@dataclass
class FederationConfig:
    lighthouse: str = ""  # host:port of torchft's Lighthouse; "" = edit-train starts one for a local run
    min_clusters: int = 1  # a sync needs at least this many clusters
    join_timeout_s: float = 5.0  # grace window: how long a sync waits for live clusters that are late
    heartbeat_timeout_s: float = 5.0  # a cluster silent this long is left out of quorums
    quorum_timeout_s: float = 300.0  # give up (one-line error) when no quorum forms for this long
    collective_timeout_s: float = 30.0  # a cross-cluster collective or connection that takes longer fails
    chunks: int = 4  # a module's pseudo-gradient is cut into this many pieces across clusters of unequal size
    host: str = "127.0.0.1"  # address this rank binds cross-cluster traffic to (env EDIT_TRAIN_HOST overrides)
    key_file: str = ""  # the federation key (env EDIT_TRAIN_FEDERATION_KEY_FILE); a local run makes one per run
    insecure: bool = False  # run a federation across hosts without a key (anyone who reaches it can join)
    identity_file: str = ""  # this cluster's (or the gate's) Ed25519 identity, mode 0600 (env EDIT_TRAIN_IDENTITY_FILE)
    roster_file: str = ""  # the operator-signed roster (env EDIT_TRAIN_ROSTER_FILE); a local run makes both per run


@dataclass
class LoggerConfig:
    kind: str = "wandb"  # wandb | none
    project: str = "edit-train"
    entity: str | None = None
    mode: str | None = None  # online | offline | disabled; default offline unless a key is configured
    tags: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints (0 = only at the end)
    keep: int = 2
    at_end: bool = True


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: list[dict[str, Any]] = field(default_factory=list)
    sim: SimConfig = field(default_factory=SimConfig)
    resume: str = "false"  # false | auto (true is accepted as auto)
    seed: int = 0


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    ranks: int
    index: int  # position in the configured list (data partition, slowdown, faults)
    slowdown: float = 1.0
    batch_size: int = 0  # sequences per rank for this cluster (0: train.batch_size)
    device: str = ""  # auto | cpu | cuda for this cluster ("": train.device): a federation may mix devices
    source: str = ""  # this cluster's own training data (data.source of its `data`; "": the federation's)
    tokenizer: str = ""  # its tokenizer ("": data.tokenizer); must tokenize as data.tokenizer does


CLUSTER_FIELDS = ("name", "ranks", "slowdown", "batch_size", "device", "data")
CLUSTER_DATA_FIELDS = ("source", "tokenizer")


def _cluster_data(i: int, data: Any) -> tuple[str, str]:
    """(source, tokenizer) of `cluster.clusters[i].data` ("" where it does not set one)."""
    if data is None:
        return "", ""
    if not isinstance(data, Mapping) or set(data) - set(CLUSTER_DATA_FIELDS):
        raise ConfigError(f"cluster.clusters[{i}].data: must be a mapping of {', '.join(CLUSTER_DATA_FIELDS)}, got "
                          f"{data!r}")
    values = [data.get(k) or "" for k in CLUSTER_DATA_FIELDS]
    if not all(isinstance(v, str) for v in values):
        raise ConfigError(f"cluster.clusters[{i}].data: source and tokenizer must be strings, got {data!r}")
    return values[0], values[1]


def cluster_specs(cfg: Config) -> list[ClusterSpec]:
    """The federation's configured clusters: `cluster.clusters`, else `count` equal ones named c0…"""
    c = cfg.cluster
    if c.clusters:
        out = []
        for i, spec in enumerate(c.clusters):
            spec = dict(spec)
            unknown = set(spec) - set(CLUSTER_FIELDS)
            if unknown:
                raise ConfigError(f"cluster.clusters[{i}]: unknown field(s) {sorted(unknown)}; "
                                  f"use {', '.join(CLUSTER_FIELDS)}")
            device = str(spec.get("device", ""))
            if device not in ("", "auto", "cpu", "cuda"):
                raise ConfigError(f"cluster.clusters[{i}].device: must be auto, cpu or cuda, got {device!r}")
            try:
                ranks, slow = int(spec.get("ranks", 1)), float(spec.get("slowdown", 1.0))
                batch = int(spec.get("batch_size", 0))
            except (TypeError, ValueError):
                raise ConfigError(f"cluster.clusters[{i}]: ranks and batch_size must be integers and slowdown "
                                  "a number") from None
            if ranks < 1 or slow < 1.0 or batch < 0:
                raise ConfigError(f"cluster.clusters[{i}]: ranks must be >= 1, slowdown >= 1.0, batch_size >= 0")
            out.append(ClusterSpec(str(spec.get("name", f"c{i}")), ranks, i, slow, batch, device,
                                   *_cluster_data(i, spec.get("data"))))
        return out
    slow = list(c.slowdown) or [1.0] * c.count
    return [ClusterSpec(f"c{i}", c.ranks, i, float(slow[i]) if i < len(slow) else 1.0) for i in range(c.count)]


@dataclass(frozen=True)
class OuterStep:
    """The outer step a run uses (`outer_step`): the config with every field a number, and how it was chosen."""

    config: OuterConfig
    clusters: int  # the configured clusters the default was chosen for
    interval: int
    unset: tuple[str, ...]  # the fields that took the default by cluster count ("lr", "momentum"); () all named

    def record(self) -> dict[str, Any]:
        """What summary.json keeps of it (`outer`; the closing block says it: cli/train.py `outer_text`)."""
        o = self.config
        return {"optimizer": o.optimizer, "lr": o.lr, "momentum": o.momentum, "nesterov": o.nesterov,
                "default_for": list(self.unset), "clusters": self.clusters, "interval": self.interval}


def outer_step(cfg: Config) -> OuterStep:
    """The one place `algo.outer`'s unset (null) lr / momentum become numbers: the default by the number of
    configured clusters and the interval (`local_sgd/sync/outer.py: default_outer_step`; `algo=edit` leaves both unset).
    Everything that uses the outer step — the algorithm, the federation's fingerprint, validation, the summary —
    reads it from here; a value named on the command line or in a preset wins."""
    a = cfg.algo
    clusters, interval = max(len(cluster_specs(cfg)), 1), max(int(a.interval), 1)  # (validate refuses < 1 itself)
    return OuterStep(a.outer.resolved(clusters, interval), clusters, interval, a.outer.unset)


@functools.cache
def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (no group options: `algo=schema` etc. is not a choice), once
    per process (the store hands every compose a deep copy of it).

    In the schema `data.source` is mandatory (???): every `data` preset names its source, and `data=text`
    without `data.source` fails in one line instead of silently keeping the stdlib default (a `???` in a
    preset never overrides a value under it)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import MISSING, OmegaConf

    schema = OmegaConf.structured(Config)
    schema.data.source = MISSING
    ConfigStore.instance().store(name="config_schema", node=schema)


def _check_topk_keys(sync: SyncConfig) -> None:
    """A top-k key with a value top-k could never run (`sync.bits=3`, `sync.topk_density=2`) is refused whatever
    `sync.compression` is: with another compression it would be ignored without a word (a typo, or a top-k run
    meant but `sync.compression=topk` forgotten). Under top-k, CompressionConfig.validate checks the full format."""
    from edit_train.codec.sparse_format import BITS, MAX_GROUP

    if sync.compression == "topk":
        return
    unused = f"(a top-k setting: sync.compression={sync.compression} does not use it; drop it or set " \
             "sync.compression=topk)"
    d, b, g = sync.topk_density, sync.bits, sync.topk_group
    _need(not isinstance(d, bool) and isinstance(d, (int, float)) and 0 < d <= 1, "sync.topk_density",
          f"must be in (0, 1], got {d!r} {unused}")
    _need(not isinstance(b, bool) and b in BITS, "sync.bits", f"must be one of {BITS}, got {b!r} {unused}")
    _need(not isinstance(g, bool) and isinstance(g, int) and 1 <= g <= MAX_GROUP and not g & (g - 1),
          "sync.topk_group", f"must be a power of two <= {MAX_GROUP}, got {g!r} {unused}")


def _check_expert_subsets(cfg: Config) -> None:
    """`algo.rule.verified.expert_subsets` set: what it needs that this config lacks, all of it in one line (the
    rule's own checks, VerifiedConfig.validate and VerifiedRule.refuse, would reveal one per launch)."""
    v, a, key = cfg.algo.rule.verified, cfg.algo, "algo.rule.verified.expert_subsets"
    if not v.expert_subsets:
        return
    unmet = []
    if not (a.local_sgd and a.rule.name == "verified"):
        unmet.append(f"the verified rule of algo=edit or algo=a_edit (now algo={a.name} with algo.rule.name="
                     f"{a.rule.name}: nothing would read the subsets)")
    if v.expert_weights != "tokens":
        unmet.append(f"algo.rule.verified.expert_weights=tokens (now {v.expert_weights}: an expert's update comes "
                     "from its owners only, weighed by the tokens each routed to it)")
    if cfg.sync.compression != "none":
        unmet.append(f"sync.compression=none (now {cfg.sync.compression}: the rows a cluster does not send cannot "
                     "go compressed)")
    clusters = len(cluster_specs(cfg))
    if clusters > cfg.sync.gather_max:
        unmet.append(f"sync.gather_max >= {clusters} (now {cfg.sync.gather_max}: weights per expert need every "
                     "cluster gathered, not a SUM)")
    if cfg.model.num_experts < 1:
        unmet.append("a model with routed experts (now model.num_experts=0)")
    _need(not unmet, key, "needs " + "; ".join(unmet))


def validate(cfg: Config) -> None:
    """Check cross-field rules; raise ConfigError naming the field and what to do."""
    from edit_train.sim.switch import check_real_network

    check_real_network(cfg)  # a cluster job of a real federation simulates nothing unless sim.force=true
    cfg.model.validate()
    t, a, c = cfg.train, cfg.algo, cfg.cluster
    _need(t.steps > 0, "train.steps", f"must be > 0, got {t.steps}")
    _need(t.batch_size > 0, "train.batch_size", f"must be > 0, got {t.batch_size}")
    _need(t.seq_len > 1, "train.seq_len", f"must be > 1, got {t.seq_len}")
    _need(t.seq_len <= cfg.model.max_position_embeddings, "train.seq_len",
          f"{t.seq_len} exceeds model.max_position_embeddings={cfg.model.max_position_embeddings}")
    _need(t.grad_accum >= 1, "train.grad_accum", "must be >= 1")
    _need(t.precision in ("fp32", "bf16"), "train.precision", f"must be fp32 or bf16, got {t.precision!r}")
    _need(t.activation_checkpointing in ("none", "full", "moe"), "train.activation_checkpointing",
          f"must be none, full or moe, got {t.activation_checkpointing!r}")
    _need(t.peak_flops >= 0, "train.peak_flops", f"must be >= 0 (0 = look the device up), got {t.peak_flops}")
    _need(t.device in ("auto", "cpu", "cuda"), "train.device", f"must be auto, cpu or cuda, got {t.device!r}")
    _need(t.eval_every >= 0 and t.eval_batches >= 1, "train.eval_every/eval_batches", "must be >= 0 / >= 1")
    _need(t.threads >= 0, "train.threads", f"must be >= 0 (0 = auto), got {t.threads}")
    _need(t.optimizer in ("adamw", "muon"), "train.optimizer", f"must be adamw or muon, got {t.optimizer!r}")
    _need(0.0 <= t.muon_momentum < 1.0, "train.muon_momentum", f"must be in [0, 1), got {t.muon_momentum}")
    _need(a.name in ("ddp", "post_local_sgd", "diloco", "edit", "a_edit"), "algo.name",
          f"unknown algorithm {a.name!r}; choose ddp, post_local_sgd, diloco, edit or a_edit")
    _need(a.schedule in ("step", "time"), "algo.schedule", f"must be step or time, got {a.schedule!r}")
    _need(a.interval >= 1, "algo.interval", f"must be >= 1, got {a.interval}")
    _need(0.0 <= a.interval_power <= 4.0, "algo.interval_power", f"must be in [0, 4], got {a.interval_power}")
    _need(a.interval_power == 0 or (a.local_sgd and a.schedule == "step"), "algo.interval_power",
          "places the syncs of a step schedule (algo.schedule=step, a local-SGD algorithm); set it to 0")
    _need(a.warmup_steps >= 0, "algo.warmup_steps", "must be >= 0")
    _need(a.expert_bias in ("mean", "global", "local"), "algo.expert_bias",
          f"must be mean, global or local, got {a.expert_bias!r}")
    _check_finite("algo.sync_time_s", a.sync_time_s, example=10)
    outer_step(cfg).config.validate()  # algo.outer with the default by cluster count filled in
    _check_expert_subsets(cfg)  # every unmet prerequisite in one line, before the rule's own checks say one each
    a.rule.validate()
    if a.local_sgd:
        from edit_train.local_sgd.aggregator import capabilities_of
        from edit_train.local_sgd.aggregation.rules import make_rule, refuse_mode

        rule = make_rule(a.rule)  # an unknown or unloadable algo.rule.name fails here, in one line
        why = refuse_mode(rule, a.rule.name, len(cluster_specs(cfg)), cfg.sync.gather_max,
                          cfg.sync.unsent == "keep" and cfg.sync.compression == "topk")
        _need(not why, "algo.rule.name", why)
        refused = capabilities_of(rule).refuse(len(cluster_specs(cfg)), cfg.sync.gather_max, cfg.sync.compression,
                                              cfg.model.num_experts)
        _need(refused is None, *(refused or ("", "")))  # the rule's own check of the federation it is to serve
    _need(cfg.sync.mode in ("layerwise", "at_end", "overlap"), "sync.mode",
          f"must be layerwise, at_end or overlap, got {cfg.sync.mode!r}")
    _need(cfg.data.parts >= 0, "data.parts",
          f"must be >= 0 (0 = one part per configured cluster), got {cfg.data.parts}")
    _need(c.count >= 1, "cluster.count", f"must be >= 1, got {c.count}")
    _need(c.ranks >= 1, "cluster.ranks", f"must be >= 1, got {c.ranks}")
    specs = cluster_specs(cfg)
    for i, spec in enumerate(specs):
        _check_cluster_name(f"cluster.clusters[{i}].name" if c.clusters else "cluster.count", spec.name)
    if c.only:
        _check_cluster_name("cluster.only", c.only)
    if os.environ.get("EDIT_TRAIN_CLUSTER"):  # what a launcher names this job's cluster (train/build.py my_cluster)
        _check_cluster_name("EDIT_TRAIN_CLUSTER", os.environ["EDIT_TRAIN_CLUSTER"])
    names = [s.name for s in specs]
    _need(len(set(names)) == len(names), "cluster.clusters", f"cluster names must be unique, got {names}")
    _need(not c.slowdown or len(c.slowdown) == len(specs), "cluster.slowdown",
          f"needs one factor per cluster ({len(specs)}), got {len(c.slowdown)} (from cluster={c.name}?); give each "
          "cluster its slowdown in cluster.clusters, or start from cluster=local")
    from edit_train.codec.dense import CompressionConfig

    try:
        CompressionConfig.of(cfg.sync).validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_topk_keys(cfg.sync)
    f = cfg.federation
    _check_host("federation.host", f.host, need_port=False)
    if f.lighthouse:
        _check_host("federation.lighthouse", f.lighthouse, need_port=True)
    _need(f.min_clusters >= 1, "federation.min_clusters", f"must be >= 1, got {f.min_clusters}")
    _need(f.chunks >= 1, "federation.chunks", f"must be >= 1, got {f.chunks}")
    check_federation_timeouts(f)
    _check_finite("cluster.timeout_s", c.timeout_s, example=600)
    _check_finite("run.restart_delay_s", cfg.run.restart_delay_s, zero="restart at once", example=2)
    _check_finite("cluster.link.latency_ms", c.link.latency_ms, zero="no added latency", unit="milliseconds",
                   example=50)
    _check_finite("cluster.link.bandwidth_mbps", c.link.bandwidth_mbps, zero="unlimited", unit="megabits/s",
                   example=100)
    _need(cfg.sync.gather_max >= 0, "sync.gather_max", f"must be >= 0 (0 = always a SUM), got {cfg.sync.gather_max}")
    _need(all(s >= 1.0 for s in c.slowdown), "cluster.slowdown", "factors must be >= 1.0")
    _need(c.backend in ("auto", "gloo", "nccl"), "cluster.backend", f"must be auto, gloo or nccl, got {c.backend!r}")
    _need(cfg.sync.mode != "overlap" or a.local_sgd, "sync.mode",
          f"overlap needs a local-SGD algorithm (edit, a_edit, diloco, post_local_sgd), not {a.name}")
    _check_finite("train.time_budget_s", t.time_budget_s, zero="no time budget (train.steps decides)",
                   example=3600)
    from edit_train.sim.hetero import parse_schedule

    try:
        parse_schedule(list(c.slowdown_schedule), c.count)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_split(cfg, specs)
    _need(cfg.logger.kind in ("wandb", "none"), "logger.kind", f"must be wandb or none, got {cfg.logger.kind!r}")
    _need(str(cfg.resume).lower() in ("false", "true", "auto"), "resume",
          f"must be false or auto, got {cfg.resume!r}")
    _need(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep >= 1, "checkpoint.every/keep", "must be >= 0 / >= 1")
    _need(not (a.local_sgd and a.schedule == "step" and cfg.checkpoint.every and a.interval_power == 0)
          or (cfg.checkpoint.every - a.warmup_steps) % a.interval == 0 and cfg.checkpoint.every > a.warmup_steps,
          "checkpoint.every", f"{cfg.checkpoint.every} is not a sync boundary: checkpoints are taken where every "
          f"cluster holds the anchor, so use warmup_steps + a multiple of algo.interval ({a.interval})")
    _need(cfg.run.max_restarts >= 0, "run.max_restarts", "must be >= 0")


def _check_split(cfg: Config, specs: list[ClusterSpec]) -> None:
    from edit_train.data import languages
    from edit_train.data.families import group_sources, parse_source
    from edit_train.data.tokenizer import DataError

    d = cfg.data
    _need(d.split in ("shared", "by_family", "by_language"), "data.split",
          f"must be shared, by_family or by_language, got {d.split!r}")
    try:
        for source in [s.source for s in specs] + [d.source]:
            if source.startswith("stdlib:"):
                parse_source(source)
            if languages.is_language_source(source):
                languages.parse_source(source)
        if d.split in ("by_family", "by_language"):
            _need(d.source == "stdlib", "data.source", f"data.split={d.split} chooses each cluster's data itself; "
                  f"leave data.source=stdlib (got {d.source!r}) or use data.split=shared")
            (group_sources if d.split == "by_family" else languages.group_sources)(len(specs))
    except DataError as exc:
        raise ConfigError(str(exc)) from None


# The federation's waits (seconds; `edit-train-lighthouse` reads the same keys) and a working example of each.
FEDERATION_TIMEOUTS = {"join_timeout_s": 5, "heartbeat_timeout_s": 5, "quorum_timeout_s": 300,
                       "collective_timeout_s": 30}


def check_federation_timeouts(f: FederationConfig) -> None:
    """Every `federation.*_timeout_s` is a finite number of seconds > 0 (`edit-train` and `edit-train-lighthouse`):
    `inf` used to pass and end in a traceback, `nan` in a quorum wait that never ended."""
    for key, example in FEDERATION_TIMEOUTS.items():
        _check_finite(f"federation.{key}", getattr(f, key), example=example)


def to_container(cfg: Any) -> dict[str, Any]:
    """A plain, JSON-serialisable dict of a (possibly OmegaConf) config."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    import dataclasses

    return dataclasses.asdict(cfg)


def from_container(data: dict[str, Any]) -> Config:
    """Rebuild a typed Config object from a plain dict (e.g. the run's resolved config.json)."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(Config), data)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]
