"""The plan: every candidate (algorithm × sync mode × compression × H or τ) simulated on the scenario, the
failure timeline laid over it, the loss-side multiplier beside it, a recommendation and the exact
`edit-train` overrides that realise it.

The recommendation maximises **ddp-equivalent tokens per second**: predicted tokens/s under the failure
model ÷ the loss model's tokens multiplier (how many more tokens the algorithm needs for ddp's loss). The
two sides are predicted and reported apart; so are their errors.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from edit_train.plan import faults, hardware, subsets, traffic
from edit_train.plan.costs import Fed, resolve
from edit_train.plan.engine import simulate
from edit_train.plan.loss import LossModel, default_model
from edit_train.plan.profile import Profile, nearest_timed
from edit_train.plan.simbase import SimOptions, SimResult
from edit_train.plan.spec import SUBSET_ALGOS, Candidate, Scenario, TopK


@dataclass
class Row:
    cand: Candidate
    tokens_per_s: float
    blocked: dict[str, float]  # per cluster, fraction of its reserved time
    bytes_per_token: float
    bytes_per_s: float
    goodput: float
    multiplier: float  # loss side: tokens to ddp's loss, ÷ ddp's
    multiplier_err: float
    fits: bool
    interruptions: int = 0
    extrapolated: bool = False
    sim: SimResult | None = field(default=None, repr=False)

    @property
    def effective(self) -> float:
        return self.tokens_per_s / max(self.multiplier, 1e-9)

    def to_json(self) -> dict[str, Any]:
        c = self.cand
        return {"label": c.label, "algo": c.algo, "mode": c.mode if c.local_sgd else None,
                "compression": c.compression if c.local_sgd else None,
                "topk": dict(vars(c.topk)) if c.local_sgd and c.compression == "topk" else None,
                "expert_subsets": c.subsets or None,
                "interval": c.interval if c.local_sgd and not c.timed else None,
                "sync_time_s": c.sync_time_s if c.timed else None, "tokens_per_s": self.tokens_per_s,
                "blocked_frac": self.blocked, "bytes_per_token": self.bytes_per_token,
                "bytes_per_s": self.bytes_per_s, "goodput": self.goodput, "tokens_multiplier": self.multiplier,
                "tokens_multiplier_err": self.multiplier_err, "ddp_equivalent_tokens_per_s": self.effective,
                "fits_memory": self.fits, "interruptions": self.interruptions, "extrapolated": self.extrapolated}


@dataclass
class Plan:
    scenario: Scenario
    rows: list[Row]
    best: Row
    overrides: list[str]
    loss: LossModel
    profile: Profile
    elapsed_s: float
    events: int
    cluster_steps: int
    notes: list[str] = field(default_factory=list)
    subsets: dict[str, Any] | None = None  # what expert subsets save (`subsets_saving`), when the scenario has them

    @property
    def events_per_s(self) -> float:
        return self.events / max(self.elapsed_s, 1e-9)


def candidates(scn: Scenario, fed: Fed) -> list[Candidate]:
    cs = scn.candidates
    taus = cs.sync_times_s or [round(h * float(fed.mean_step.mean()), 3) for h in cs.intervals]
    out: list[Candidate] = []
    for algo in cs.algos:
        if algo == "ddp":
            out.append(Candidate("ddp", "layerwise"))
            continue
        for mode in cs.modes:
            for comp in cs.compressions:
                # expert subsets only where the user turned them on, and where the product runs them
                sub = scn.expert_subsets if algo in SUBSET_ALGOS and comp == "none" else ""
                for topk in [TopK(**t) for t in cs.topk] if comp == "topk" else [TopK()]:
                    if algo == "a_edit":
                        out += [Candidate(algo, mode, comp, cs.intervals[0] if cs.intervals else 16, float(t), topk,
                                          sub) for t in taus]
                    else:
                        out += [Candidate(algo, mode, comp, int(h), topk=topk, subsets=sub) for h in cs.intervals]
    return out


def memory_gb(fed: Fed, cand: Candidate, c: int) -> float:
    """Cluster `c`'s rough state per rank under `cand` (expert subsets: + the frozen rows' copy)."""
    frozen = int(fed.home[c].sum()) if cand.subsets and fed.home is not None else 0
    return hardware.memory_per_rank_gb(fed.facts, int(fed.ranks[c]), cand.local_sgd, frozen)


def fits_memory(scn: Scenario, fed: Fed, cand: Candidate) -> bool:
    for i, c in enumerate(scn.clusters):
        mem = c.memory_gb or (hardware.accelerator(c.accelerator)["memory_gb"] if c.accelerator else 0.0)
        if mem and memory_gb(fed, cand, i) > 0.9 * mem:
            return False
    return True


def subsets_saving(scn: Scenario, fed: Fed, rows: list[Row]) -> dict[str, Any] | None:
    """What the scenario's expert subsets save each cluster in a sync of every cluster (`plan/subsets.saving`,
    the figures `edit-train-info` reports) and the at_end sync's predicted seconds with and without them, on
    the best candidate that carries them; None when off."""
    if fed.home is None:
        return None
    carried = [r for r in rows if r.cand.subsets]
    if not carried:
        return None
    cand = max(carried, key=lambda r: r.effective).cand
    members = np.arange(fed.n)
    paired = fed.paired(members)
    needs = traffic.NEEDS[cand.algo]
    on, off = fed.sync_cost(members, cand), fed.sync_cost(members, replace(cand, subsets=""))
    per = {}
    for i, name in enumerate(fed.names):
        figures = subsets.saving(fed.facts.unit_sizes, [int(x) for x in fed.home[i]], fed.n, cand.codec(scn),
                                 ranks=int(fed.ranks[i]), paired=paired, chunks=scn.chunks,
                                 gather_max=scn.gather_max, needs=needs)
        per[name] = {**figures, "at_end_sync_s": float(on["at_end"][i]),
                     "at_end_sync_s_every_expert": float(off["at_end"][i]),
                     "memory_gb_per_rank": memory_gb(fed, cand, i),
                     "memory_gb_per_rank_every_expert": memory_gb(fed, replace(cand, subsets=""), i)}
    return {"spec": scn.expert_subsets, "candidate": cand.label, "note": fed.subsets_note, "clusters": per}


def sim_options(scn: Scenario, seed: int = 0, quick: bool = False) -> SimOptions:
    names = [c.name for c in scn.clusters]
    kills = []
    for k in scn.failures.kills:
        c = names.index(str(k["cluster"])) if str(k["cluster"]) in names else int(k["cluster"])
        kills.append((c, int(k.get("step", -1)), float(k.get("at_s", -1.0))))
    return SimOptions(steps=scn.steps, horizon_s=scn.hours * 3600.0, seed=seed, kills=kills,
                      restart_s=scn.failures.restart_s, max_issues=200 if quick else 800)


def evaluate(scn: Scenario, fed: Fed, cand: Candidate, loss: LossModel, seed: int = 0, quick: bool = False) -> Row:
    opt = sim_options(scn, seed, quick)
    res = simulate(fed, cand, opt)
    n_int = 0
    if not scn.steps:
        res, stats = faults.apply(fed, cand, res, scn.failures, scn.hours * 3600.0, seed)
        n_int = stats.interruptions
    h = cand.interval
    if cand.timed:  # A-EDiT's effective interval: the steps its clusters take per τ
        h = max(1.0, float(np.mean(cand.sync_time_s / fed.mean_step)))
    mult, err = loss.multiplier(cand.algo, fed.n, h, fed.facts.total_params, cand.compression_label)
    blocked = {name: float(x) for name, x in zip(fed.names, res.blocked_frac)}
    return Row(cand, res.tokens_per_s, blocked, res.bytes_per_token, res.bytes_per_s, res.goodput, mult, err,
               fits_memory(scn, fed, cand), n_int, res.extrapolated, res)


def make_plan(scn: Scenario, profile: Profile | None = None, loss: LossModel | None = None, seed: int = 0,
              quick: bool = False) -> Plan:
    t0 = time.perf_counter()
    profile = profile or Profile.default()
    fed = resolve(scn, profile)
    loss = loss or default_model(fed.facts.total_params)
    rows = [evaluate(scn, fed, c, loss, seed, quick) for c in candidates(scn, fed)]
    ok = [r for r in rows if r.fits] or rows
    best = max(ok, key=lambda r: (r.effective, -r.bytes_per_s))
    notes = []  # a run-time expert map's note is in the subsets' block
    if not profile.calibrated:
        notes.append("uncalibrated: step times from FLOPs at the given MFU and default sync costs; run "
                     "`edit-train-plan calibrate RUN_DIR...` for measured ones")
    sparse = {c.label: c for c in (r.cand.codec(scn) for r in rows) if c.sparse}
    for label, codec in sorted(sparse.items()):
        if profile.codec and label not in profile.codec:
            near = nearest_timed(codec, profile.codec) or "no"
            notes.append(f"the codec of {label} was not timed by the calibration: it costs what {near} did")
    if not any(r.fits for r in rows):
        notes.append("no candidate fits the accelerators' memory by the rough state estimate; check with "
                     "`edit-train-info ... --gpu-mem-gb`")
    events = sum(r.sim.events for r in rows if r.sim)
    steps = sum(r.sim.cluster_steps for r in rows if r.sim)
    return Plan(scn, rows, best, overrides(scn, best.cand), loss, profile, time.perf_counter() - t0, events,
                steps, notes, subsets_saving(scn, fed, rows))


def overrides(scn: Scenario, cand: Candidate) -> list[str]:
    """The `edit-train` overrides (every cluster gets the same) that run `cand` on this scenario."""
    out = [f"algo={cand.algo}", f"model={scn.model}", f"train.batch_size={scn.batch_size}",
           f"train.seq_len={scn.seq_len}"]
    if cand.local_sgd:
        out += [f"sync.mode={cand.mode}", f"sync.compression={cand.compression}"]
        if cand.compression == "topk":
            t = cand.topk
            # every top-k key named: the candidate is what was measured, whatever the product's defaults are
            out += [f"sync.topk_density={t.density:g}", f"sync.bits={t.bits}", f"sync.topk_group={t.group}",
                    f"sync.unsent={t.unsent}", f"sync.error_feedback_decay={t.ef_decay:g}"]
            if t.ef_decay < 1.0:  # error feedback as outer momentum, at the outer point it was measured at
                out += ["sync.error_feedback=true", f"algo.outer.lr={t.outer_lr:g}", "algo.outer.momentum=0.0",
                        "algo.outer.nesterov=false"]
        if cand.compression in ("int8", "fp8", "topk") and (scn.block_size, scn.scale_dtype) != (256, "fp32"):
            out += [f"sync.block_size={scn.block_size}", f"sync.scale_dtype={scn.scale_dtype}"]
        out.append(f"algo.sync_time_s={cand.sync_time_s:g}" if cand.timed else f"algo.interval={cand.interval}")
        if cand.subsets:
            out += ["algo.rule.verified.expert_weights=tokens", f"algo.rule.verified.expert_subsets={cand.subsets}",
                    f"sync.gather_max={scn.gather_max}"]  # every cluster gathered: weights per expert
    specs = []
    for c in scn.clusters:
        extra = f",slowdown:{c.slowdown:g}" if c.slowdown != 1.0 else ""
        extra += f",batch_size:{c.batch_size}" if c.batch_size else ""
        specs.append(f"{{name:{c.name},ranks:{c.ranks}{extra}}}")
    # no preset slowdowns either way: one host's federation (a simulated link, shared cores) is the local launcher's,
    # sites of their own are each a cluster job of a real federation (launchers/README.md): cluster=real
    preset = "local" if scn.simulated_link or scn.host_cores else "real"
    out += [f"cluster={preset}", f"cluster.clusters=[{','.join(specs)}]"]
    out += [f"federation.min_clusters={scn.min_clusters}", f"federation.join_timeout_s={scn.join_timeout_s:g}"]
    if scn.simulated_link and scn.link.bandwidth_mbps + scn.link.latency_ms > 0:
        out += [f"cluster.link.bandwidth_mbps={scn.link.bandwidth_mbps:g}",
                f"cluster.link.latency_ms={scn.link.latency_ms:g}"]
    if scn.steps:
        out.append(f"train.steps={scn.steps}")
    return out


def summary_line(row: Row) -> str:
    worst = max(row.blocked.values()) if row.blocked else 0.0
    return (f"{row.cand.label}: {row.tokens_per_s:,.0f} tokens/s, blocked ≤ {worst:.1%}, goodput "
            f"{row.goodput:.3f}, {row.bytes_per_token:,.1f} cross-site B/token ({row.bytes_per_s / 1e6:,.2f} MB/s), "
            f"tokens to ddp's loss ×{row.multiplier:.2f} ± {row.multiplier_err:.2f}")


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None

