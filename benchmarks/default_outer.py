"""The outer step a user gets without tuning (issue 66): `edit-train` at its defaults against DDP, by cluster count.

Every run is the product's own command — `edit-train algo=<ddp|edit> cluster.count=M cluster.ranks=1 model=tiny
train.steps=320 algo.interval=8 train.batch_size=8 train.seq_len=128 seed=S` (plus the benchmarks' `logger=none
train.progress=false checkpoint.at_end=false`, which change no number) — on seeds no tuning used (11, 12), so what
it measures is what `algo=edit` gives a user who sets nothing: the outer step from the default by cluster count
(`edit_train/local_sgd/sync/outer.py`, `DEFAULT_OUTER_STEPS`; docs/algorithms.md, "The outer step's default"). Besides
the defaults: edit at the outer step the product shipped before (lr 0.7, Nesterov momentum 0.8, named on the command
line) on the same seeds, and at 4 clusters two outer steps on seed 0 (`CHOICE_4`, named on the command line): the
4-cluster row's evidence. Each row: the command, the commit that ran it, the final validation losses and the ratio
to DDP's at the same cluster count and seed (None where no DDP ran).

    python benchmarks/default_outer.py --reuse                 # every run (10 runs, ~1.5-2 h on 2 shared cores)
    python benchmarks/default_outer.py --reuse --only ddp_g2_s11 edit_g2_s11   # some of them, in this order
    python benchmarks/default_outer.py --reuse --finished      # only write the JSON and plot of the runs done

Output: results/default_outer.json and results/default_outer.png (edit / DDP per cluster count and seed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

RECORDS = C.BENCH_DIR.parent / "results"
REPO = C.BENCH_DIR.parent
BAR = 1.07  # issue 66, acceptance 2: the command above ends within 1.07 x DDP's loss on seeds 11 and 12
# what `algo=edit` shipped before the default by cluster count (conf/algo/edit.yaml until issue 66): the EDiT paper's outer step
OLD = {"lr": 0.7, "momentum": 0.8}
# at 4 clusters (seed 0, which the evaluation does not use): M = 2's point against a longer step (the DiLoCo scaling
# laws' best outer lr rises with the cluster count)
CHOICE_4 = ({"lr": 0.5, "momentum": 0.5}, {"lr": 0.7, "momentum": 0.5})


def command(algo: str, clusters: int, seed: int) -> list[str]:
    """The issue's command, key for key, at `clusters` clusters and `seed`."""
    return [f"algo={algo}", f"cluster.count={clusters}", "cluster.ranks=1", "model=tiny", "train.steps=320",
            "algo.interval=8", "train.batch_size=8", "train.seq_len=128", f"seed={seed}"]


def setting(algo: str, clusters: int, seed: int, outer: dict[str, float] | None = None,
            role: str = "default") -> dict[str, Any]:
    """One run; `outer` names the outer step on the command line (None: the product's default)."""
    ov = command(algo, clusters, seed)
    name = f"{algo}_g{clusters}_s{seed}"
    if outer is not None:
        ov += [f"algo.outer.lr={outer['lr']!r}", f"algo.outer.momentum={outer['momentum']!r}",
               "algo.outer.nesterov=true"]
        name += f"_o{outer['lr']:g}-{outer['momentum']:g}N"
    return {"name": name, "algo": algo, "clusters": clusters, "seed": seed, "outer_named": outer, "role": role,
            "overrides": ov}


def settings() -> list[dict[str, Any]]:
    """Every run, in the order they go (the acceptance's first)."""
    return [setting("ddp", 2, 11), setting("ddp", 2, 12), setting("edit", 2, 11), setting("edit", 2, 12),
            setting("ddp", 4, 11), setting("edit", 4, 11), setting("edit", 2, 11, OLD, "old default"),
            setting("edit", 2, 12, OLD, "old default"),
            *(setting("edit", 4, 0, o, "4-cluster choice") for o in CHOICE_4)]


