"""False positives of the `verified` rule on honest federations, and its attack columns (issue 65).

Every run is a federation of honest clusters — threads of this process over the real in-process transport
(`federation.inproc`), the real `LocalSGD` core and rule (`local_sgd/aggregation/verified.py`, the scale bound of
`scale.py`, the probe of `evidence.py`), as `tests/toy_federation.py` runs them — training a small MLP
(4 units) with AdamW under the product's lr shape (linear warm-up, cosine to 0.1 × at `train.steps`, flat
after it; `LrShape` given to the core). What differs between clusters is what differs between honest sites:

* speed: A-EDiT (`schedule.kind=time`, τ = 1 s of reported step time) with the clusters' seconds per step
  spread geometrically from 1 to the ratio (1:1, 1:3, 1:8, 1:12: the fastest takes 24 steps an interval, the
  slowest 24 / ratio), or EDiT (a step schedule, every cluster 8 steps);
* data: `iid` (one task, each cluster its own samples), `lang` (each site its own task: a shared map plus a
  site-specific one of the same size, like the four-language sites of `experiment=noniid_lang_4`) and
  `families` (one task, each site's inputs shifted: like the stdlib families);
* the cluster count (2, 4, 8) and the seed;
* the weighting (`algo.rule.verified.weighting`): every A-EDiT setting of unequal speeds runs under `tokens` (the
  default) and `uniform` (equal weights). The targets read each setting at the weighting its federation should
  declare (README): `uniform` for sites with their own task (`lang`), `tokens` where the task is shared; the other
  is measured beside it (`not_as_declared`).

Per run, from the observer's (c0's) decisions — every cluster decides the same — each honest unit-decision is
counted as clipped (`scale_clip`), held to the spread (`scale_hold`), down-weighted below its token share
(the token cap), left out (by reason: norm, direction, useless = probe, probation, misreported, non_finite)
or retracted, and every warning line any cluster logs, by mechanism (scale, probe, stop, claims, veto,
membership, other). The final loss (the anchor on every site's held-out data) is against the same run with
nothing tested (`tokens`: the verified rule's token weights, its tests, probe and scale bound off: what the
rule costs the honest) and under `algo.rule.name=uniform` (scale bound off; it differs from `tokens` by
weighing a slow site as much as a fast one, which on sites with their own data is most of the gap). The attack columns: cluster c1 lies in every sync (`sign_flip`,
`scale10` — 10× its Δ with its true norm reported, `garbage` — it trains on noise targets; from sync 7, when
every test is warm, as benchmarks/penalty_faults.py's window; `probe` — it scores every other update +1000 %,
from sync 1), counted as its share of lying syncs in which every unit left it out or clipped it to the median,
or for the probe liar the syncs after the first in which its scores were not counted.

    python benchmarks/false_positives.py --quick            # 2 and 4 clusters, 1:3 and 1:12, lang, seed 0
    python benchmarks/false_positives.py --seeds 0 --clusters 2 4 8 --only "n2_|n4_|n8_lang|attack"  # docs/: ~8 min
    python benchmarks/false_positives.py                    # 3 seeds, 8 clusters, both weightings: ~1.2 h
    python benchmarks/false_positives.py --product --quick  # the default demo, shortened, through edit-train

Measured wall time on 2 cores: the docs/ subset (35 honest settings × 3 runs + 11 attacks) 8 min.

`--product` runs `edit-train` subprocesses (`_common.run_job`, `--reuse`) on the default demo's configuration
(two clusters, 1:3, A-EDiT, model tiny) and the four-language 4-cluster experiment, shortened, and counts the
same from their `sync` events and logs. Output: results/false_positives.json and .png (`--out`, `--plot`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import math
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from edit_train.cluster.group import RankGroup  # noqa: E402
from edit_train.federation import heal  # noqa: E402
from edit_train.federation.inproc import InProcessFederation  # noqa: E402
from edit_train.local_sgd.sync import judge as judge_mod  # noqa: E402
from edit_train.local_sgd.sync.algorithms import LocalSGD, LocalSGDConfig  # noqa: E402
from edit_train.local_sgd.sync.outer import OuterConfig  # noqa: E402
from edit_train.local_sgd.aggregation.rules import RuleConfig  # noqa: E402
from edit_train.local_sgd.aggregation.scale import LrShape, scale_ratios  # noqa: E402
from edit_train.local_sgd.sync.schedule import ScheduleConfig  # noqa: E402
from edit_train.local_sgd.aggregation.verified import VerifiedConfig  # noqa: E402
from edit_train.sim.byzantine import corrupt  # noqa: E402

SYNCS = 20  # per run
NOMINAL = 8  # EDiT's interval, A-EDiT's first; train.steps = SYNCS × NOMINAL (the lr shape's end)
FAST = 24  # the fastest A-EDiT cluster's steps per interval
LR, WARMUP = 3e-3, 16
DIM_IN, DIM_H, DIM_OUT = 8, 32, 4
ATTACKS = ("sign_flip", "scale10", "garbage", "probe")
LIE_FROM = 7  # a payload or data liar lies from this sync on: every test warm (verified warm-up 5 syncs, as
# benchmarks/penalty_faults.py's window); from sync 1 a pair's history would be the lie's
MECHANISMS = {"pseudo-gradient": "scale", "probe scores": "probe", "voted to stop": "stop", "claims": "claims",
              "voted no": "veto", "left out of the sync": "membership"}

# ------------------------------------------------------------------------------------------- the observer
_DECISIONS: dict[str, list[dict[str, Any]]] = {}  # run key -> the observer's decisions
_CURRENT: dict[str, Any] = {"key": "", "observer": "c0", "spread": 3.0, "token_cap": 16.0}
_LOCK = threading.Lock()
_decide = judge_mod.Judge.decide


def _recording_decide(self: judge_mod.Judge, ev: Any) -> Any:
    d = _decide(self, ev)
    if self.core.transport.name == _CURRENT["observer"] and len(d.evidence) == len(ev.names):
        tokens = ev.extra.get("tokens", ev.steps)
        with _LOCK:
            _DECISIONS.setdefault(_CURRENT["key"], []).append({
                "sync": self.report.sync, "unit": ev.module, "names": list(ev.names),
                "contributes": list(ev.contributes), "weights": list(d.weights),
                "tokens": [float(t) for t in tokens], "evidence": [dict(e) for e in d.evidence],
                "ratios": scale_ratios(ev, math.inf, self.core.lr_shape)})
    return d


judge_mod.Judge.decide = _recording_decide  # type: ignore[method-assign]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def mechanism(line: str) -> str:
    return next((m for k, m in MECHANISMS.items() if k in line), "other")


# ------------------------------------------------------------------------------------------- the federation
_INIT = threading.Lock()  # the global RNG: clusters that are threads must not interleave their inits


def model() -> nn.Sequential:
    with _INIT:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(DIM_IN, DIM_H), nn.Tanh(), nn.Linear(DIM_H, DIM_H), nn.Tanh(),
                             nn.Linear(DIM_H, DIM_H), nn.Tanh(), nn.Linear(DIM_H, DIM_OUT))


def units(m: nn.Sequential) -> list[nn.Module]:
    return [m[0], m[2], m[4], m[6]]


def site_task(data: str, site: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(input shift, map, site map) of site `site`."""
    g = torch.Generator().manual_seed(100 + seed)
    shared = torch.randn(DIM_IN, DIM_OUT, generator=g)
    own = torch.randn(DIM_IN, DIM_OUT, generator=torch.Generator().manual_seed(1000 * (seed + 1) + site))
    shift = torch.zeros(DIM_IN)
    if data == "families":
        shift = 0.75 * torch.randn(DIM_IN, generator=torch.Generator().manual_seed(5000 + 31 * seed + site))
    return shift, shared, own if data == "lang" else torch.zeros_like(own)


