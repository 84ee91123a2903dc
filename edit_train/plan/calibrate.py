"""`edit-train plan calibrate RUN_DIR...`: a `Profile` fitted from finished runs (their `config.json`,
`summary.json` and `metrics.jsonl`, docs/architecture.md §5) — nothing else is read, nothing is guessed.

* **compute**: per cluster, the seconds per step of the `compute` + `slowdown` buckets between consecutive
  `train` events (`time_s` deltas ÷ steps); their mean is the cluster step (slowest rank), their spread,
  scaled by √(steps per log interval), its per-step standard deviation; `dist.fit_max` turns both into one
  rank's distribution for the cluster's rank count (so a plan can change the rank count);
* **sync**: every blocking sync's wait — the *smaller* of the participants' `blocked_s` (the other one also
  waited for the slower cluster) — against the simulator's own model of it (`syncfit.py`: exchange, units
  one at a time beside the run's simulated link, the codec's timed cost taken as given, apply between,
  vote), least squares over `per_op_s` and `sw_bytes_per_s`; the fit needs at least two distinct message
  sizes (different compression or model across the runs) and says so otherwise;
* `sync_work_s`: the `sync` bucket ÷ syncs joined; `probe_s`: the verified rule's `probe` bucket ÷ syncs
  joined; `eval_s`: the `eval` bucket ÷ evaluations;
  `checkpoint_s`: the `checkpoint` bucket ÷ checkpoints written (when any); `startup_s`: the `startup`
  bucket; `other_step_s`: (`data` + `other`) ÷ steps; `quorum_s`: the blocked time of ddp steps beyond the
  all-reduce, when a ddp run is among them (else the default).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edit_train.codec.sparse_format import error_feedback_decay
from edit_train.plan import hardware, syncfit, traffic
from edit_train.plan.conditions import Conditions, measure
from edit_train.plan.costs import FWD_FRACTION
from edit_train.retired import current_event, current_rule_name, current_summary
from edit_train.plan.dist import fit_max
from edit_train.plan.profile import ClusterProfile, Profile
from edit_train.plan.spec import Candidate, TopK


RESTART_START_S = 5.0  # seconds from a restarted cluster job's spawn to its first step on this 2-core host


class CalibrationError(ValueError):
    """A run directory that cannot be calibrated from; the message names it and what is missing."""


@dataclass
class RunData:
    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    events: list[dict[str, Any]]


def read_run(path: str | Path) -> RunData:
    p = Path(path)
    if not p.is_dir():
        raise CalibrationError(f"calibrate: {p} is not a directory (give finished edit-train run directories)")
    out = {}
    for name in ("config.json", "summary.json"):
        f = p / name
        try:
            out[name] = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"calibrate: {f} cannot be read ({exc.__class__.__name__}); is {p} a "
                                   "finished edit-train run?") from None
    events = []
    mf = p / "metrics.jsonl"
    if not mf.is_file():
        raise CalibrationError(f"calibrate: {mf} is missing; is {p} a finished edit-train run?")
    for line in mf.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if isinstance(ev, dict):
            events.append(current_event(ev))  # a run dir from before the one-word rename reads as today's
    out["summary.json"] = current_summary(out["summary.json"], p)
    if not out["summary.json"].get("per_cluster"):
        raise CalibrationError(f"calibrate: {p}/summary.json has no per_cluster section")
    return RunData(p, out["config.json"], out["summary.json"], events)


def _model(cfg: dict[str, Any]) -> hardware.ModelFacts:
    m = cfg.get("model")
    return hardware.model_facts(m if isinstance(m, dict) else str(m), name=str((m or {}).get("name", "run"))
                                if isinstance(m, dict) else "")


def _cluster_steps(run: RunData, name: str) -> tuple[list[float], int]:
    """Seconds per step (compute + slowdown) of each logging interval of cluster `name` (`train` events)."""
    ev = sorted((e for e in run.events if e.get("event") == "train" and e.get("cluster") == name
                 and isinstance(e.get("time_s"), dict)), key=lambda e: e["step"])
    per, gap, prev = [], 0, 0
    for e in ev:  # time_s holds the buckets' seconds since the previous train event of this cluster
        d = int(e["step"]) - prev
        prev = int(e["step"])
        if d <= 0:
            continue
        secs = sum(float(e["time_s"].get(k, 0)) for k in ("compute", "slowdown"))
        if secs > 0:
            per.append(secs / d)
            gap = d
    return per, gap


def _slowdown(cfg: dict[str, Any], name: str, index: int) -> float:
    """A cluster's `slowdown` as `config.cluster_specs` reads it: from its `cluster.clusters` entry when the
    clusters are listed (`cluster.slowdown` is then ignored), else `cluster.slowdown[index]`."""
    cl = cfg.get("cluster") or {}
    specs = [s for s in cl.get("clusters") or [] if isinstance(s, dict)]
    if specs:
        return float(next((s.get("slowdown", 1.0) for s in specs if s.get("name") == name), 1.0))
    sl = cl.get("slowdown") or []
    return float(sl[index]) if 0 <= index < len(sl) else 1.0


def _link_s(cfg: dict[str, Any], nbytes: float, lanes: int) -> float:
    """Seconds of `nbytes` on the run's simulated link (latency + bytes / lanes / bandwidth)."""
    link = (cfg.get("cluster") or {}).get("link") or {}
    bw, lat = float(link.get("bandwidth_mbps") or 0), float(link.get("latency_ms") or 0) / 1000.0
    return lat + (nbytes / max(lanes, 1) / (bw * 1e6 / 8) if bw > 0 else 0.0)