def git_commit() -> str:
    """This checkout's commit (`-dirty` when tracked files differ from it)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short=10", "HEAD") + ("-dirty" if git("status", "--porcelain", "-uno") else "")


def run(a: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    run_dir = (a.workdir / s["name"]).resolve()
    stamp = run_dir / "bench_commit.txt"
    reused = a.reuse and C.finished_run(run_dir, s["overrides"]) is not None
    commit = git_commit()
    job = C.run_job(s["name"], run_dir, s["overrides"], timeout=a.timeout, reuse=a.reuse)
    if reused and stamp.exists():
        commit = stamp.read_text().strip()
    else:
        stamp.write_text(commit + "\n")
    sm = job.summary
    return {**{k: v for k, v in s.items() if k != "overrides"},
            "command": "edit-train " + " ".join(C.job_args(run_dir, s["overrides"])), "commit": commit,
            "outer": sm.get("outer"), "final_val_loss": sm["final_val_loss"],
            "initial_val_loss": sm.get("initial_val_loss"), "job_wall_s": job.wall_s, "reused": reused,
            "run_dir": str(run_dir)}


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with `ratio_vs_ddp`: its loss over DDP's at the same cluster count and seed (None without one)."""
    ddp = {(r["clusters"], r["seed"]): r["final_val_loss"] for r in rows if r["algo"] == "ddp"}
    out = []
    for r in rows:
        d = ddp.get((r["clusters"], r["seed"]))
        out.append({**r, "ratio_vs_ddp": r["final_val_loss"] / d if d and r["algo"] != "ddp" else None})
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cluster count and seed: DDP's loss, edit's at the defaults (and at the old default), their ratios."""
    out: dict[str, Any] = {}
    for r in rows:
        if r.get("role") == "4-cluster choice":  # seed 0, no DDP: the edit losses side by side
            o = r["outer_named"]
            out.setdefault(f"choice_g{r['clusters']}_s{r['seed']}", {})[f"{o['lr']:g}/{o['momentum']:g}N"] = \
                r["final_val_loss"]
            continue
        if r["algo"] == "ddp" or r["ratio_vs_ddp"] is None:
            continue
        key = f"g{r['clusters']}_s{r['seed']}"
        cell = out.setdefault(key, {"ddp": next(d["final_val_loss"] for d in rows if d["algo"] == "ddp" and
                                                (d["clusters"], d["seed"]) == (r["clusters"], r["seed"]))})
        label = "default" if r["outer_named"] is None else f"{r['outer_named']['lr']:g}/{r['outer_named']['momentum']:g}N"
        cell[label] = {"edit": r["final_val_loss"], "ratio": r["ratio_vs_ddp"]}
        if r["outer_named"] is None and r.get("outer"):
            cell["default_outer"] = r["outer"]
    return out


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    """Acceptance 2's second half: the 2-cluster command at the defaults within BAR x DDP on seeds 11 and 12."""
    out: dict[str, Any] = {}
    for seed in (11, 12):
        cell = summary.get(f"g2_s{seed}", {}).get("default")
        if cell is not None:
            out[f"edit_g2_s{seed}_ratio"] = cell["ratio"]
            out[f"edit_g2_s{seed}_le_{BAR}"] = cell["ratio"] <= BAR
    return out


def plot(summary: dict[str, Any], path: Path) -> Path:
    plt = C.pyplot()
    summary = {k: v for k, v in summary.items() if "ddp" in v}  # the cells with a ratio
    keys = list(summary)
    labels = sorted({k for v in summary.values() for k in v if k not in ("ddp", "default_outer")},
                    key=lambda s: (s != "default", s))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(labels), 1)
    for j, lab in enumerate(labels):
        vals = [summary[k].get(lab, {}).get("ratio", float("nan")) for k in keys]
        ax.bar([i + (j - (len(labels) - 1) / 2) * width for i in range(len(keys))], vals, width=width,
               label="the default by cluster count" if lab == "default" else f"outer {lab} (named)")
    ax.axhline(BAR, color="gray", ls="--", lw=1, label=f"issue 66's bar ({BAR})")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(keys)), [k.replace("g", "M = ").replace("_s", ", seed ") for k in keys])
    ratios = [c["ratio"] for v in summary.values() for k, c in v.items() if isinstance(c, dict) and "ratio" in c]
    ax.set_ylim(0.95, max([1.1, *ratios]) + 0.02)
    ax.set_ylabel("edit / DDP final validation loss")
    ax.set_title("edit-train at its defaults: tiny, 320 steps, H = 8")
    ax.legend(fontsize=8)
    return C.save_fig(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__, out="default_outer.json", plot="default_outer.png", workdir="default_outer", reuse=True,
                  timeout=3600.0)
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these settings, in this order")
    ap.add_argument("--finished", action="store_true", help="start no run: the JSON and plot of the finished ones")
    a = C.parse(ap, argv)
    every = {s["name"]: s for s in settings()}
    if a.smoke and not a.only:
        a.only = list(every)[:2]  # the first two settings (DDP and the product at its defaults) in miniature
    if a.finished:
        a.reuse = True
        a.only = [n for n, s in every.items() if C.finished_run((a.workdir / n).resolve(), s["overrides"])]
        if not a.only:
            print(f"error: no finished run in {a.workdir}", file=sys.stderr)
            return 1
    if a.only:
        unknown = [n for n in a.only if n not in every]
        if unknown:
            print(f"error: no setting named {', '.join(unknown)}; choose from {', '.join(every)}", file=sys.stderr)
            return 2
    todo = [every[n] for n in a.only] if a.only else list(every.values())
    t0, rows = time.time(), []
    for i, s in enumerate(todo, start=1):
        print(f"[{i}/{len(todo)}] {s['name']}", flush=True)
        try:
            rows.append(run(a, s))
        except C.JobError as exc:
            print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
            return 1
    if a.only:  # the other settings' finished runs still count in the JSON
        for s in every.values():
            if s["name"] not in a.only and C.finished_run((a.workdir / s["name"]).resolve(), s["overrides"]):
                rows.append(run(argparse.Namespace(**{**vars(a), "reuse": True}), s))
    rows = with_ratios(rows)
    summary = summarize(rows)
    out = {"benchmark": "default_outer",
           "command": "python benchmarks/default_outer.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "setup": {"command": "edit-train algo=<algo> cluster.count=<M> " + " ".join(command("x", 0, 0)[2:-1])
                     + " seed=<seed>", "base": list(C.BASE_OVERRIDES), "old_default": OLD, "choice_4": list(CHOICE_4),
                     "bar": BAR},
           "summary": summary, "targets": targets(summary), "runs": rows, "wall_s": time.time() - t0,
           "env": C.environment(), "load": C.load()}
    C.write_json(a.out, out)
    print(C.table(rows, [("name", "run", ""), ("commit", "commit", ""), ("final_val_loss", "val loss", ".4f"),
                         ("ratio_vs_ddp", "/ DDP", ".4f")]))
    C.print_targets(out["targets"], a.out, plot(summary, a.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