def batch(task: tuple[Tensor, Tensor, Tensor], stream: int, step: int, garbage: bool = False) -> tuple[Tensor, Tensor]:
    shift, shared, own = task
    g = torch.Generator().manual_seed(stream * 100_003 + step)
    x = torch.randn(16, DIM_IN, generator=g) + shift
    y = torch.tanh(x @ shared) + torch.tanh(x @ own)
    if garbage:
        y = 3.0 * torch.randn(y.shape, generator=g)
    return x, y


def config(rule: str, schedule: str, n: int, probe: bool, weighting: str = "tokens") -> LocalSGDConfig:
    steps = SYNCS * NOMINAL
    sched = ScheduleConfig(kind="time", interval=NOMINAL, sync_time_s=1.0) if schedule == "a_edit" else \
        ScheduleConfig(kind="step", interval=NOMINAL)
    verified = VerifiedConfig(warmup_syncs=5, sketch_dim=256, probe_tokens=16 if probe else 0,
                              max_token_ratio=float(_CURRENT["token_cap"]), weighting=weighting)
    if rule == "tokens":  # the verified rule's token weights with nothing tested: what it does when nothing fires
        verified = dataclasses.replace(verified, anomaly=False, probe_tokens=0)
    r = RuleConfig(name="verified" if rule == "tokens" else rule, clip_threshold=10.0, verified=verified)
    r = dataclasses.replace(r, scale_spread=float(_CURRENT["spread"]))
    if rule != "verified":
        r = dataclasses.replace(r, scale_bound=0.0, scale_spread=0.0)
    return LocalSGDConfig(schedule=sched, outer=OuterConfig(lr=0.7, momentum=0.8, nesterov=True), rule=r,
                          mode="at_end", total_steps=steps, lr_shape=LrShape(WARMUP, steps, 0.1))


