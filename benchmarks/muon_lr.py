"""Muon at its own learning rate: DDP and edit, each tuned with `train.optimizer=muon` (issue 51).

The convergence grid first tried Muon at AdamW's tuned lr (3e-3) and found it worse for every algorithm. That lr
is not Muon's: `adjust_lr_fn="match_rms_adamw"` matches the RMS of one update, not the lr that trains best. This
benchmark sweeps Muon's lr for DDP and for edit (and edit's outer point under Muon), at the convergence
benchmark's setting (tiny, 320 steps, H = 8, batch 8 x 128, eval 8 batches), against both algorithms' tuned
AdamW points, then confirms each algorithm's best on more seeds and at 4 clusters. The sweep goes past edit's
best averaging lr until it turns (`EDGE_LRS`), tries the lr schedule's floor at 0 for both and Muon's momentum
(`MOMENTA`, the same values for both, each at its best lr; where a momentum wins, the lr's two neighbours are
tried at it), and edit's averaging without the rule's clip (`1.0/0-noclip`; where that wins, edit's best with the
clip on is confirmed too). `--long` adds each algorithm's best point at 4 x the steps (`LONG_STEPS`, seeds 0-2 and
4 clusters):

    python benchmarks/muon_lr.py --reuse            # the seed-0 sweep (34 runs) + the confirmation (6-9 runs)
    python benchmarks/muon_lr.py --reuse --sweep     # the sweep only
    python benchmarks/muon_lr.py --reuse --long      # and the run-length study (8-9 runs of 1280 steps)

Run directories: <workdir>/<setting>; `--reuse` reuses a finished run with identical overrides, `--adopt` also a
run started by hand whose resolved configuration (`config.json`) equals this setting's in every key but
`run.dir` (checked key by key; the record notes it was adopted; `--reuse` adopts such a run too rather than
start it again over its directory). Output: docs/muon_lr.json and docs/muon_lr.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

DOCS = C.BENCH_DIR.parent / "docs"
BASE = ["cluster=local", "cluster.ranks=1", "model=tiny", "train.steps=320", "train.batch_size=8",
        "train.seq_len=128", "train.eval_every=40", "train.eval_batches=8"]
LOCAL = ["algo=edit", "algo.interval=8", "algo.warmup_steps=0"]
OUTER = {"0.5/0.5N": ["algo.outer.lr=0.5", "algo.outer.momentum=0.5", "algo.outer.nesterov=true"],
         "0.7/0.5N": ["algo.outer.lr=0.7", "algo.outer.momentum=0.5", "algo.outer.nesterov=true"],
         "0.5/0.8N": ["algo.outer.lr=0.5", "algo.outer.momentum=0.8", "algo.outer.nesterov=true"],
         "1.0/0": ["algo.outer.lr=1.0", "algo.outer.momentum=0.0", "algo.outer.nesterov=false"],
         "1.2/0": ["algo.outer.lr=1.2", "algo.outer.momentum=0.0", "algo.outer.nesterov=false"],
         # averaging without the rule's clip: φ = 10 bounds each module's merged update, and Muon's (RMS ~0.2·lr per
         # value) is 6-90 after 8 steps at lr 4e-2-6e-2 — clipped at 44-54 of 80 syncs, to as little as 0.29
         "1.0/0-noclip": ["algo.outer.lr=1.0", "algo.outer.momentum=0.0", "algo.outer.nesterov=false",
                          "algo.rule.clip=false"]}


def setting(algo: str, opt: str, lr: float, outer: str | None, seed: int = 0, clusters: int = 2,
            min_lr_ratio: float | None = None, momentum: float | None = None, steps: int = 320) -> dict[str, Any]:
    """One run; `min_lr_ratio` None keeps the schedule's default floor (`train.min_lr_ratio`, 0.1), `momentum` None
    Muon's default (`train.muon_momentum`, 0.95); `steps` other than 320 is the run-length study (same eval
    cadence)."""
    ov = [*BASE, f"cluster.count={clusters}", f"seed={seed}", f"train.lr={lr!r}"]
    ov += ["algo=ddp"] if algo == "ddp" else [*LOCAL, *OUTER[outer or "0.5/0.5N"]]
    ov += ["train.optimizer=muon"] if opt == "muon" else []
    ov += [f"train.min_lr_ratio={min_lr_ratio!r}"] if min_lr_ratio is not None else []
    ov += [f"train.muon_momentum={momentum!r}"] if momentum is not None else []
    ov += [f"train.steps={steps}"] if steps != 320 else []
    name = f"{algo}_{opt}_lr{lr:g}" + (f"_o{outer}" if algo != "ddp" else "") + f"_g{clusters}_s{seed}"
    name += "_min0" if min_lr_ratio == 0.0 else (f"_min{min_lr_ratio:g}" if min_lr_ratio is not None else "")
    name += f"_m{momentum:g}" if momentum is not None else ""
    name += f"_T{steps}" if steps != 320 else ""
    return {"name": name.replace("/", "-"), "algo": algo, "optimizer": opt, "lr": lr, "outer": outer if algo != "ddp"
            else None, "seed": seed, "clusters": clusters, "min_lr_ratio": min_lr_ratio, "momentum": momentum,
            "steps": steps, "overrides": ov}


EDGE_LRS = (6e-2, 8e-2, 1.2e-1)  # edit's averaging point past 4e-2, the top of the first sweep


def sweep() -> list[dict[str, Any]]:
    """Seed 0, 2 clusters: both AdamW points (the convergence grid's best), DDP Muon over its lr, edit Muon over
    its lr at the AdamW outer point, and over the outer point at the better lrs. edit gets more runs (its outer point
is a second dimension DDP does not have); both lr optima are checked against the grid's edges (DDP's is
interior; edit's averaging point is best at the top lr tried with it, 4e-2 — say so when quoting it)."""
    out = [setting("ddp", "adamw", 3e-3, None), setting("edit", "adamw", 3e-3, "0.5/0.5N")]
    out += [setting("ddp", "muon", lr, None) for lr in (1e-2, 2e-2, 3e-2, 4e-2)]
    out += [setting("edit", "muon", lr, "0.5/0.5N") for lr in (1e-2, 2e-2, 4e-2, 6e-2)]
    out += [setting("edit", "muon", 2e-2, o) for o in ("0.7/0.5N", "0.5/0.8N", "1.0/0", "1.2/0")]
    out += [setting("edit", "muon", 4e-2, o) for o in ("0.7/0.5N", "1.0/0")] + [setting("edit", "muon", 3e-2, "1.0/0")]
    # the edge: edit's averaging point was best at the top lr tried (4e-2); go on until it turns
    out += [setting("edit", "muon", lr, "1.0/0") for lr in EDGE_LRS]
    # the schedule's floor, the same change for both (cosine to 0 instead of to 0.1 x): DDP at its best lr, edit at
    # its averaging point's 4e-2
    out += [setting("ddp", "muon", 3e-2, None, min_lr_ratio=0.0), setting("edit", "muon", 4e-2, "1.0/0", min_lr_ratio=0.0)]
    # Muon's momentum, the same values for both at each one's best lr: a buffer with a memory (1 / (1 - 0.95) = 20
    # steps) longer than the interval (8) carries a cluster's own direction across the sync that averaged it away
    out += [setting(algo, "muon", lr, outer, momentum=m) for algo, lr, outer in (("ddp", 3e-2, None),
                                                                                 ("edit", 6e-2, "1.0/0"))
            for m in MOMENTA]
    # edit's momentum 0.9 won with the clip on (the default): its lr neighbours there, kept in the record whatever
    # wins later
    out += [setting("edit", "muon", lr, "1.0/0", momentum=0.9) for lr in (4e-2, 8e-2)]
    # the rule's clip off at edit's best momentum (its Muon updates are clipped at most syncs; AdamW's at none)
    out += [setting("edit", "muon", lr, "1.0/0-noclip", momentum=0.9) for lr in (4e-2, 6e-2)]
    return out


MOMENTA = (0.6, 0.7, 0.8, 0.9)  # train.muon_momentum tried besides the default 0.95 (DDP best at 0.8, the first edge)
LONG_STEPS = 1280  # the run-length study: each algorithm's best point at 4 x the steps
LONG_AT = ((2, 0), (2, 1), (2, 2), (4, 0))  # ... at each (clusters, seed) (edit's clipped point: 2 clusters, seed 0)


def lr_at_best_momentum(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where an algorithm's best seed-0 point has a momentum of its own, its lr is checked again there: the two
    neighbours of that lr on the algorithm's own sweep (DDP's lrs; edit's averaging lrs)."""
    settings = sweep()
    grid = {"ddp": sorted({s["lr"] for s in settings if s["algo"] == "ddp" and s["optimizer"] == "muon"}),
            "edit": sorted({s["lr"] for s in settings if s["algo"] == "edit" and s["outer"] == "1.0/0"
                            and s["momentum"] is None})}
    out = []
    for algo in ("ddp", "edit"):
        b = best_of(rows, algo, "muon")
        if b and b.get("momentum") is not None and b["lr"] in grid[algo]:
            i = grid[algo].index(b["lr"])
            out += [setting(algo, "muon", grid[algo][j], b["outer"], momentum=b["momentum"])
                    for j in (i - 1, i + 1) if 0 <= j < len(grid[algo])]
    return out


def long_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each algorithm's best Muon point at LONG_STEPS, at each of LONG_AT: is the gap a short run's?"""
    out = []
    for clusters, seed in LONG_AT:
        for algo in ("ddp", "edit"):
            b = best_of(rows, algo, "muon")
            if b:
                out.append(setting(algo, "muon", b["lr"], b["outer"], seed=seed, clusters=clusters,
                                   min_lr_ratio=b.get("min_lr_ratio"), momentum=b.get("momentum"), steps=LONG_STEPS))
    # and edit's best with the rule's clip on (the default), when the best is without it
    c = best_clipped(rows)
    if out and out[-1]["outer"] != "1.0/0" and c:
        out.append(setting("edit", "muon", c["lr"], c["outer"], min_lr_ratio=c.get("min_lr_ratio"),
                           momentum=c.get("momentum"), steps=LONG_STEPS))
    return out


def best_of(rows: list[dict[str, Any]], algo: str, opt: str) -> dict[str, Any] | None:
    rs = [r for r in rows if (r["algo"], r["optimizer"], r["seed"], r["clusters"], r.get("steps", 320))
          == (algo, opt, 0, 2, 320)]
    return min(rs, key=lambda r: r["final_val_loss"]) if rs else None


def confirm(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each algorithm's best Muon point on seeds 1 and 2 (2 clusters) and on seed 0 at 4 clusters."""
    out = []
    for algo in ("ddp", "edit"):
        b = best_of(rows, algo, "muon")
        if b:
            floor = b.get("min_lr_ratio")
            m = b.get("momentum")
            out += [setting(algo, "muon", b["lr"], b["outer"], seed=s, min_lr_ratio=floor, momentum=m) for s in (1, 2)]
            out.append(setting(algo, "muon", b["lr"], b["outer"], clusters=4, min_lr_ratio=floor, momentum=m))
    c = best_clipped(rows)
    if c and best_of(rows, "edit", "muon") is not c:  # edit's best with the rule's clip on (the default) too
        out += [setting("edit", "muon", c["lr"], c["outer"], seed=s, momentum=c.get("momentum")) for s in (1, 2)]
        out.append(setting("edit", "muon", c["lr"], c["outer"], clusters=4, momentum=c.get("momentum")))
    return out


def best_clipped(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """edit's best seed-0 Muon point with plain averaging and the rule's clip on (the default)."""
    rs = [r for r in rows if r["algo"] == "edit" and r["optimizer"] == "muon" and r["outer"] == "1.0/0"
          and r.get("min_lr_ratio") is None and (r["seed"], r["clusters"], r.get("steps", 320)) == (0, 2, 320)]
    return min(rs, key=lambda r: r["final_val_loss"]) if rs else None


def adoptable(run_dir: Path, overrides: list[str]) -> bool:
    """A run started by hand with exactly this setting's resolved configuration (every key but run.dir)."""
    from edit_train.cli.common import compose
    from edit_train.config import to_container

    saved, summary = run_dir / "config.json", run_dir / "summary.json"
    if not (saved.exists() and summary.exists()):
        return False
    want = json.loads(json.dumps(to_container(compose([*C.BASE_OVERRIDES, *overrides, f"run.dir={run_dir}"]))))
    have = json.loads(saved.read_text())
    want["run"].pop("dir", None)
    have.get("run", {}).pop("dir", None)
    return want == have


def run(a: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any] | None:
    run_dir = (a.workdir / s["name"]).resolve()
    adopted = False
    finished = C.finished_run(run_dir, s["overrides"]) is not None
    if a.finished_only and not finished and not (a.adopt and adoptable(run_dir, s["overrides"])):
        print(f"  not run: {s['name']}", flush=True)
        return None
    # --reuse adopts too: a run with this setting's configuration is this setting's run, and starting it again
    # would wipe its directory (what a --reuse without --adopt once did to an adopted run)
    if (a.adopt or a.reuse) and not finished and adoptable(run_dir, s["overrides"]):
        adopted = True
        job = C.Job(s["name"], run_dir, C.job_args(run_dir, s["overrides"]), float("nan"), C.read_summary(run_dir),
                    C.read_metrics(run_dir))
        print(f"{s['name']}: adopting the run in {run_dir} (its config.json equals this setting's)", flush=True)
    else:
        job = C.run_job(s["name"], run_dir, s["overrides"], timeout=a.timeout, reuse=a.reuse)
    return {**{k: v for k, v in s.items() if k != "overrides"}, "final_val_loss": job.summary["final_val_loss"],
            "curve": job.eval_curve(), "job_wall_s": job.wall_s, "adopted": adopted, "run_dir": str(run_dir)}


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """edit's best against DDP's best, per optimizer (seed 0) and, for Muon, per confirmed seed / cluster count."""
    out: dict[str, Any] = {}
    for opt in ("adamw", "muon"):
        d, e = best_of(rows, "ddp", opt), best_of(rows, "edit", opt)
        if d and e:
            out[opt] = {"ddp": {k: d[k] for k in ("lr", "final_val_loss")},
                        "edit": {k: e[k] for k in ("lr", "outer", "final_val_loss")},
                        "edit_over_ddp_seed0": e["final_val_loss"] / d["final_val_loss"]}
    d, e = best_of(rows, "ddp", "muon"), best_of(rows, "edit", "muon")
    if d and e:
        def at(r: dict[str, Any], algo: str, b: dict[str, Any]) -> bool:
            return r["algo"] == algo and r["optimizer"] == "muon" and r["lr"] == b["lr"] and r["outer"] == b["outer"] \
                and r.get("min_lr_ratio") == b.get("min_lr_ratio") and r.get("momentum") == b.get("momentum") \
                and r.get("steps", 320) == 320
        per: dict[str, float] = {}
        for seed, g in ((0, 2), (1, 2), (2, 2), (0, 4)):
            dd = [r for r in rows if at(r, "ddp", d) and (r["seed"], r["clusters"]) == (seed, g)]
            ee = [r for r in rows if at(r, "edit", e) and (r["seed"], r["clusters"]) == (seed, g)]
            if dd and ee:
                per[f"g{g}_s{seed}"] = ee[0]["final_val_loss"] / dd[0]["final_val_loss"]
        two = [v for k, v in per.items() if k.startswith("g2")]
        out["muon"]["edit_over_ddp"] = per
        out["muon"]["edit_over_ddp_2_clusters"] = {"mean": statistics.fmean(two), "max": max(two), "n": len(two)}
        long = [r for r in rows if r.get("steps", 320) == LONG_STEPS and r["optimizer"] == "muon"]
        per_seed = {}
        for g, seed in sorted({(r["clusters"], r["seed"]) for r in long}):
            dl = [r for r in long if r["algo"] == "ddp" and (r["clusters"], r["seed"]) == (g, seed)]
            el = [r for r in long if r["algo"] == "edit" and (r["clusters"], r["seed"]) == (g, seed)]
            if dl:
                per_seed[f"g{g}_s{seed}"] = {"ddp": dl[0]["final_val_loss"],
                                        "edit": {r["outer"]: r["final_val_loss"] for r in el},
                                        "edit_over_ddp": {r["outer"]: r["final_val_loss"] / dl[0]["final_val_loss"]
                                                          for r in el}}
        if per_seed:
            out["muon"]["long"] = {"steps": LONG_STEPS, "per_seed": per_seed}
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = C.pyplot()
    fig, (ax, mx, bx) = plt.subplots(1, 3, figsize=(18, 4.8))
    sweep_rows = [r for r in rows if (r["seed"], r["clusters"], r.get("steps", 320)) == (0, 2, 320)]
    for k, (algo, outer) in enumerate([("ddp", None), *[("edit", o) for o in OUTER]]):
        rs = sorted((r for r in sweep_rows if r["algo"] == algo and r["optimizer"] == "muon" and r["outer"] == outer
                     and r.get("min_lr_ratio") is None and r.get("momentum") is None), key=lambda r: r["lr"])
        if rs:
            ax.plot([r["lr"] for r in rs], [r["final_val_loss"] for r in rs], "o-" if algo == "ddp" else "s--",
                    color=f"C{k}", label=f"{algo} Muon" + (f", outer {outer}" if outer else ""))
    for k, algo in enumerate(("ddp", "edit")):
        b = best_of(rows, algo, "adamw")
        if b:
            ax.axhline(b["final_val_loss"], color="0.3" if algo == "ddp" else "0.6", ls=":", lw=1,
                       label=f"{algo} AdamW (lr {b['lr']:g}" + (f", outer {b['outer']})" if b["outer"] else ")"))
    for r in sweep_rows:
        if r.get("min_lr_ratio") is not None:
            ax.plot([r["lr"]], [r["final_val_loss"]], "x", color="k", ms=8)
            ax.annotate(f"{r['algo']}, lr floor {r['min_lr_ratio']:g}", (r["lr"], r["final_val_loss"]), fontsize=6,
                        xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("train.lr (Muon)")
    ax.set_ylabel("final validation loss")
    ax.set_title("tiny, 2 clusters, 320 steps, H = 8, seed 0")
    ax.legend(fontsize=7)
    for k, (algo, outer) in enumerate((("ddp", None), ("edit", "1.0/0"), ("edit", "1.0/0-noclip"))):
        lrs = sorted({r["lr"] for r in sweep_rows if r["algo"] == algo and r.get("momentum") is not None
                      and r["outer"] == outer})
        for j, lr in enumerate(lrs):
            rs = [r for r in sweep_rows if r["algo"] == algo and r["optimizer"] == "muon" and r["lr"] == lr
                  and r["outer"] == outer and r.get("min_lr_ratio") is None]
            pts = sorted((r.get("momentum") or 0.95, r["final_val_loss"]) for r in rs)
            if pts:
                shades = (("deepskyblue", "tab:blue", "navy"), ("gold", "tab:orange", "saddlebrown"),
                          ("lightgreen", "tab:green", "darkgreen"))[k]
                mx.plot([p[0] for p in pts], [p[1] for p in pts], ("o-", "s--", "^:")[k], color=shades[min(j, 2)],
                        label=f"{algo} Muon, lr {lr:g}" + (", no clip" if outer and "noclip" in outer else ""))
    mx.set_xlabel("train.muon_momentum (0.95: the default)")
    mx.set_ylabel("final validation loss")
    mx.set_title("Muon's momentum (seed 0; edit: plain averaging, the rule's clip on / off)")
    mx.legend(fontsize=7)
    lows = []
    for k, algo in enumerate(("ddp", "edit")):
        for opt, m in (("adamw", "o"), ("muon", "s")):
            b = best_of(rows, algo, opt)
            if not b:
                continue
            rs = [r for r in rows if r["algo"] == algo and r["optimizer"] == opt and r["lr"] == b["lr"]
                  and r["outer"] == b["outer"] and r.get("min_lr_ratio") == b.get("min_lr_ratio")
                  and r.get("momentum") == b.get("momentum")]
            for r in rs:
                steps, loss = r["curve"]
                if (r["seed"], r["clusters"]) == (0, 2):
                    n = r.get("steps", 320)
                    bx.plot(steps, loss, color=f"C{k}", ls=("-" if n == 320 else "-.") if opt == "muon" else ":",
                            label=f"{algo} {opt} (best, seed 0" + (f", {n} steps)" if n != 320 else ")"))
                    lows.append(min(loss))
    bx.set_ylim(min(lows, default=1.5) - 0.05, 3.0)
    bx.set_xlabel("step")
    bx.set_ylabel("validation loss")
    bx.set_title("each algorithm's best point")
    bx.legend(fontsize=8)
    return C.save_fig(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="the seed-0 sweep only, no confirmation runs")
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs with identical overrides")
    ap.add_argument("--long", action="store_true",
                    help=f"also each algorithm's best at {LONG_STEPS} steps ((clusters, seed): {LONG_AT})")
    ap.add_argument("--adopt", action="store_true", help="also adopt runs whose config.json equals the setting's")
    ap.add_argument("--finished-only", action="store_true", help="report the finished (or adoptable) runs, start none")
    ap.add_argument("--workdir", type=Path, default=C.RUNS_DIR / "muon_lr")
    ap.add_argument("--out", type=Path, default=DOCS / "muon_lr.json")
    ap.add_argument("--plot", type=Path, default=DOCS / "muon_lr.png")
    ap.add_argument("--timeout", type=float, default=3600.0)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = [r for s in sweep() if (r := run(a, s))]
    done = {r["name"] for r in rows}
    rows += [r for s in lr_at_best_momentum(rows) if s["name"] not in done and (r := run(a, s))]
    if not a.sweep:
        rows += [r for s in confirm(rows) if (r := run(a, s))]
    if a.long:
        rows += [r for s in long_runs(rows) if (r := run(a, s))]
    summary = ratios(rows)
    C.write_json(a.out, {"benchmark": "muon_lr", "setup": {"base": BASE, "outer_points": OUTER}, "summary": summary,
                         "runs": rows, "wall_s": time.perf_counter() - t0, "env": C.environment()})
    plot(rows, a.plot)
    for opt, s in summary.items():
        print(f"{opt}: ddp lr {s['ddp']['lr']:g} {s['ddp']['final_val_loss']:.4f}; edit lr {s['edit']['lr']:g} outer "
              f"{s['edit']['outer']} {s['edit']['final_val_loss']:.4f}; edit / ddp (seed 0) "
              f"{s['edit_over_ddp_seed0']:.4f}" + (f"; confirmed {json.dumps(s.get('edit_over_ddp'))}"
                                                  if s.get("edit_over_ddp") else ""))
    print(f"wrote {a.out} and {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