def codec_of_run(cfg: dict[str, Any]) -> traffic.Codec:
    """The wire format a run's `sync` section configured."""
    sy = cfg.get("sync") or {}
    lossy = str(sy.get("compression", "none")) != "none"  # β only shapes a lossy codec's residual
    return traffic.Codec(str(sy.get("compression", "none")), int(sy.get("block_size", 256)),
                         str(sy.get("scale_dtype", "fp32")), float(sy.get("topk_density", 0.01)),
                         int(sy.get("bits", 2)), int(sy.get("topk_group", 1)), str(sy.get("unsent", "resend")),
                         # a run from before the key ran plain error feedback; one with it unset, today's default
                         error_feedback_decay(str(sy.get("compression", "none")), bool(sy.get("error_feedback", True)),
                                              sy.get("error_feedback_decay", 1.0), str(sy.get("unsent", "resend")))
                         if lossy else 1.0)


def candidate_of_run(run: RunData) -> Candidate:
    """The plan candidate a run ran: its algorithm, sync mode, compression (top-k settings), H or τ."""
    cfg = run.config
    algo, sy, c = cfg.get("algo") or {}, cfg.get("sync") or {}, codec_of_run(cfg)
    name = str(algo.get("name", run.summary.get("algo", "edit")))
    return Candidate(name, str(sy.get("mode", "layerwise")), c.scheme, int(algo.get("interval", 8)),
                     float(algo.get("sync_time_s", 0.0)) if name == "a_edit" else 0.0,
                     TopK(c.density, c.bits, c.group, c.unsent, c.ef_decay) if c.sparse else TopK())