def secs_per_step(schedule: str, ratio: float, n: int, i: int) -> float:
    if schedule != "a_edit":
        return 0.01
    return (ratio ** (i / max(n - 1, 1))) / FAST  # the fastest FAST steps a second, the slowest FAST / ratio


class PayloadLiar:
    """A cluster's transport that corrupts every contribution it sends from sync `LIE_FROM` on
    (`sim.byzantine.corrupt`; its reported norms stay its true ones), counting syncs by its norm exchanges."""

    def __init__(self, inner: Any, kind: str, seed: int) -> None:
        self.inner, self.kind, self.gen, self.sync = inner, kind, torch.Generator().manual_seed(seed), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_gather(self, vec: Tensor, what: str = "") -> Any:
        self.sync += what == "norm exchange"
        return self.inner.all_gather(vec, what)

    def _out(self, tensors: list[Tensor], key: str) -> list[Tensor]:
        lying = key and self.sync >= LIE_FROM
        return corrupt("sign_flip" if self.kind == "sign_flip" else "lie_norm", tensors, self.gen) if lying else tensors

    def gather(self, tensors: list[Tensor], params: Any = None, key: str = "", **kw: Any) -> Any:
        return self.inner.gather(self._out(tensors, key), params, key, **kw)

    def reduce_(self, tensors: list[Tensor], params: Any = None, key: str = "", **kw: Any) -> Any:
        sent = self._out(tensors, key)
        if sent is tensors:
            return self.inner.reduce_(tensors, params, key, **kw)
        from edit_train.sim.byzantine import _Into

        return _Into(self.inner.reduce_(sent, params, key, **kw), sent, tensors)


