"""Aux-loss-free balancing across sites (issue 68): what a sync does to the Ling 2.0 routers' expert bias
(`algo.expert_bias`: `mean`, `global`, `local`; edit_train/local_sgd/moe/expert_bias.py) on the four-language
federation, with Ling 1's auxiliary balance loss at the same active parameters as the reference.

Every run is `experiment=noniid_lang_4`'s data (one language per cluster, `data.split=by_language`, every cluster
validating on all four and on each alone) with `algo=edit` at the moe_sync benchmark's tuned point
(results/convergence_tuned.json; H = 8, batch 8, seq 128, no warm-up). Arms:

* `mean`, `global`, `local` — `model=<tiny_v2|small_v2>` (sigmoid routing with an expert bias, no aux loss) and
  `algo.expert_bias=<arm>`;
* `aux` — the same model with Ling 1's router: softmax scores, no bias, no groups, scaling 1, and Ling 1's balance
  loss (`model.router_aux_loss_coef`, `--aux-coef`, tiny's 0.01): the same experts and top-k, so the same active
  parameters.

Per run: the final validation loss, overall and per language (`final_val_loss_by_source`); MaxVio (max over
experts of load / mean load − 1) per site and of the federation, from the `experts` events (every cluster's routed
counts per interval — the same numbers for every arm, the aux arm included), mean over the MoE layers and the last
half of the intervals. Per setting (model, clusters): each arm's numbers per seed and its paired gain over `mean`
(the incumbent default) and over `aux`, seed by seed, with the 95 % interval (`paired.py`).

    python benchmarks/expert_bias.py --models tiny_v2 --seeds 0 1 --steps 64    # what fits a CPU session
    python benchmarks/expert_bias.py --reuse                                    # the grid: tiny_v2 + small_v2, 5 seeds

Runs go to <workdir>/<model>_<steps>steps/g<G>/seed<S>/<arm>; `--reuse` picks up finished runs with identical
overrides. JSON to results/expert_bias.json, the plot to docs/expert_bias.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from paired import paired_gain  # noqa: E402

RECORDS = C.BENCH_DIR.parent / "results"
ARMS = ("mean", "global", "local", "aux")
STEPS = {"tiny_v2": 320, "small_v2": 160}
LING1_ROUTER = ["model.score_function=softmax", "model.moe_router_enable_expert_bias=false", "model.n_group=0",
                "model.topk_group=0", "model.routed_scaling_factor=1.0"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = C.parser(__doc__, out="expert_bias.json", plot="expert_bias.png", workdir="expert_bias", reuse=True,
                  timeout=4 * 3600.0)
    ap.add_argument("--models", nargs="+", default=list(STEPS), choices=sorted(STEPS))
    ap.add_argument("--clusters", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--steps", type=int, default=None, help="train.steps (default: tiny_v2 320, small_v2 160)")
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="the aux arm's router_aux_loss_coef (tiny's)")
    ap.add_argument("--tuned", type=Path, default=RECORDS / "convergence_tuned.json")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for every run")
    a = C.parse(ap, argv)
    if a.smoke:  # one model, one seed, two arms
        a.models, a.seeds, a.arms = ["tiny_v2"], [0], ["mean", "aux"]
    return a


def tuned_point(path: Path) -> list[str]:
    import json

    best = json.loads(path.read_text())["tune"]["best"]["edit"]
    return [f"train.lr={best['lr']:g}", f"algo.outer.lr={best['outer_lr']:g}",
            f"algo.outer.momentum={best['outer_momentum']:g}",
            f"algo.outer.nesterov={str(bool(best['nesterov'])).lower()}"]


def overrides(a: argparse.Namespace, model: str, seed: int, arm: str) -> list[str]:
    steps = a.steps or STEPS[model]
    out = ["cluster=local", f"cluster.count={a.clusters}", "cluster.ranks=1", f"model={model}", "algo=edit",
           f"seed={seed}", f"train.steps={steps}", "train.batch_size=8", "train.seq_len=128",
           f"train.eval_every={steps}", f"train.eval_batches={a.eval_batches}", f"algo.interval={a.interval}",
           "algo.warmup_steps=0", "data.split=by_language", *tuned_point(a.tuned), *a.set]
    if arm == "aux":
        return out + LING1_ROUTER + [f"model.router_aux_loss_coef={a.aux_coef:g}"]
    return out + [f"algo.expert_bias={arm}"]


def run_dir_of(a: argparse.Namespace, model: str, seed: int, arm: str) -> Path:
    return a.workdir / f"{model}_{a.steps or STEPS[model]}steps" / f"g{a.clusters}" / f"seed{seed}" / arm


def maxvio(load: list[float]) -> float:
    """max over experts of load / mean load − 1 (0 without load)."""
    mean = sum(load) / len(load) if load else 0.0
    return max(load) / mean - 1.0 if mean > 0 else 0.0


def maxvio_of_run(experts: list[dict[str, Any]]) -> dict[str, Any]:
    """From the `experts` events (each cluster's routed counts per interval, [MoE layer][expert]): per interval
    every cluster's MaxVio and the federation's (the clusters' summed counts), each the mean over the MoE layers;
    then each one's mean over the last half of the intervals every cluster reported."""
    by: dict[int, dict[str, list[list[float]]]] = {}
    for e in experts:
        by.setdefault(int(e["interval"]), {})[str(e["cluster"])] = e["counts"]
    clusters = sorted({c for row in by.values() for c in row})
    rows = [row for _, row in sorted(by.items()) if set(row) == set(clusters)]
    if not rows:
        return {}
    tail = rows[len(rows) // 2:]

    def layers_mean(counts: list[list[float]]) -> float:
        return statistics.fmean(maxvio([float(x) for x in layer]) for layer in counts)

    per = {c: statistics.fmean(layers_mean(row[c]) for row in tail) for c in clusters}
    fed = statistics.fmean(layers_mean([[sum(col) for col in zip(*layers)] for layers in zip(*row.values())])
                           for row in tail)
    series = [layers_mean([[sum(col) for col in zip(*layers)] for layers in zip(*row.values())]) for row in rows]
    return {"clusters": per, "federation": fed, "federation_series": series, "intervals": len(rows)}


def run_one(a: argparse.Namespace, model: str, seed: int, arm: str) -> dict[str, Any]:
    run_dir = run_dir_of(a, model, seed, arm)
    job = C.run_job(f"{model} x{a.clusters} seed {seed} {arm}", run_dir, overrides(a, model, seed, arm),
                    timeout=a.timeout, reuse=a.reuse)
    return {"model": model, "clusters": a.clusters, "seed": seed, "arm": arm,
            "final_val_loss": job.summary.get("final_val_loss"),
            "val_loss_by_source": job.summary.get("final_val_loss_by_source"),
            "maxvio": maxvio_of_run(job.events("experts")), "syncs": len([e for e in job.events("sync")
                                                                            if e.get("cluster") == "c0"]),
            "suspects": sum(len(e.get("suspects") or []) for e in job.events("sync")),
            "job_wall_s": job.wall_s, "run_dir": str(run_dir)}


def summarize(runs: list[dict[str, Any]], arms: list[str]) -> list[dict[str, Any]]:
    rows = []
    for model in sorted({r["model"] for r in runs}):
        mine = [r for r in runs if r["model"] == model]
        loss = {arm: {r["seed"]: r["final_val_loss"] for r in mine if r["arm"] == arm} for arm in arms}
        fed = {arm: {r["seed"]: r["maxvio"].get("federation") for r in mine if r["arm"] == arm and r["maxvio"]}
               for arm in arms}
        out: dict[str, Any] = {"model": model, "clusters": mine[0]["clusters"], "arms": {}}
        for arm in arms:
            srcs = sorted({s for r in mine if r["arm"] == arm for s in (r["val_loss_by_source"] or {})})
            by_src = {s: statistics.fmean(r["val_loss_by_source"][s] for r in mine
                                          if r["arm"] == arm and s in (r["val_loss_by_source"] or {}))
                      for s in srcs}
            sites = [r["maxvio"].get("clusters", {}) for r in mine if r["arm"] == arm and r["maxvio"]]
            out["arms"][arm] = {
                "loss": {"mean": statistics.fmean(loss[arm].values()) if loss[arm] else None,
                         "per_seed": loss[arm]},
                "loss_by_source": by_src,
                "maxvio_federation": {"mean": statistics.fmean(fed[arm].values()) if fed[arm] else None,
                                      "per_seed": fed[arm]},
                "maxvio_sites": {c: statistics.fmean(s[c] for s in sites) for c in (sites[0] if sites else {})},
                "gain_over_mean": paired_gain(loss.get("mean", {}), loss[arm]) if arm != "mean" else None,
                "gain_over_aux": paired_gain(loss.get("aux", {}), loss[arm]) if arm != "aux" else None,
                "maxvio_gain_over_mean": paired_gain(fed.get("mean", {}), fed[arm]) if arm != "mean" else None,
            }
        rows.append(out)
    return rows


def plot(rows: list[dict[str, Any]], runs: list[dict[str, Any]], arms: list[str], path: Path) -> Path:
    plt = C.pyplot()
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 3.8 * len(rows)), squeeze=False)
    colors = {"mean": "tab:blue", "global": "tab:green", "local": "tab:orange", "aux": "tab:gray"}
    for (ax_l, ax_m), row in zip(axes, rows):
        for k, arm in enumerate(arms):
            per = row["arms"][arm]["loss"]["per_seed"]
            ax_l.scatter([k] * len(per), list(per.values()), color=colors[arm], s=18)
            if per:
                ax_l.plot([k - 0.25, k + 0.25], [statistics.fmean(per.values())] * 2, color=colors[arm], lw=2)
            for r in runs:
                if r["model"] == row["model"] and r["arm"] == arm and r["maxvio"]:
                    s = r["maxvio"]["federation_series"]
                    ax_m.plot(range(1, len(s) + 1), s, color=colors[arm], lw=1, alpha=0.8,
                              label=arm if r["seed"] == min(x["seed"] for x in runs if x["arm"] == arm) else None)
        ax_l.set_xticks(range(len(arms)), arms)
        ax_l.set_ylabel("final val loss (all four languages)")
        ax_l.set_title(f"{row['model']}, {row['clusters']} clusters: val loss per seed (bar: mean)", fontsize=9)
        ax_m.set_xlabel("interval")
        ax_m.set_ylabel("federation MaxVio (mean over MoE layers)")
        ax_m.set_title("federation MaxVio per interval, one line per seed", fontsize=9)
        ax_m.legend(fontsize=8)
        ax_m.set_ylim(bottom=0)
    fig.suptitle("algo.expert_bias on noniid_lang_4 (Ling 1's aux loss: gray)")
    return C.save_fig(fig, path)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    runs = [run_one(a, model, seed, arm) for model in a.models for seed in a.seeds for arm in a.arms]
    rows = summarize(runs, a.arms)
    C.write_json(a.out, {"benchmark": "expert_bias", "setup": {
        "models": a.models, "clusters": a.clusters, "seeds": a.seeds, "arms": a.arms,
        "steps": {m: a.steps or STEPS[m] for m in a.models}, "interval": a.interval, "aux_coef": a.aux_coef,
        "overrides_example": overrides(a, a.models[0], a.seeds[0], a.arms[0])},
        "rows": rows, "runs": runs, "wall_s": time.perf_counter() - t0, "env": C.environment()})
    plot(rows, runs, a.arms, a.plot)
    for row in rows:
        for arm, x in row["arms"].items():
            g = x.get("gain_over_mean") or {}
            print(f"{row['model']} x{row['clusters']} {arm:6s} loss {C.fmt(x['loss']['mean'])} "
                  f"MaxVio fed {C.fmt(x['maxvio_federation']['mean'], '.3f')} sites "
                  f"{ {c: round(v, 3) for c, v in x['maxvio_sites'].items()} } gain over mean "
                  f"{C.fmt(g.get('mean'), '+.4f')} CI {g.get('ci')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