def calibrate(run_dirs: list[str | Path], codec: dict[str, dict[str, list[float]]] | None = None,
              conditions: Conditions | None = None, compile_s: float = 0.0) -> Profile:
    """A profile from finished runs; `codec`: the codec's timings on this host (`cli/codec_cost.py`), taken
    off every sync before its software cost is fitted; `conditions`: the host's (None: measured now);
    `compile_s`: CPU seconds to compile a new top-k format's kernels (`codec_cost.compile_seconds`)."""
    if not run_dirs:
        raise CalibrationError("calibrate: give at least one run directory")
    runs = [read_run(p) for p in run_dirs]
    prof = Profile(codec=dict(codec or {}), codec_compile_s=float(compile_s))
    prof.conditions = (conditions or measure()).to_json()
    prof.sources = [str(r.path) for r in runs]
    first = runs[0].config
    facts = _model(first)
    prof.model = ""  # a dict preset: matched by workload below, not by name
    prof.batch_size = int(first["train"]["batch_size"])
    prof.seq_len = int(first["train"]["seq_len"])
    pooled: list[Any] = []
    samples: list[syncfit.SyncSample] = []
    evals, eval_s, ckpt_s, ckpts, work, joined, startup, other, steps, probe, probed = ([] for _ in range(11))
    ddp_extra: list[float] = []
    for run in runs:
        cfg, summ = run.config, run.summary
        rf = _model(cfg)
        for name, pc in summ["per_cluster"].items():
            t = pc.get("time") or {}
            per, gap = _cluster_steps(run, name)
            ranks, slow = int(pc.get("ranks", 1)), _slowdown(cfg, name, int(pc.get("index", -1)))
            if len(per) >= 2:
                mean = float(np.mean(per))
                std = float(np.std(per, ddof=1)) * math.sqrt(max(gap, 1))
                d = fit_max(mean, std, ranks)
                key = name if name not in prof.clusters else f"{run.path.name}/{name}"
                prof.clusters[key] = ClusterProfile(ranks, d, slow, int(pc.get("tokens_per_step", 0)), mean, std,
                                                    len(per))
                pooled.append(d.scaled(1.0 / max(slow, 1e-9)))
            n_eval = sum(1 for e in run.events if e.get("event") == "eval" and e.get("cluster") == name)
            if n_eval and t.get("eval"):
                eval_s.append(float(t["eval"])), evals.append(n_eval)
            ck = int(pc.get("checkpoints", 0) or 0)
            if ck and t.get("checkpoint"):
                ckpt_s.append(float(t["checkpoint"])), ckpts.append(ck)
            n_sync = int(pc.get("syncs_joined", pc.get("syncs", 0)) or 0)
            if n_sync and t.get("sync") is not None:
                work.append(float(t["sync"])), joined.append(n_sync)
            if n_sync and t.get("probe"):  # the verified rule's usefulness probe, its own bucket
                probe.append(float(t["probe"])), probed.append(n_sync)
            if t.get("startup") is not None:
                startup.append(float(t["startup"]))
            if pc.get("steps"):
                other.append(float(t.get("data", 0)) + float(t.get("other", 0))), steps.append(int(pc["steps"]))
        samples += _sync_samples(run, rf, prof)
        if summ.get("algo") == "ddp" and summ.get("steps"):
            for name, pc in summ["per_cluster"].items():
                per, _ = _cluster_steps(run, name)
                nbytes = float(pc.get("cross_cluster_bytes", 0)) / max(int(pc["steps"]), 1)
                if per:
                    blocked = float((pc.get("time") or {}).get("blocked", 0)) / max(int(pc["steps"]), 1)
                    ddp_extra.append(blocked - _link_s(cfg, nbytes, 1))
    if not prof.clusters:
        raise CalibrationError("calibrate: no cluster logged two or more `train` events with time_s; use "
                               "train.log_every smaller than train.steps / 3")
    prof.rank_step = _pool(pooled)
    fit: dict[str, Any] = {"clusters": {k: {"samples": c.samples, "mean_step_s": c.mean_step_s,
                                            "std_step_s": c.std_step_s, "sigma": c.dist.sigma}
                                        for k, c in prof.clusters.items()}}
    sizes = sorted(set(round(float(x.nbytes.sum())) for x in samples))
    if len(sizes) >= 2:
        prof.per_op_s, per_byte, fit["sync"] = syncfit.fit(samples)
        prof.sw_bytes_per_s = 1.0 / per_byte if per_byte > 0 else 0.0
        fit["sync"].update({"message_sizes": sizes, "sw_bytes_per_s": prof.sw_bytes_per_s})
    else:
        fit["sync"] = {"samples": len(samples), "message_sizes": sizes,
                       "note": "fewer than two message sizes: per-op/per-byte sync costs left at the defaults "
                               "(calibrate on runs with different sync.compression)"}
    if work:
        prof.sync_work_s = sum(work) / sum(joined)
    if probe:
        prof.probe_s = sum(probe) / sum(probed)
    if eval_s:
        prof.eval_s = sum(eval_s) / sum(evals)
    if ckpt_s:
        prof.checkpoint_s = sum(ckpt_s) / sum(ckpts)
    if startup:
        prof.startup_s = float(np.median(startup))
    if steps:
        prof.other_step_s = sum(other) / sum(steps)
    if ddp_extra:
        prof.quorum_s = max(float(np.median(ddp_extra)), 0.0)
        fit["quorum"] = {"samples": len(ddp_extra), "quorum_s": prof.quorum_s}
    fit.update({"probe_s": prof.probe_s, "eval_s": prof.eval_s, "checkpoint_s": prof.checkpoint_s, "startup_s": prof.startup_s,
                "other_step_s": prof.other_step_s, "sync_work_s": prof.sync_work_s,
                "model_params": facts.total_params})
    prof.fit = fit
    prof.calibrated = True
    return prof