class ProbeLiar:
    """Scores every other cluster's update +1000 % in every norm exchange (tests/test_insiders_probe_heal.py)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_gather(self, vec: Tensor, what: str = "") -> Any:
        q = self.inner.quorum
        if what == "norm exchange" and q is not None:
            p = len(q.names)
            vec = vec.clone()
            vec[-p:] = torch.tensor([math.nan if i == q.me else 10.0 for i in range(p)], dtype=vec.dtype)
        return self.inner.all_gather(vec, what)


def train(i: int, name: str, transport: Any, cfg: LocalSGDConfig, task: Any, seed: int, step_s: float,
          probe: bool, garbage: bool, events: list[dict[str, Any]]) -> list[list[Tensor]]:
    torch.set_num_threads(1)
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0)
    shape = cfg.lr_shape
    assert shape is not None
    held = batch(task, 10_000 + i, 0)
    probe_loss = (lambda: float(nn.functional.mse_loss(m(held[0]), held[1]))) if probe else None

    def emit(event: str, **kw: Any) -> None:
        events.append({"event": event, "cluster": name, **kw})

    algo = LocalSGD(cfg, m, units(m), transport, (heal.encode, heal.decode), emit=emit, cluster_index=i,
                    optimizer=opt, probe_loss=probe_loss)
    adopted = algo.join()
    step = adopted if adopted is not None else 0
    while not algo.should_stop(step) and sum(e["event"] == "sync" and e["cluster"] == name for e in events) < SYNCS:
        for g in opt.param_groups:
            g["lr"] = LR * shape.at(step)
        syncs = sum(e["event"] == "sync" and e["cluster"] == name for e in events)
        x, y = batch(task, 7 * (seed + 1) + 1000 * i, step, garbage and syncs >= LIE_FROM - 1)
        nn.functional.mse_loss(m(x), y).backward()
        algo.after_backward(step)
        opt.step()
        opt.zero_grad()
        outcome = algo.after_step(step, step_s)
        step = outcome.adopt_step if outcome.adopt_step is not None else step + 1
    algo.finish()
    assert algo.driver is not None
    anchors = [[a.clone() for a in algo.driver.core.outer.anchors[u.name]] for u in algo.replica.units]
    algo.close()
    return anchors


def final_loss(anchors: list[list[Tensor]], tasks: list[Any]) -> float:
    m = model()
    with torch.no_grad():
        for u, a in zip(units(m), anchors):
            for p, t in zip(u.parameters(), a):
                p.copy_(t)
        return sum(float(nn.functional.mse_loss(m(x), y)) for x, y in
                   (batch(t, 50_000 + j, 0) for j, t in enumerate(tasks))) / len(tasks)


def run(s: dict[str, Any], rule: str = "verified") -> dict[str, Any]:
    """One federation of setting `s` under `rule`: its counts and final loss."""
    n, key = s["clusters"], f"{s['name']}/{rule}"
    names = [f"c{i}" for i in range(n)]
    tasks = [site_task(s["data"], i, s["seed"]) for i in range(n)]
    probe = rule == "verified"
    cfg = config(rule, s["schedule"], n, probe, s.get("weighting", "tokens"))
    hub = InProcessFederation(min_clusters=n, join_timeout_s=60.0, timeout_s=60.0)
    liar, attack = ("c1", s["attack"]) if s.get("attack") else (None, None)
    events: list[dict[str, Any]] = []
    anchors: dict[str, Any] = {}
    errors: list[BaseException] = []
    warn = _Warnings()
    logging.getLogger("edit_train").addHandler(warn)
    _CURRENT["key"] = key
    _DECISIONS.pop(key, None)

    def one(i: int, name: str) -> None:
        try:
            t: Any = hub.transport(name, RankGroup())
            if name == liar and attack in ("sign_flip", "scale10"):
                t = PayloadLiar(t, attack, s["seed"])
            elif name == liar and attack == "probe":
                t = ProbeLiar(t)
            anchors[name] = train(i, name, t, cfg, tasks[i], s["seed"], secs_per_step(s["schedule"], s["ratio"], n, i),
                                  probe, name == liar and attack == "garbage", events)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i, nm), daemon=True) for i, nm in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    logging.getLogger("edit_train").removeHandler(warn)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"{key}: {errors[0] if errors else 'a cluster thread hung'}")
    out = {"rule": rule, "wall_s": time.perf_counter() - t0,
           "final_loss": final_loss(anchors["c0"], [tk for nm, tk in zip(names, tasks) if nm != liar])}
    if rule == "verified":
        out.update(count(_DECISIONS.get(key, []), events, warn.lines, liar, attack, s.get("weighting", "tokens")))
    return out


def count(decisions: list[dict[str, Any]], events: list[dict[str, Any]], warnings: list[str], liar: str | None,
          attack: str | None, weighting: str = "tokens") -> dict[str, Any]:
    """The honest unit-decisions by what was done to them (below its share: its claimed tokens' share, or under
    `weighting=uniform` the equal share), the warnings by mechanism, and the liar's record."""
    c: dict[str, int] = {"unit_decisions": 0, "clipped": 0, "held": 0, "below_token_share": 0, "left_out": 0}
    left: dict[str, int] = {}
    ratios = [r for d in decisions for j, r in d["ratios"].items() if d["names"][j] != liar]
    liar_syncs: dict[int, bool] = {}
    last = {(d["sync"], d["unit"]): d for d in decisions}  # a sketched SUM decides twice: the regathered counts
    for d in last.values():
        contributors = [j for j, ok in enumerate(d["contributes"]) if ok]
        total = sum(d["tokens"][j] for j in contributors)
        for j in contributors:
            name, w, e = d["names"][j], d["weights"][j], d["evidence"][j]
            if name == liar:
                if d["sync"] >= LIE_FROM:
                    liar_syncs[d["sync"]] = liar_syncs.get(d["sync"], True) and (w == 0.0 or "scale_clip" in e)
                continue
            c["unit_decisions"] += 1
            if w == 0.0:
                c["left_out"] += 1
                for r in e.get("reasons", []) or ["other"]:
                    left[r] = left.get(r, 0) + 1
            elif "scale_clip" in e:
                c["clipped"] += 1
            elif "scale_hold" in e:
                c["held"] += 1
            elif total > 0 and w < (1 - 1e-6) * (1 / len(contributors) if weighting == "uniform" else
                                                 d["tokens"][j] / total):
                c["below_token_share"] += 1
    syncs = [e for e in events if e["event"] == "sync" and e["cluster"] != liar]
    retracted = sum(len([k for k in e.get("retracted", {}) if k != liar]) for e in syncs)
    named = sorted({x["cluster"] for e in syncs for x in e.get("suspects", []) if x["cluster"] != liar
                    and "voted to stop" not in x["what"]})  # stop votes: the lead's A-EDiT stop
    honest_warnings = [w for w in warnings if liar is None or f"cluster {liar} " not in w.split(":", 1)[-1]]
    by: dict[str, int] = {}
    for w in honest_warnings:
        by[mechanism(w)] = by.get(mechanism(w), 0) + 1
    out: dict[str, Any] = {**c, "left_out_by": left, "scale_ratio_max": max(ratios, default=None),
                           "scale_ratio_p99": sorted(ratios)[int(0.99 * (len(ratios) - 1))] if ratios else None, "retracted": retracted, "named": named,
                           "warnings": len(honest_warnings), "warnings_by": by,
                           "warning_lines": sorted(set(honest_warnings))[:6]}
    if liar is not None:
        if attack == "probe":
            lying = [e for e in syncs if e["sync"] > 1]
            out["liar_caught"] = sum(liar in e.get("probe_suspects", {}) for e in lying) / max(len(lying), 1)
        else:
            out["liar_caught"] = sum(liar_syncs.values()) / max(len(liar_syncs), 1)
        out["liar_named"] = any(x["cluster"] == liar for e in syncs for x in e.get("suspects", []))
    return out


