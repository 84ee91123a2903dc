"""Helpers for the tuned mode of benchmarks/convergence.py (`--tune` / `--confirm`): the settings each
algorithm is tuned over, run directories, progress/ETA, the grid tables, flagged-module counts, the
edit/ddp gap along training, and the figure (best curves per cluster count + outer-grid heatmaps).

Imported as ``_tuning`` by convergence.py (``python benchmarks/convergence.py`` puts this folder on sys.path).
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import _common as C

TUNE_SEED, TUNE_GROUPS = 0, 2  # the grid runs on seed 0 at 2 clusters

# Outer optimizer tuned (outer lr x momentum grid at the base inner lr, then the inner lr grid at the best).
OUTER_TUNED = ("diloco", "edit")
# post_local_sgd's outer step is plain parameter averaging by definition (outer SGD lr 1, momentum 0):
# only its inner lr is tuned, and the definition is pinned explicitly on every run.
AVERAGING = (1.0, 0.0)


def option_variants(algo: str, steps: int, interval: int) -> dict[str, tuple[str, ...]]:
    """Issue 51's options, tried at an algorithm's best point (the "options" stage): Muon inner steps for every
    algorithm (at each of the Muon lrs, `option_grid`); for the outer-tuned ones also Pier's outer-momentum
    warm-up and outer-lr schedule (warm-up over the first ~10 % of the syncs, cosine to 0.1 x at the last)."""
    syncs = max(2, steps // max(interval, 1))
    warm = max(1, syncs // 10)
    out: dict[str, tuple[str, ...]] = {"muon": ("train.optimizer=muon",)}
    if algo in OUTER_TUNED:
        out["outer_warmup"] = (f"algo.outer.momentum_warmup_syncs={warm}",)
        out["outer_schedule"] = (f"algo.outer.lr_warmup_syncs={warm}", f"algo.outer.lr_decay_syncs={syncs}")
    return out


def _num(x: float) -> str:
    """A float as Hydra should read it (0.0, 0.003, 0.7: always a float literal)."""
    return repr(float(x))


def finite_loss(v: Any) -> float:
    """A val loss for ranking: missing / non-finite (diverged, failed) -> +inf."""
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else math.inf


@dataclass(frozen=True)
class Setting:
    """One point of an algorithm's tuning space: inner lr (`train.lr`) and, for local SGD, the outer SGD."""

    algo: str
    lr: float
    outer_lr: float | None = None
    outer_momentum: float | None = None
    variant: str = ""  # an issue-51 option tried at the best point ("" = none; option_variants)
    extra: tuple[str, ...] = ()  # its overrides

    @property
    def nesterov(self) -> bool | None:
        return None if self.outer_momentum is None else self.outer_momentum > 0

    def overrides(self) -> list[str]:
        out = [f"train.lr={_num(self.lr)}"]
        if self.outer_lr is not None:
            out += [f"algo.outer.lr={_num(self.outer_lr)}", f"algo.outer.momentum={_num(self.outer_momentum)}",
                    f"algo.outer.nesterov={'true' if self.nesterov else 'false'}"]
        return out + list(self.extra)

    def tag(self) -> str:
        """Run-directory name."""
        suffix = f"_{self.variant}" if self.variant else ""
        if self.algo in OUTER_TUNED:
            return f"lr{self.lr:g}_olr{self.outer_lr:g}_om{self.outer_momentum:g}{suffix}"
        return f"lr{self.lr:g}{suffix}"

    def label(self) -> str:
        s = f"lr {self.lr:g}" + (f", {self.variant}" if self.variant else "")
        if self.algo == "post_local_sgd":
            return s + ", averaging"
        if self.outer_lr is not None:
            s += f", outer {self.outer_lr:g}/{self.outer_momentum:g}{' Nesterov' if self.nesterov else ''}"
        return s

    def as_dict(self) -> dict[str, Any]:
        return {"algo": self.algo, "lr": self.lr, "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "nesterov": self.nesterov, "variant": self.variant,
                "extra": list(self.extra)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Setting:
        return cls(d["algo"], float(d["lr"]), d.get("outer_lr"), d.get("outer_momentum"), str(d.get("variant", "")),
                   tuple(d.get("extra", ())))


def base_setting(algo: str, lr: float) -> Setting:
    if algo == "post_local_sgd":
        return Setting(algo, lr, *AVERAGING)
    return Setting(algo, lr)


def outer_grid(algo: str, lr: float, outer_lrs: Sequence[float], momenta: Sequence[float]) -> list[Setting]:
    return [Setting(algo, lr, olr, m) for olr in outer_lrs for m in momenta]


def inner_grid(best: Setting, lrs: Sequence[float]) -> list[Setting]:
    return [replace(best, lr=lr) for lr in lrs]


MUON_LRS = (1e-2, 2e-2, 4e-2)  # Muon's own lr grid: its optimum is not AdamW's (tiny, seed 0, 2 clusters: DDP
# 2.06 at AdamW's 3e-3, 1.72 at 1e-2, 1.66 at 2e-2 — `adjust_lr_fn="match_rms_adamw"` matches the RMS of one
# update, not the lr that trains best)


def option_grid(best: Setting, muon_lrs: Sequence[float], steps: int, interval: int) -> list[Setting]:
    """The options stage, the same for every algorithm: Muon at each of `muon_lrs` at the best point (its outer
    settings kept); diloco and edit also Pier's two options at the best point."""
    variants = option_variants(best.algo, steps, interval)
    extra = variants.pop("muon")
    muon = [replace(best, lr=lr, variant="muon", extra=extra) for lr in dict.fromkeys(muon_lrs)]
    return muon + [replace(best, variant=v, extra=o) for v, o in variants.items()]


def planned_tune_runs(algos: Sequence[str], inner_lrs: Sequence[float], base_lr: float,
                      outer_lrs: Sequence[float], momenta: Sequence[float], options: bool = False,
                      muon_lrs: Sequence[float] = MUON_LRS) -> int:
    n = 0
    for algo in algos:
        if options:
            n += len(set(muon_lrs)) + (2 if algo in OUTER_TUNED else 0)
        if algo in OUTER_TUNED:  # the inner run at the base lr is the best outer point itself
            n += len(outer_lrs) * len(momenta) + len([x for x in set(inner_lrs) if x != base_lr])
        else:
            n += len(set(inner_lrs))
    return n


class Progress:
    """Counts runs and prints an ETA after every run that actually trained (reused runs cost ~0 s).
    A run at G clusters is estimated from the mean wall of runs at G, else scaled by G from the others
    (2 cores: G one-rank clusters share them)."""

    def __init__(self, planned: list[int]) -> None:
        self.planned = list(planned)  # the cluster count of every run still to come
        self.total = len(planned)
        self.done_n = 0
        self.walls: list[tuple[int, float]] = []  # (groups, job wall) of the runs that trained here
        self.reused = 0
        self.t0 = time.perf_counter()

    def estimate(self, groups: int) -> float:
        same = [w for g, w in self.walls if g == groups]
        if same:
            return sum(same) / len(same)
        return sum(w for _, w in self.walls) / max(sum(g for g, _ in self.walls), 1) * groups

    def done(self, groups: int, wall: float, trained: bool) -> None:
        self.done_n += 1
        if groups in self.planned:
            self.planned.remove(groups)
        if not trained:
            self.reused += 1
            return
        self.walls.append((groups, wall))
        left = sum(self.estimate(g) for g in self.planned)
        eta = time.strftime("%H:%M", time.localtime(time.time() + left))
        per = ", ".join(f"{self.estimate(g):.0f} s at {g} clusters" for g in sorted({g for g, _ in self.walls}))
        print(f"  progress: {self.done_n}/{self.total} runs ({self.reused} reused), {per} per run; "
              f"~{left / 60:.0f} min left, ETA {eta}", flush=True)


def mean_eval_curve(job: C.Job) -> tuple[list[int], list[float]]:
    """(steps, val loss) from the `eval` events, the mean over the clusters that evaluated at a step."""
    by: dict[int, list[float]] = {}
    for e in job.events("eval"):
        v = e.get("val_loss")
        if isinstance(v, (int, float)):
            by.setdefault(int(e["step"]), []).append(float(v))
    steps = sorted(by)
    return steps, [sum(by[s]) / len(by[s]) for s in steps]


def flagged_modules(jobs: Iterable[C.Job]) -> dict[str, Any]:
    """What the anomaly test flagged, from the `sync` events of metrics.jsonl (one per cluster and sync):
    per module, how many cluster-syncs flagged it, the largest z seen and the rule's reasons (`anomaly_details`;
    the verified rule names the failed tests: norm, direction, useless, misreported, non_finite)."""
    count: Counter[str] = Counter()
    zmax: dict[str, float] = {}
    reasons: dict[str, Counter[str]] = {}
    syncs = flagged = 0
    where: list[dict[str, Any]] = []
    for job in jobs:
        seed = next((o.split("=", 1)[1] for o in job.overrides if o.startswith("seed=")), None)
        for e in job.events("sync"):
            syncs += 1
            mods = e.get("anomalous_modules") or []
            flagged += bool(mods)
            count.update(mods)
            if mods:
                where.append({"seed": seed, "step": e.get("step"), "cluster": e.get("cluster"),
                              "weight": e.get("weight"), "modules": len(mods)})
            for m, d in (e.get("anomaly_details") or {}).items():
                if not isinstance(d, dict):
                    continue
                z = d.get("z")
                if isinstance(z, (int, float)) and math.isfinite(z):
                    zmax[m] = max(zmax.get(m, -math.inf), float(z))
                reasons.setdefault(m, Counter()).update(d.get("reasons") or [])
    return {"cluster_syncs": syncs, "flagged_cluster_syncs": flagged, "modules": dict(count.most_common()),
            "max_z": zmax, "reasons": {m: dict(c.most_common()) for m, c in reasons.items() if c}, "where": where}


def gap_vs_step(edit: Sequence[tuple[list[int], list[float]]],
                ddp: Sequence[tuple[list[int], list[float]]]) -> list[dict[str, Any]]:
    """edit / ddp val loss at every eval step both have, over the seeds (pairs of curves, same seed)."""
    by: dict[int, list[float]] = {}
    for (es, el), (ds, dl) in zip(edit, ddp):
        d = dict(zip(ds, dl))
        for s, v in zip(es, el):
            if s in d and d[s] > 0:
                by.setdefault(s, []).append(v / d[s])
    return [{"step": s, "mean": sum(r) / len(r), "min": min(r), "max": max(r)} for s, r in sorted(by.items())]


# --------------------------------------------------------------------------- runs
def tuned_overrides(s: Setting, a: argparse.Namespace, seed: int, groups: int) -> list[str]:
    common = ["cluster=local", f"cluster.count={groups}", "cluster.ranks=1", f"model={a.model}",
              f"algo={s.algo}", f"seed={seed}", f"train.steps={a.steps}", f"train.batch_size={a.batch_size}",
              f"train.seq_len={a.seq_len}", f"train.eval_every={a.eval_every}", f"train.eval_batches={a.eval_batches}"]
    if s.algo != "ddp":
        common += [f"algo.interval={a.interval}", "algo.warmup_steps=0"]
    mine = [x.split(":", 1)[1] for x in a.algo_set if x.split(":", 1)[0] == s.algo]
    return common + s.overrides() + list(a.extra) + mine


class Runner:
    """Runs (or, with reuse, picks up) one setting at (seed, cluster count); a run already made in this
    invocation comes from memory. `allow_fail`: a failed run (e.g. a diverging grid point) returns None."""

    def __init__(self, a: argparse.Namespace, progress: Progress) -> None:
        self.a, self.progress, self.memo = a, progress, {}

    def __call__(self, s: Setting, seed: int, groups: int, *, reuse: bool = False,
                 allow_fail: bool = False) -> C.Job | None:
        a = self.a
        run_dir = (a.workdir / "tuned" / f"{a.model}_{a.steps}steps_H{a.interval}" / f"g{groups}"
                   / f"seed{seed}" / s.algo / s.tag()).resolve()
        if run_dir in self.memo:
            return self.memo[run_dir]
        ov, reuse = tuned_overrides(s, a, seed, groups), reuse or a.reuse
        trained = not (reuse and C.finished_run(run_dir, ov) is not None)
        try:
            job: C.Job | None = C.run_job(f"{s.algo} [{s.label()}] seed {seed} x{groups}", run_dir, ov,
                                          timeout=a.timeout, reuse=reuse)
        except C.JobError as e:
            if not allow_fail:
                raise
            print(f"  FAILED (counted as +inf): {str(e).splitlines()[0]}", flush=True)
            job = None
        if job is not None:
            job.name = s.algo
        self.progress.done(groups, job.wall_s if job else 0.0, trained and job is not None)
        self.memo[run_dir] = job
        return job


def tune(a: argparse.Namespace, run: Runner) -> dict[str, Any]:
    """Phase 1 (seed 0, 2 clusters): per algorithm its grid; best = lowest final val loss."""
    t0 = time.perf_counter()
    grid: dict[str, list[dict[str, Any]]] = {}
    outer: dict[str, dict[str, Any]] = {}
    best: dict[str, dict[str, Any]] = {}
    for algo in a.algos:
        rows: list[dict[str, Any]] = []
        jobs: dict[Setting, C.Job | None] = {}

        def go(st: Setting, stage: str) -> None:
            job = jobs[st] = run(st, TUNE_SEED, TUNE_GROUPS, allow_fail=True)
            sm = job.summary if job else {}
            rows.append({"stage": stage, **st.as_dict(), "final_val_loss": sm.get("final_val_loss"),
                         "anomalies": sm.get("anomalies"), "job_wall_s": job.wall_s if job else None,
                         "run_dir": job.run_dir if job else None, "error": None if job else "failed"})

        if algo in OUTER_TUNED:
            for st in outer_grid(algo, a.base_lr, a.outer_lrs, a.outer_momenta):
                go(st, "outer")
            b = Setting.from_dict(min(rows, key=lambda r: finite_loss(r["final_val_loss"])))
            outer[algo] = {"lr": a.base_lr, "outer_lrs": a.outer_lrs, "momenta": a.outer_momenta,
                           "cells": {f"{r['outer_lr']:g}/{r['outer_momentum']:g}": r["final_val_loss"] for r in rows}}
            for st in inner_grid(b, list(dict.fromkeys(a.inner_lrs))):
                if st != b:
                    go(st, "inner")
        else:
            for lr in dict.fromkeys(a.inner_lrs):
                go(base_setting(algo, lr), "inner")
        if getattr(a, "options", False):  # issue 51: the new options at the best point so far
            b = Setting.from_dict(min(rows, key=lambda r: finite_loss(r["final_val_loss"])))
            for st in option_grid(b, a.muon_lrs, a.steps, a.interval):
                go(st, "options")
        top = min(rows, key=lambda r: finite_loss(r["final_val_loss"]))
        top["best"] = "*"
        st = Setting.from_dict(top)
        steps, losses = mean_eval_curve(jobs[st]) if jobs.get(st) else ([], [])
        best[algo] = {**st.as_dict(), "label": st.label(), "final_val_loss": top["final_val_loss"],
                      "curve": {"steps": steps, "val_loss": losses}}
        grid[algo] = rows
    return {"seed": TUNE_SEED, "groups": TUNE_GROUPS, "model": a.model, "steps": a.steps, "interval": a.interval,
            "base_lr": a.base_lr, "inner_lrs": a.inner_lrs, "outer_lrs": a.outer_lrs,
            "outer_momenta": a.outer_momenta, "grid": grid, "outer_grid": outer, "best": best,
            "wall_s": time.perf_counter() - t0}


def print_tune(tu: dict[str, Any]) -> None:
    print(f"\ntuning grid (seed {tu['seed']}, {tu['groups']} clusters, {tu['model']}, {tu['steps']} steps, "
          f"H={tu['interval']}; post_local_sgd: outer = averaging, lr 1 / momentum 0, by definition; "
          f"wall {tu['wall_s'] / 60:.1f} min):")
    print(C.table([r for rows in tu["grid"].values() for r in rows], GRID_COLUMNS))
    for algo, g in tu["outer_grid"].items():
        print(f"{algo}: final val loss over the outer grid (inner lr {g['lr']:g}; * = best):")
        print(outer_matrix(g))
    print("best per algorithm: " + "; ".join(f"{k} {v['label']} ({C.fmt(v['final_val_loss'])})"
                                             for k, v in tu["best"].items()))


def tuned_targets(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """edit <= every tuned baseline on every seed, edit <= 1.02 x ddp on every seed (+ the numbers)."""
    res = [ps["results"] for ps in per_seed.values()]
    if "edit" not in res[0]:
        return {}
    tg: dict[str, Any] = {}
    for b in ("ddp", "post_local_sgd", "diloco"):
        if b in res[0]:
            d = [r["edit"]["final_val_loss"] - r[b]["final_val_loss"] for r in res]
            tg[f"edit_le_{b}_every_seed"] = all(x <= 0 for x in d)
            tg[f"edit_minus_{b}_per_seed"] = d
    ratios = [r["edit"]["loss_ratio_vs_ddp"] for r in res]
    tg["edit_le_1.02x_ddp_every_seed"] = all(x <= 1.02 for x in ratios)
    tg["edit_loss_ratio_vs_ddp_per_seed"] = ratios
    tg["edit_meets_loss_targets"] = all(v for k, v in tg.items() if isinstance(v, bool))
    tg["edit_bytes_le_1/H_ddp_every_seed"] = all(ps["targets"].get("edit_bytes_le_1/H_ddp")
                                                 for ps in per_seed.values())
    return tg


def print_confirm(a: argparse.Namespace, tu: dict[str, Any], co: dict[str, Any]) -> None:
    for groups, g in co.items():
        rows = [{"algo": n, "setting": tu["best"][n]["label"],
                 **{k: v["final_val_loss"][k] for k in ("mean", "min", "max")},
                 "ratio": v["loss_ratio_vs_ddp"]["mean"], "ratio_max": v["loss_ratio_vs_ddp"]["max"],
                 "flags": sum(x or 0 for x in v["anomalies"]), "job_s": v["job_wall_s"]["mean"]}
                for n, v in g["summary"].items()]
        print(f"\n{groups} clusters, seeds {a.seeds}, each algorithm at its best (wall {g['wall_s'] / 60:.1f} min):")
        print(C.table(rows, [("algo", "algo", ""), ("setting", "setting", ""), ("mean", "val loss mean", ".4f"),
                             ("min", "min", ".4f"), ("max", "max", ".4f"), ("ratio", "/ddp mean", ".4f"),
                             ("ratio_max", "/ddp max", ".4f"), ("flags", "flags", ""), ("job_s", "job s", ".0f")]))
        tg = g["targets"]
        for k, v in tg.items():
            v = " ".join(f"{x:+.4f}" if "minus" in k else f"{x:.4f}" for x in v) if isinstance(v, list) else v
            print(f"  {k}: {C.fmt(v)}")
        if tg and not tg["edit_meets_loss_targets"]:
            print_reason(tu, groups, g)
    gaps = {G: g["summary"]["edit"]["loss_ratio_vs_ddp"]["mean"] for G, g in co.items() if "edit" in g["summary"]}
    if len(gaps) > 1:
        print("edit / ddp (mean over seeds) by cluster count: " + ", ".join(f"{G}: {r:.4f}" for G, r in gaps.items()))


def print_reason(tu: dict[str, Any], groups: str, g: dict[str, Any]) -> None:
    """Why edit is not the best here: what the anomaly test flagged, what the sweep found, the gap's course."""
    print(f"  why edit misses a target at {groups} clusters:")
    fm = g["flagged_modules"]
    if fm["modules"]:
        def why(m: str) -> str:
            r = [f"{k} x{v}" for k, v in fm.get("reasons", {}).get(m, {}).items()]
            r += [f"max z {fm['max_z'][m]:.1f}"] if m in fm["max_z"] else []
            return f" ({', '.join(r)})" if r else ""

        mods = ", ".join(f"{m} x{n}{why(m)}" for m, n in fm["modules"].items())
        print(f"    flagged: {fm['flagged_cluster_syncs']} of {fm['cluster_syncs']} cluster-syncs (all seeds): {mods}")
        at = [f"seed {w['seed']} step {w['step']} {w['cluster']} ({w['modules']} modules, weight "
              f"{C.fmt(w['weight'], '.2f')})" for w in fm["where"]]
        print("    flagged at: " + ", ".join(at[:12]) + (f" ... ({len(at)} in all)" if len(at) > 12 else ""))
    else:
        print(f"    flagged: nothing in {fm['cluster_syncs']} cluster-syncs (all seeds): the anomaly test "
              "excluded no update (weighting and clipping still apply)")
    b = tu["best"]
    base = min((k for k in b if k != "edit"), key=lambda k: finite_loss(b[k]["final_val_loss"]), default=None)
    e_rows = [finite_loss(r["final_val_loss"]) for r in tu["grid"].get("edit", [])]
    if base and e_rows:
        print(f"    sweep (seed {tu['seed']}, {tu['groups']} clusters): edit best {b['edit']['label']} "
              f"{C.fmt(b['edit']['final_val_loss'])} (grid {min(e_rows):.4f}..{max(e_rows):.4f}, {len(e_rows)} runs); "
              f"best baseline {base} {b[base]['label']} {C.fmt(b[base]['final_val_loss'])}")
    if g["gap_vs_step"]:
        print("    edit / ddp along training (mean over seeds): "
              + ", ".join(f"step {p['step']} {p['mean']:.4f}" for p in g["gap_vs_step"] if p["step"] > 0))


# --------------------------------------------------------------------------- tables
GRID_COLUMNS = [("algo", "algo", ""), ("stage", "stage", ""), ("variant", "option", ""), ("lr", "inner lr", "g"),
                ("outer_lr", "outer lr", "g"),
                ("outer_momentum", "momentum", "g"), ("nesterov", "Nesterov", ""),
                ("final_val_loss", "val loss", ".4f"), ("anomalies", "flags", ""), ("job_wall_s", "job s", ".0f"),
                ("best", "best", "")]


def outer_matrix(grid: dict[str, Any]) -> str:
    """The outer grid (`grid` as in the JSON: lr, outer_lrs, momenta, cells) as outer lr (rows) x momentum
    (columns) of final val loss; * marks the best cell."""
    cells = {k: finite_loss(v) for k, v in grid["cells"].items()}
    best = min(cells, key=cells.get) if cells else None
    rows = []
    for olr in grid["outer_lrs"]:
        row = {"olr": f"{olr:g}"}
        for m in grid["momenta"]:
            k = f"{olr:g}/{m:g}"
            row[k.split("/")[1]] = C.fmt(grid["cells"].get(k), ".4f") + ("*" if k == best else " ")
        rows.append(row)
    cols = [("olr", "outer lr \\ momentum", "")] + [(f"{m:g}", f"{m:g}" + (" Nesterov" if m > 0 else ""), "")
                                                    for m in grid["momenta"]]
    return C.table(rows, cols)


# --------------------------------------------------------------------------- figure
STYLES = {"ddp": "-", "post_local_sgd": "--", "diloco": "-.", "edit": "-"}  # coinciding curves stay visible
MARKERS = {"ddp": "o", "post_local_sgd": "s", "diloco": "^", "edit": "D"}
COLORS = {"ddp": "C0", "post_local_sgd": "C1", "diloco": "C2", "edit": "C3"}  # the same in every panel


def plot(curves: dict[int, dict[str, tuple[list[int], list[float]]]], labels: dict[str, str],
         grids: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """Top: val loss vs step per algorithm at its best setting, one panel per cluster count (first seed,
    step 0 left out: it is the same init for all). Bottom: the outer lr x momentum grid of diloco and edit
    (final val loss at the base inner lr; one colour scale; box = best cell)."""
    plt = C.pyplot()
    from matplotlib.gridspec import GridSpec

    heat = [a for a in OUTER_TUNED if a in grids]
    ncol = max(len(curves), len(heat), 1)
    fig = plt.figure(figsize=(6 * ncol, 9.5 if heat else 5))
    gs = GridSpec(2 if heat else 1, ncol * 2, figure=fig, height_ratios=[1.25, 1] if heat else None)
    w = ncol * 2 // max(len(curves), 1)
    for i, (groups, by_algo) in enumerate(sorted(curves.items())):
        ax = fig.add_subplot(gs[0, i * w:(i + 1) * w])
        tail: list[float] = []
        for algo, (steps, losses) in by_algo.items():
            pts = [(s, v) for s, v in zip(steps, losses) if s > 0]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=MARKERS.get(algo, "o"), ms=4,
                    ls=STYLES.get(algo, "-"), lw=2.2 if algo == "edit" else 1.4, color=COLORS.get(algo),
                    label=f"{algo} ({labels.get(algo, '')}): {pts[-1][1]:.3f}")
            tail += [p[1] for p in pts[len(pts) // 3:]]
        if tail:
            ax.set_ylim(min(tail) - 0.03, max(tail) + 0.08)
        ax.set_title(f"{groups} clusters: val loss at each algorithm's best (y zoomed on the later evals)")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if heat:
        mats = {}
        for algo in heat:
            g = grids[algo]
            mats[algo] = [[finite_loss(g["cells"].get(f"{olr:g}/{m:g}")) for m in g["momenta"]]
                          for olr in g["outer_lrs"]]
        finite = [v for m in mats.values() for row in m for v in row if math.isfinite(v)]
        vmin, vmax = (min(finite), max(finite)) if finite else (0.0, 1.0)
        w = ncol * 2 // len(heat)
        for i, algo in enumerate(heat):
            g, mat = grids[algo], mats[algo]
            ax = fig.add_subplot(gs[1, i * w:(i + 1) * w])
            im = ax.imshow([[v if math.isfinite(v) else vmax for v in row] for row in mat], cmap="viridis_r",
                           vmin=vmin, vmax=vmax, aspect="auto")
            ax.set_xticks(range(len(g["momenta"])), [f"{m:g}" + (" N" if m > 0 else "") for m in g["momenta"]])
            ax.set_yticks(range(len(g["outer_lrs"])), [f"{x:g}" for x in g["outer_lrs"]])
            ax.set_xlabel("outer momentum (N = Nesterov)")
            ax.set_ylabel("outer lr")
            ax.set_title(f"{algo}: final val loss, inner lr {g['lr']:g}")
            best = min(((r, c) for r in range(len(mat)) for c in range(len(mat[r]))), key=lambda rc: mat[rc[0]][rc[1]])
            for r, row in enumerate(mat):
                for c, v in enumerate(row):
                    ax.text(c, r, f"{v:.3f}" if math.isfinite(v) else "diverged", ha="center", va="center",
                            fontsize=9, color="black" if math.isfinite(v) and v < (vmin + vmax) / 2 else "white",
                            fontweight="bold" if (r, c) == best else "normal")
            ax.add_patch(plt.Rectangle((best[1] - 0.5, best[0] - 0.5), 1, 1, fill=False, ec="red", lw=2))
            fig.colorbar(im, ax=ax, fraction=0.05)
    fig.suptitle(title)
    return C.save_fig(fig, path)
