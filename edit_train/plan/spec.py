"""What a plan is asked about: the clusters, the links between sites, the failure model, the workload and
the candidates to compare. Plain dataclasses built from a dict (`conf/plan/scenario/*.yaml`, or a test);
every mistake a user can make raises one `PlanError` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from edit_train.plan.traffic import COMPRESSIONS, Codec

ALGOS = ("ddp", "post_local_sgd", "diloco", "edit", "a_edit")
SUBSET_ALGOS = ("edit", "a_edit")  # the verified rule's: the algorithms expert subsets run under
MODES = ("layerwise", "at_end", "overlap")


class PlanError(ValueError):
    """A plan input that cannot be used; the message names the field."""


@dataclass
class ClusterPlan:
    name: str
    ranks: int
    accelerator: str = ""  # a type from hardware.MEMORY_GB / edit_train/peaks.py (step time from FLOPs at `mfu`) ...
    step_s: float = 0.0  # ... or one rank's measured median seconds per step (wins over the type)
    step_cv: float = 0.03  # one rank's step-to-step variation (log-σ)
    p_slow: float = 0.0  # probability a rank's step is a straggler's ...
    slow_factor: float = 1.0  # ... that takes this many times as long
    memory_gb: float = 0.0  # per accelerator (0: the type's; checked against the state the model needs)
    slowdown: float = 1.0  # a cluster.slowdown factor (a simulated slower cluster)
    batch_size: int = 0  # sequences per rank (0: the workload's)
    mfu: float = 0.0  # for a type without step_s (0: hardware.DEFAULT_MFU)


@dataclass
class LinkPlan:
    bandwidth_mbps: float = 0.0  # 0 = unlimited
    latency_ms: float = 0.0
    lanes: int = 0  # parallel transfers at full bandwidth (0: 1 for a real site link; see `simulated`)


@dataclass
class UplinkPlan:
    name: str
    clusters: list[str]
    bandwidth_mbps: float


@dataclass
class FailurePlan:
    mtbf_h_per_accelerator: float = 0.0  # mean time between interruptions of one accelerator (0 = none)
    mtbf_h_per_cluster: float = 0.0  # ... of a whole cluster (network, job, site), on top
    restart_s: float = 120.0  # from the crash to the cluster training again (scheduler + start-up)
    kills: list[dict[str, Any]] = field(default_factory=list)  # [{cluster, step | at_s}]: a kill schedule


@dataclass
class CandidateSet:
    algos: list[str] = field(default_factory=lambda: list(ALGOS))
    modes: list[str] = field(default_factory=lambda: list(MODES))
    compressions: list[str] = field(default_factory=lambda: list(COMPRESSIONS))
    # the top-k settings a `topk` compression is tried at: element-wise 1 % (the default until issue 51), the 1/57 pair
    # that holds the loss with `keep`, and the 1/100 pair (the default since, at its measured outer step)
    topk: list[dict[str, Any]] = field(default_factory=lambda: [
        {"density": 0.01, "bits": 2, "group": 1, "unsent": "resend"},
        {"density": 0.1875, "bits": 2, "group": 8, "unsent": "keep"},
        # issue 51: 1/100 of the bytes at no loss (results/compression_2026_screen.json), at the outer step it was found at
        {"density": 0.09375, "bits": 2, "group": 8, "unsent": "resend", "ef_decay": 0.6, "outer_lr": 1.7}])
    intervals: list[int] = field(default_factory=lambda: [16, 64, 256])
    sync_times_s: list[float] = field(default_factory=list)  # A-EDiT τ (empty: interval × the median step)


@dataclass
class Scenario:
    name: str
    clusters: list[ClusterPlan]
    model: str = "tiny"
    batch_size: int = 16
    seq_len: int = 128
    hours: float = 100.0  # simulated horizon (failures are drawn over it)
    steps: int = 0  # a fixed run of this many steps instead of a horizon (validation against real runs)
    link: LinkPlan = field(default_factory=LinkPlan)  # every cluster's link unless `links` names it
    links: dict[str, LinkPlan] = field(default_factory=dict)
    uplinks: list[UplinkPlan] = field(default_factory=list)
    simulated_link: bool = False  # the link is edit-train's simulated one: every rank queues its own transfers
    backward_overlap: bool = False  # reductions launched during the backward (published settings; not edit-train)
    failures: FailurePlan = field(default_factory=FailurePlan)
    candidates: CandidateSet = field(default_factory=CandidateSet)
    join_timeout_s: float = 5.0
    heartbeat_timeout_s: float = 5.0
    min_clusters: int = 1
    gather_max: int = 4
    chunks: int = 4
    host_cores: int = 0  # > 0: every rank a one-thread process on one host of this many cores (contention.py)
    # top-k formats the hosts have compiled already (`codec/compiled.py` keys; a new one costs start-up);
    # None: what this host's record says
    compiled: list[str] | None = None
    block_size: int = 256  # sync.block_size: values per scale (int8 / fp8), per top-k chunk
    scale_dtype: str = "fp32"  # sync.scale_dtype
    eval_every: int = 0
    checkpoint_every: int = 0
    min_steps: int = 1
    target_loss: float = 0.0  # loss side: tokens to reach this (0: a fraction of the way from the prior)
    # expert subsets per site (algo.rule.verified.expert_subsets; "" off, never turned on by the planner itself):
    # split or a static map 0+1|2+3 — the edit / a_edit candidates with compression none run with it (plan/subsets.py)
    expert_subsets: str = ""

    @property
    def accelerators(self) -> int:
        return sum(c.ranks for c in self.clusters)

    def link_of(self, name: str) -> LinkPlan:
        return self.links.get(name, self.link)


def _build(cls: type, data: Any, where: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {sorted(unknown)}; known: {', '.join(sorted(names))}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise PlanError(f"{where}: {exc}") from None


def _link(data: Any, where: str) -> LinkPlan:
    if isinstance(data, dict) and "bandwidth_gbps" in data:
        data = {**data, "bandwidth_mbps": float(data["bandwidth_gbps"]) * 1000.0}
        del data["bandwidth_gbps"]
    return _build(LinkPlan, data, where)


def scenario_from_dict(data: dict[str, Any]) -> Scenario:
    """A `Scenario` from plain data (YAML / JSON / an OmegaConf container), checked."""
    if not isinstance(data, dict):
        raise PlanError("plan: the scenario must be a mapping")
    raw = dict(data)
    try:
        clusters = [_build(ClusterPlan, c, f"clusters[{i}]") for i, c in enumerate(raw.pop("clusters"))]
    except KeyError:
        raise PlanError("clusters: a plan needs at least one cluster ({name, ranks, accelerator | step_s})") from None
    link = _link(raw.pop("link", {}), "link")
    links = {str(k): _link(v, f"links.{k}") for k, v in (raw.pop("links", None) or {}).items()}
    uplinks = [_build(UplinkPlan, dict(u), f"uplinks[{i}]") for i, u in enumerate(raw.pop("uplinks", None) or [])]
    failures = _build(FailurePlan, raw.pop("failures", None) or {}, "failures")
    cands = _build(CandidateSet, raw.pop("candidates", None) or {}, "candidates")
    scn = _build(Scenario, {**raw, "clusters": clusters, "link": link, "links": links, "uplinks": uplinks,
                            "failures": failures, "candidates": cands}, "plan")
    check(scn)
    return scn


def check(s: Scenario) -> None:
    def need(ok: bool, where: str, why: str) -> None:
        if not ok:
            raise PlanError(f"{where}: {why}")

    need(bool(s.clusters), "clusters", "a plan needs at least one cluster")
    names = [c.name for c in s.clusters]
    need(len(set(names)) == len(names), "clusters", f"names must be unique, got {names}")
    need(s.compiled is None or (isinstance(s.compiled, list) and all(isinstance(k, str) for k in s.compiled)),
         "compiled", f"must be a list of top-k format keys (codec/compiled.py), got {s.compiled!r}")
    for i, c in enumerate(s.clusters):
        w = f"clusters[{i}] ({c.name})"
        need(c.ranks >= 1, f"{w}.ranks", f"must be >= 1, got {c.ranks}")
        need(c.step_s > 0 or bool(c.accelerator), w, "give a measured step_s or an accelerator type")
        need(c.step_s >= 0 and math.isfinite(c.step_s), f"{w}.step_s", "must be >= 0 seconds")
        need(c.step_cv >= 0 and 0 <= c.p_slow < 1 and c.slow_factor >= 1, w,
             "step_cv must be >= 0, p_slow in [0, 1), slow_factor >= 1")
        need(c.slowdown >= 1.0, f"{w}.slowdown", "must be >= 1 (edit-train's cluster.slowdown)")
    for name in s.links:
        need(name in names, f"links.{name}", f"no cluster of that name (clusters: {', '.join(names)})")
    for lk in [s.link, *s.links.values()]:
        need(lk.bandwidth_mbps >= 0 and lk.latency_ms >= 0, "link", "bandwidth_mbps and latency_ms must be >= 0")
    for u in s.uplinks:
        need(set(u.clusters) <= set(names), f"uplinks.{u.name}.clusters", f"unknown cluster(s) in {u.clusters}")
        need(u.bandwidth_mbps > 0, f"uplinks.{u.name}.bandwidth_mbps", "must be > 0")
    for a in s.candidates.algos:
        need(a in ALGOS, "candidates.algos", f"{a!r} is not one of {', '.join(ALGOS)}")
    for m in s.candidates.modes:
        need(m in MODES, "candidates.modes", f"{m!r} is not one of {', '.join(MODES)}")
    for c in s.candidates.compressions:
        need(c in COMPRESSIONS, "candidates.compressions", f"{c!r} is not one of {', '.join(COMPRESSIONS)}")
    for i, t in enumerate(s.candidates.topk):
        where = f"candidates.topk[{i}]"
        need(isinstance(t, dict) and set(t) <= {"density", "bits", "group", "unsent", "ef_decay", "outer_lr"}, where,
             "give {density, bits, group, unsent[, ef_decay, outer_lr]} (the sync.topk_density, sync.bits, "
             "sync.topk_group, sync.unsent[, sync.error_feedback_decay, algo.outer.lr])")
        lr = t.get("outer_lr", 1.0) if isinstance(t, dict) else 1.0
        need(isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0,
             f"{where}.outer_lr", f"must be a number > 0, got {lr!r}")
        need("outer_lr" not in t or float(t.get("ef_decay", 1.0)) < 1.0, f"{where}.outer_lr",
             "is the outer lr of error feedback as momentum: give it with ef_decay < 1")
        why = topk_codec(s, TopK(**t)).error()
        need(why is None, where, str(why))
    need(bool(s.candidates.topk) or "topk" not in s.candidates.compressions, "candidates.topk",
         "list at least one top-k setting when candidates.compressions has topk")
    why = Codec("int8", s.block_size, s.scale_dtype).error("scenario")
    need(why is None, "block_size/scale_dtype", str(why))
    need(all(h >= 1 for h in s.candidates.intervals), "candidates.intervals", "local steps must be >= 1")
    need(all(t > 0 for t in s.candidates.sync_times_s), "candidates.sync_times_s", "seconds must be > 0")
    need(s.batch_size >= 1 and s.seq_len >= 2, "batch_size/seq_len", "must be >= 1 / >= 2")
    if s.expert_subsets:
        need(isinstance(s.expert_subsets, str), "expert_subsets", f"split or a map 0+1|2+3, got {s.expert_subsets!r}")
        need(any(a in SUBSET_ALGOS for a in s.candidates.algos) and "none" in s.candidates.compressions,
             "expert_subsets", "only edit / a_edit candidates with compression none carry them (the verified "
             "rule's option; rows left out cannot go compressed): list them in candidates")
        need(len(s.clusters) <= s.gather_max, "expert_subsets", f"needs every cluster gathered (expert_weights="
             f"tokens): gather_max={s.gather_max} < {len(s.clusters)} clusters")
    need(s.hours > 0 or s.steps > 0, "hours", "a plan needs a horizon (hours > 0) or a number of steps")
    need(s.join_timeout_s > 0 and s.heartbeat_timeout_s > 0, "join_timeout_s", "timeouts must be > 0")
    need(s.min_clusters >= 1, "min_clusters", "must be >= 1")
    need(s.host_cores >= 0, "host_cores", "must be >= 0 (0: every cluster on its own hardware)")
    f = s.failures
    need(f.mtbf_h_per_accelerator >= 0 and f.mtbf_h_per_cluster >= 0 and f.restart_s >= 0, "failures",
         "mtbf_h_* and restart_s must be >= 0")
    for i, k in enumerate(f.kills):
        need(isinstance(k, dict) and ("step" in k or "at_s" in k) and str(k.get("cluster", "")) != "",
             f"failures.kills[{i}]", "needs cluster and step (or at_s)")
        cl = k["cluster"]
        need(str(cl) in names or (str(cl).isdigit() and int(cl) < len(names)), f"failures.kills[{i}].cluster",
             f"{cl!r} is neither a cluster name nor an index")


@dataclass(frozen=True)
class TopK:
    """The top-k settings of a `topk` candidate (`sync.topk_density`, `sync.bits`, `sync.topk_group`, `sync.unsent`)."""

    density: float = 0.01
    bits: int = 2
    group: int = 1
    unsent: str = "resend"
    ef_decay: float = 1.0  # sync.error_feedback_decay: < 1 is error feedback as outer momentum (docs/algorithms.md)
    outer_lr: float = 1.0  # algo.outer.lr that error feedback as momentum runs with (momentum 0: the residual is it)


def topk_codec(s: Scenario, t: TopK) -> Codec:
    return Codec("topk", s.block_size, s.scale_dtype, t.density, t.bits, t.group, t.unsent, float(t.ef_decay))


@dataclass(frozen=True)
class Candidate:
    """One configuration to simulate: an algorithm, its sync mode and compression (top-k: with its settings),
    H or τ."""

    algo: str
    mode: str = "at_end"
    compression: str = "none"
    interval: int = 32
    sync_time_s: float = 0.0
    topk: TopK = TopK()
    subsets: str = ""  # expert subsets (the scenario's `expert_subsets`; "" off)

    def codec(self, s: Scenario) -> Codec:
        """The wire format this candidate sends in scenario `s` (its block size and scale type)."""
        if self.compression == "topk":
            return topk_codec(s, self.topk)
        return Codec(self.compression, s.block_size, s.scale_dtype)

    @property
    def compression_label(self) -> str:
        t = self.topk
        return Codec("topk", density=t.density, bits=t.bits, group=t.group, unsent=t.unsent,
                     ef_decay=float(t.ef_decay)).label \
            if self.compression == "topk" else self.compression

    @property
    def local_sgd(self) -> bool:
        return self.algo != "ddp"

    @property
    def timed(self) -> bool:
        return self.algo == "a_edit"

    @property
    def label(self) -> str:
        if self.algo == "ddp":
            return "ddp"
        knob = f"tau={self.sync_time_s:g}s" if self.timed else f"H={self.interval}"
        subsets = "+subsets" if self.subsets else ""
        return f"{self.algo}/{self.mode}/{self.compression_label}{subsets}/{knob}"