# ------------------------------------------------------------------------------------------- the matrix
def settings(quick: bool, seeds: list[int], clusters: list[int]) -> list[dict[str, Any]]:
    out = []
    speeds = [("edit", 1), ("a_edit", 1), ("a_edit", 3), ("a_edit", 8), ("a_edit", 12)]
    datas = ["iid", "lang", "families"]
    if quick:
        speeds, datas = [("a_edit", 3), ("a_edit", 12)], ["lang"]
    for (schedule, ratio), n, data, seed in itertools.product(speeds, clusters, datas, seeds):
        # both weightings where speeds differ (at 1:1 the claims are equal and so are the weights); the one a
        # federation should declare (README): `uniform` for sites with their own task (lang), `tokens` elsewhere
        weightings = ["tokens", "uniform"] if ratio > 1 else ["tokens"]
        for weighting in weightings:
            tag = "_uniform" if weighting == "uniform" else ""
            out.append({"name": f"{schedule}_1to{ratio}_n{n}_{data}{tag}_s{seed}", "schedule": schedule,
                        "ratio": ratio, "clusters": n, "data": data, "seed": seed, "weighting": weighting})
    for attack, n in itertools.product(ATTACKS, [2, 4, 8] if not quick else [4]):
        if attack == "probe" and n == 2:
            continue  # one evaluator per update decides nothing (evidence.probe_judgement)
        out.append({"name": f"attack_{attack}_n{n}", "schedule": "a_edit", "ratio": 3, "clusters": n, "data": "iid",
                    "seed": 0, "attack": attack})
    return out


def _acted(r: dict[str, Any]) -> bool:
    return r["clipped"] + r["held"] + r["below_token_share"] + r["left_out"] + r["retracted"] > 0