def _pool(dists: list) -> Any:
    if not dists:
        return None
    from edit_train.plan.dist import StepDist

    med = float(np.median([d.median_s for d in dists]))
    return StepDist(med, float(np.median([d.sigma for d in dists])))


def scenario_of_run(run: RunData, profile: Profile, model: str = "tiny", host_cores: int = 0,
                    real_link: dict[str, float] | None = None) -> dict[str, Any]:
    """A plan scenario (as a dict for `spec.scenario_from_dict`) describing the run in `run`: its clusters
    (ranks, slowdown; step time from `profile`'s pooled rank), link, workload, fed. knobs and fixed steps.
    `model` names the preset the run used (config.json holds the resolved fields, not the name).

    `host_cores` > 0: every rank of the run shared one host of that many cores (the local launcher), each
    with one thread: the simulator shares the cores among whoever computes (`contention.py`).

    `real_link` ({bandwidth_mbps, latency_ms}): the clusters ran over a real link of that rate (namespace hosts,
    `edit_train/sim/hosts.py`) instead of edit-train's simulated one."""
    cfg, summ = run.config, run.summary
    cl, fed, tr = cfg.get("cluster") or {}, cfg.get("federation") or {}, cfg["train"]
    base = profile.rank_step
    if base is None:
        raise CalibrationError("scenario: the profile has no calibrated step time")
    clusters = []
    for name, pc in sorted(summ["per_cluster"].items(), key=lambda kv: int(kv[1].get("index", 0))):
        slow = _slowdown(cfg, name, int(pc.get("index", 0)))
        clusters.append({"name": name, "ranks": int(pc.get("ranks", 1)), "step_s": base.median_s,
                         "step_cv": base.sigma, "slowdown": max(slow, 1.0)})
    link = real_link or cl.get("link") or {}
    sy = cfg.get("sync") or {}
    kills = [{"cluster": str(f.get("cluster")), "step": int(f.get("step", f.get("start", 0)))}
             for f in cfg.get("faults") or [] if isinstance(f, dict) and f.get("kind") == "kill_cluster"]
    # a killed cluster is back after the launcher's delay plus a process start (spawn, imports, rendezvous):
    # RESTART_START_S, an assumption of this host (not calibrated; docs/planner.md)
    restart = float((cfg.get("run") or {}).get("restart_delay_s", 2.0)) + RESTART_START_S
    return {"name": run.path.name, "clusters": clusters, "model": model, "batch_size": int(tr["batch_size"]),
            "seq_len": int(tr["seq_len"]), "steps": int(summ.get("steps") or tr["steps"]),
            "link": {"bandwidth_mbps": float(link.get("bandwidth_mbps") or 0),
                     "latency_ms": float(link.get("latency_ms") or 0)},
            "simulated_link": real_link is None, "host_cores": max(int(host_cores), 0),
            "join_timeout_s": float(fed.get("join_timeout_s", 5.0)),
            "heartbeat_timeout_s": float(fed.get("heartbeat_timeout_s", 5.0)),
            "min_clusters": int(fed.get("min_clusters", 1)), "chunks": int(fed.get("chunks", 4)),
            "gather_max": int(sy.get("gather_max", 4)), "block_size": int(sy.get("block_size", 256)),
            "scale_dtype": str(sy.get("scale_dtype", "fp32")),
            "eval_every": int(tr.get("eval_every") or 0), "hours": 1.0,
            "failures": {"kills": kills, "restart_s": restart}}