def declared(r: dict[str, Any]) -> bool:
    """Is run `r` at the weighting its federation should declare (README): `uniform` for sites with their own task,
    `tokens` where the task is shared; at equal speeds the two are one."""
    return (r.get("weighting", "tokens") == "uniform") == (r["data"] == "lang") or r["ratio"] == 1


def fp_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """What the rule did to honest unit-decisions over `rows` (the targets' counts)."""
    return {"runs": len(rows), "unit_decisions": sum(r["unit_decisions"] for r in rows),
            **{k: sum(r[k] for r in rows) for k in ("clipped", "held", "left_out", "retracted", "warnings")},
            "named": sum(len(r["named"]) for r in rows)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    everyone = [r for r in rows if not r.get("attack")]
    honest = [r for r in everyone if declared(r)]  # the targets: each federation at the weighting it should declare
    attacks = [r for r in rows if r.get("attack")]
    decisions = sum(r["unit_decisions"] for r in honest)
    return {
        # the same honest settings at the other weighting (reported, not a target: e.g. equal weights on one task)
        "not_as_declared": {**fp_counts([r for r in everyone if not declared(r)]),
                            "lines": sorted({f"{r['name']}: {w}" for r in everyone if not declared(r)
                                             for w in r["warning_lines"]})[:6],
                            "worst_loss_ratio": max((r["loss_ratio"] for r in everyone if not declared(r)),
                                                    default=None)},
        "runs": len(honest), "unit_decisions": decisions,
        "clipped": sum(r["clipped"] for r in honest), "left_out": sum(r["left_out"] for r in honest),
        "retracted": sum(r["retracted"] for r in honest), "named": sum(len(r["named"]) for r in honest),
        "warnings": sum(r["warnings"] for r in honest),
        "stop_warnings": sum(r["warnings_by"].get("stop", 0) for r in honest),
        "named_besides_stop": sorted({f"{r['name']}: {w}" for r in honest for w in r["warning_lines"]
                                      if mechanism(w) != "stop"})[:20],
        "down_weighted_share": (sum(r["held"] + r["below_token_share"] for r in honest) / max(decisions, 1)),
        "worst_loss_ratio": max((r["loss_ratio"] for r in honest), default=None),
        # the runs in which the rule did anything to an honest unit-decision; where it did nothing its weights are the
        # nothing-tested run's, and the two differ only by the threads' timing (8 clusters on 2 cores: which member
        # makes which quorum; two `tokens` runs differ as much, docs/security.md)
        "worst_loss_ratio_acted": max((r["loss_ratio"] for r in honest if _acted(r)), default=None),
        "attacks_min_caught": min((r["liar_caught"] for r in attacks), default=None),
        # weighting=uniform: the rule against equal weights with nothing tested, on every setting where the run is
        # deterministic (2 and 4 clusters) or the rule acted; at 8 clusters on 2 cores the threads' timing alone
        # (which member makes which quorum) moves the final loss both ways — reported beside it
        "worst_uniform_ratio_uniform_weighting": max((r["uniform_ratio"] for r in honest
                                                      if r.get("weighting") == "uniform"
                                                      and (r["clusters"] <= 4 or _acted(r))), default=None),
        "uniform_ratio_uniform_weighting_8": [f(r["uniform_ratio"] for r in honest if r.get("weighting") == "uniform"
                                                and r["clusters"] > 4) for f in (min, max)]
        if any(r.get("weighting") == "uniform" and r["clusters"] > 4 for r in honest) else None,
        # what the weighting chooses (not a defence): the token weights' final loss over equal weights', per data
        "tokens_over_uniform": {d: [min(v), max(v)] for d in ("iid", "lang", "families")
                                if (v := [r["uniform_ratio"] for r in everyone if r["data"] == d
                                          and r.get("weighting", "tokens") == "tokens" and r["ratio"] > 1])},
    }


def targets(s: dict[str, Any]) -> dict[str, Any]:
    """The issue's acceptance on this matrix."""
    def t(value: Any, bound: float, ok: bool) -> dict[str, Any]:
        return {"value": value, "bound": bound, "pass": ok}

    out = {"honest clipped + left out + retracted": t(s["clipped"] + s["left_out"] + s["retracted"], 0,
                                                      s["clipped"] + s["left_out"] + s["retracted"] == 0),
           "honest clusters named": t(s["named"], 0, s["named"] == 0),
           "warnings (stop votes: the lead's A-EDiT stop, apart)": t(s["warnings"] - s["stop_warnings"], 0,
                                                                     s["warnings"] == s["stop_warnings"]),
           "down-weighted below the token share": t(s["down_weighted_share"], 0.01, s["down_weighted_share"] <= 0.01),
           "final loss / nothing tested, where the rule acted": t(s["worst_loss_ratio_acted"], 1.002,
                                                                 (s["worst_loss_ratio_acted"] or 0) <= 1.002)}
    u = s.get("worst_uniform_ratio_uniform_weighting")
    if u is not None:
        out["final loss / uniform at weighting=uniform (2-4 clusters, or where the rule acted)"] = t(u, 1.002, u <= 1.002)
    if s["attacks_min_caught"] is not None:
        out["liar caught in its lying syncs"] = t(s["attacks_min_caught"], 0.95, s["attacks_min_caught"] >= 0.95)
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = C.pyplot()
    honest = [r for r in rows if not r.get("attack")]
    attacks = [r for r in rows if r.get("attack")]
    fig, (a, c, b) = plt.subplots(1, 3, figsize=(18, 4.5))
    colors = {"iid": "tab:blue", "lang": "tab:red", "families": "tab:green"}
    chosen = [r for r in honest if r.get("weighting", "tokens") == "tokens" and r["ratio"] > 1]
    for d, col in colors.items():
        pts = [(math.log(r["ratio"]) + 0.08 * math.log2(r["clusters"]), r["uniform_ratio"]) for r in chosen
               if r["data"] == d]
        if pts:
            c.scatter(*zip(*pts), color=col, label=d, s=14)
    c.axhline(1.0, color="k", lw=0.8)
    c.set_yscale("log")
    c.set_xticks([math.log(x) for x in (3, 8, 12)], ["1:3", "1:8", "1:12"])
    c.set_ylabel("final loss, tokens / uniform weighting")
    c.set_title("the weighting's choice (A-EDiT; per ratio 2-4-8 clusters)")
    c.legend(fontsize=8)
    def color(r: dict[str, Any]) -> str:
        fired = r["clipped"] + r["left_out"] + r["retracted"]
        warned = r["held"] or r["warnings"] > r["warnings_by"].get("stop", 0)
        if not declared(r):  # the setting at the other weighting: measured, not a target
            return "salmon" if fired else "navajowhite" if warned else "lightgray"
        return "tab:red" if fired else "tab:orange" if warned else "tab:green"

    a.bar(range(len(honest)), [100 * (r["loss_ratio"] - 1) for r in honest], color=[color(r) for r in honest])
    a.axhline(0.2, color="k", lw=0.8, ls="--")
    a.set_xticks(range(len(honest)), [r["name"] for r in honest], rotation=90, fontsize=5)
    a.set_ylabel("final loss vs nothing tested (%)")
    a.set_title("honest runs (red: left out / clipped; orange: held or warned;\npale: at the weighting not to declare)",
                fontsize=9)
    b.bar(range(len(attacks)), [100 * r["liar_caught"] for r in attacks], color="tab:blue")
    b.axhline(95, color="k", lw=0.8, ls="--")
    b.set_xticks(range(len(attacks)), [r["name"] for r in attacks], rotation=60, fontsize=7)
    b.set_ylabel("liar caught in its lying syncs (%)")
    b.set_title("attacks (one liar, c1)")
    C.save_fig(fig, path)


def main() -> None:
    ap = C.parser(__doc__, out="false_positives.json", plot="false_positives.png")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--clusters", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--spread", type=float, default=3.0, help="algo.rule.scale_spread of the verified runs")
    ap.add_argument("--token-cap", type=float, default=16.0,
                    help="algo.rule.verified.max_token_ratio of the verified runs (1: equal weights, tests kept)")
    ap.add_argument("--only", default="", help="a regex: run only the settings whose name matches")
    ap.add_argument("--product", action="store_true", help="edit-train subprocesses (see the docstring)")
    ap.add_argument("--merge", action="store_true", help="keep the --out file's other runs (replace those run now)")
    args = C.parse(ap)
    if args.smoke:
        global SYNCS
        SYNCS = 3  # the first setting's three federations, three syncs each
    if args.product:
        return product(args)
    _CURRENT["spread"] = args.spread
    _CURRENT["token_cap"] = args.token_cap
    rows = []
    todo = [s for s in settings(args.quick or args.smoke, args.seeds[:1] if args.quick or args.smoke else args.seeds,
                                [2] if args.smoke else [2, 4] if args.quick else args.clusters)
            if re.search(args.only, s["name"])][:1 if args.smoke else None]  # --smoke: the first setting
    t0 = time.perf_counter()
    for k, s in enumerate(todo):
        got = run(s)
        ref, tok = run(s, "uniform"), run(s, "tokens")
        row = {**s, **got, "uniform_loss": ref["final_loss"], "uniform_ratio": got["final_loss"] / ref["final_loss"],
               "tokens_loss": tok["final_loss"], "loss_ratio": got["final_loss"] / tok["final_loss"]}
        rows.append(row)
        left = (time.perf_counter() - t0) / (k + 1) * (len(todo) - k - 1)
        extra = f" liar caught {row['liar_caught']:.0%}" if s.get("attack") else ""
        print(f"[{k + 1}/{len(todo)}] {s['name']}: clipped {row['clipped']} held {row['held']} below-share "
              f"{row['below_token_share']} ratio max {row['scale_ratio_max']:.2f} left out {row['left_out']} {row['left_out_by']} warnings "
              f"{row['warnings_by']} loss/tokens {row['loss_ratio']:.4f} /uniform {row['uniform_ratio']:.4f}{extra} (ETA {left / 60:.0f} min)", flush=True)
    if args.merge and args.out.exists():
        import json

        ran = {r["name"] for r in rows}
        rows = [r for r in json.loads(args.out.read_text())["runs"] if r["name"] not in ran] + rows
    summary = summarize(rows)
    C.write_json(args.out, {"environment": C.environment(), "load": C.load(), "command": " ".join(sys.argv),
                            "targets": targets(summary), "summary": summary, "runs": rows})
    plot(rows, args.plot)
    print(C.table([r for r in rows if not r.get("attack")],
                  [("name", "honest run", ""), ("clipped", "clip", "d"), ("held", "held", "d"),
                   ("below_token_share", "<share", "d"), ("left_out", "out", "d"), ("retracted", "back", "d"),
                   ("warnings", "warn", "d"), ("loss_ratio", "loss/tokens", ".4f"),
                   ("uniform_ratio", "loss/uniform", ".4f")]))
    print(C.table([r for r in rows if r.get("attack")],
                  [("name", "attack", ""), ("liar_caught", "caught", ".2f"), ("liar_named", "named", ""),
                   ("left_out", "honest out", "d"), ("loss_ratio", "loss/tokens", ".4f")]))
    C.print_targets(summary, args.out, args.plot)


def product(args: argparse.Namespace) -> None:
    """The default demo (and with the full mode the four-language 4-cluster experiment) through edit-train."""
    runs = [("demo_48", ["train.steps=48"])]
    if not args.quick:
        runs.append(("lang4_64", ["experiment=noniid_lang_4", "train.steps=64"]))
    rows = []
    for name, overrides in runs:
        job = C.run_job(name, (C.smoke_dir("runs") if args.smoke else C.RUNS_DIR / "false_positives") / name, overrides,
                        reuse=True)
        syncs = [e for e in job.metrics if e.get("event") == "sync"]
        log = (job.run_dir / "job.log").read_text(errors="replace").splitlines()
        warnings = [ln for ln in log if re.search(r"cluster \w+: cluster \w+ ", ln)]
        by: dict[str, int] = {}
        for w in warnings:
            by[mechanism(w)] = by.get(mechanism(w), 0) + 1
        rows.append({"name": name, "overrides": overrides, "syncs": len(syncs),
                     "anomalous_syncs": sum(bool(e.get("anomalous_modules")) for e in syncs),
                     "named": sorted({x["cluster"] for e in syncs for x in e.get("suspects", [])}),
                     "warnings_by": by, "final_val_loss": job.summary.get("final_val_loss")})
        print(rows[-1], flush=True)
    C.write_json(args.out.with_name(args.out.stem + "_product.json"), {"environment": C.environment(), "runs": rows})


if __name__ == "__main__":
    main()