def _sync_samples(run: RunData, rf: hardware.ModelFacts, prof: Profile) -> list[syncfit.SyncSample]:
    """Every blocking sync of `run` after the first (start-up skew) that two or more clusters joined, as the
    simulator sees it: the cluster that waited least, its units' bytes, link and codec seconds, its apply (the
    run's `sync` bucket per sync, by parameters) and under layer-wise its forward between the units."""
    cfg, summ = run.config, run.summary
    sy, mode = cfg.get("sync") or {}, str((cfg.get("sync") or {}).get("mode", "layerwise"))
    if mode not in ("at_end", "layerwise") or summ.get("algo") == "ddp":
        return []
    link = (cfg.get("cluster") or {}).get("link") or {}
    bw, lat = float(link.get("bandwidth_mbps") or 0) * 1e6 / 8, float(link.get("latency_ms") or 0) / 1e3
    ranks = {n: int(pc.get("ranks", 1)) for n, pc in summ["per_cluster"].items()}
    paired, chunks = len(set(ranks.values())) <= 1, int((cfg.get("federation") or {}).get("chunks", 4) or 4)
    wire, gather_max = codec_of_run(cfg), int(sy.get("gather_max", 4))
    needs = traffic.needs_of_rule(current_rule_name(cfg))
    share = np.asarray(rf.unit_sizes, dtype=float) / max(rf.total_params, 1)
    layer = np.array([float(n) if u[0].startswith("layers") else 0.0 for u, n in zip(rf.units, rf.unit_sizes)])
    syncs: dict[int, list[dict[str, Any]]] = {}
    for e in run.events:
        if e.get("event") == "sync" and e.get("bytes") is not None and e.get("blocked_s") is not None:
            syncs.setdefault(int(e["sync"]), []).append(e)
    out = []
    for k, evs in syncs.items():
        if k <= 1 or len(set(e.get("cluster") for e in evs)) < 2:
            continue
        e = min(evs, key=lambda x: float(x["blocked_s"]))
        pc = summ["per_cluster"].get(e.get("cluster")) or {}
        t, joined, r = pc.get("time") or {}, int(pc.get("syncs_joined", pc.get("syncs", 0)) or 0), ranks.get(e.get("cluster"), 1)
        world = len(e.get("quorum") or evs)
        nbytes = np.array([traffic.sync_bytes([n], world, wire, ranks=r, paired=paired, chunks=chunks,
                                              gather_max=gather_max, needs=needs) for n in rf.unit_sizes], dtype=float)
        lanes = traffic.lanes(r, paired, chunks)
        enc, dec = traffic.codec_values(rf.unit_sizes, world, wire, ranks=r, paired=paired, chunks=chunks,
                                        gather_max=gather_max, needs=needs)
        calls = len(rf.unit_sizes) * lanes
        codec = prof.codec_s(wire, (calls, enc), ((world - 1) * calls, dec)) / lanes * share
        between = float(t.get("sync", 0.0)) / max(joined, 1) * share
        if mode == "layerwise":
            per, _ = _cluster_steps(run, str(e.get("cluster")))
            between = between + (float(np.mean(per)) if per else 0.0) * FWD_FRACTION * layer / max(layer.sum(), 1.0)
        out.append(syncfit.SyncSample(nbytes, nbytes / lanes / bw if bw > 0 else np.zeros_like(nbytes), codec,
                                      between, lat, True, float(e["blocked_s"])))
    return out
