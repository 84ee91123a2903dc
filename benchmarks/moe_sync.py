"""Expert-aware sync (issue 41, phase B): each cluster's experts merged by the tokens it routed to them, and
untouched experts left out of the sync, against today's default rule — on the non-IID setting and on IID data.

Every run is `algo=edit` (the verified rule, gathered at 2 and 4 clusters) at the convergence benchmark's tuned
point for edit (results/convergence_tuned.json, results/convergence_small.json: inner lr 3e-3, outer SGD 0.5 /
momentum 0.5 Nesterov; H = 8, batch 8, seq 128, no warm-up; tiny 320 steps, small 160): the same tuning budget
for every arm — the expert-aware arms get no tuning of their own. Arms:

* `default` — today's rule (`algo.rule.verified.expert_weights=none`);
* `tokens`  — each expert's rows weighed by the tokens each cluster routed to it (`expert_weights=tokens`);
* `skip`    — `tokens`, and a cluster that routed fewer than `--min-tokens` tokens to an expert in the interval
  sends none of its rows (`expert_min_tokens`; default 512 = a quarter of the uniform share, which is
  H · batch · seq · top-k / experts = 2048 for both models);
* `subsets` — expert subsets per site (`expert_subsets=split`: expert e is cluster e mod P's, the others frozen
  at the anchor on it and never sent; docs/sync_math.md, "Expert subsets"); `subsets_home` is what each cluster
  must leave at home per sync by the formula, `subsets_home_exact` the sync events that left exactly that.
* `routed`  — expert subsets assigned by routing (`expert_subsets=routed`: every cluster trains every expert for
  the first `expert_subsets_syncs` = 4 syncs, then owns the experts it routed the largest share of its tokens to,
  balanced; `local_sgd/moe/assignment.py`); its home is `subsets`' sizes, from the fifth sync on.

Every run also reports its routing skew (`routing_skew`): how differently the sites route over the run — each
cluster's routed counts summed from the sixth interval on, then the mean |wᵢₑ − 1/P| of each cluster's equal-backing
token weight per expert; 0 in expectation when every cluster routes alike (IID: what is left is sampling noise).
Each setting compares its runs' skew with its IID counterpart's (`skew_vs_iid`, acceptance 1 of issue 54 asks
≥ 3 ×). `interval_skew` is the same distance per interval (what `expert_weights=tokens` acts on at each sync):
a few sequences per interval make it noisy, so an IID split already scores well above 0 there.

Data: `noniid` (`data.split=by_family`: each cluster trains on its own standard-library families, every cluster
validates on all four, docs/noniid.md) and `iid` (the default: one corpus split across the clusters); `lang`
(`data.split=by_language`: one language per cluster, docs/noniid.md "Four languages") and `lang_iid` (its IID
counterpart, `data.source=lang:all`), both validated on the four languages and on each alone. Per run:
the final validation loss (`train.eval_batches`, default 32 batches = 32,768 tokens, on the shared validation),
the bytes of every `sync` event (every cluster's) against the formula of docs/sync_math.md ("Experts") over what
the event says was left out (`unsent_params`), their mean, and the mean share of the model left out. Per setting (model, clusters, data): each
arm's loss per seed, its gain over `default` compared seed by seed (same seeds, same data order: default − arm
per seed; mean, sample std, min, and the mean's 95 % confidence interval from Student's t, `paired.py` — `pays`:
the interval lies above 0), the same per validation source (`gain_by_source`: per language) and whether it is
≤ default on every seed.

    python benchmarks/moe_sync.py --quick            # tiny, 2 clusters, seed 0, noniid + iid, 3 arms: 6 runs
    python benchmarks/moe_sync.py --reuse            # the grid: 2 models x 2 cluster counts x 2 data x 3 seeds x 3 arms
    python benchmarks/moe_sync.py --reuse --models tiny --clusters 2     # one slice of it
    python benchmarks/moe_sync.py --finished-only    # report every finished run of the grid, start none
    python benchmarks/moe_sync.py --reuse --models tiny --clusters 2 --steps 160 --seeds 0 1 2 3 4 --data lang lang_iid
    # ^ the four-language grid, results/moe_sync_lang.json (it ran --arms default tokens subsets)

The noise a comparison has to beat: on IID data `tokens` is today's rule in expectation (docs/sync_math.md), so
its per-seed difference from `default` there measures how far a small change of the merge moves a run's final
loss (the trajectory's sensitivity, not a gain). Each setting's row carries that IID paired difference of its
model and cluster count (`iid_paired_noise`: per seed, its std and its largest |difference|), and says per arm
whether the non-IID gain is beyond it.

Runs go to <workdir>/<model>_<steps>steps/g<G>/<data>/seed<S>/<arm>; `--reuse` picks up every finished run
with identical overrides (an interrupted grid resumes where it stopped). The JSON records the host's load
before and after every run.
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
from paired import paired_gain  # noqa: E402

RECORDS = C.BENCH_DIR.parent / "results"
STEPS = {"tiny": 320, "small": 160}  # the convergence benchmark's runs (results/convergence_tuned.json, _small.json)
ARMS = ("default", "tokens", "skip", "subsets", "routed")
ROUTED_SYNCS = 4  # algo.rule.verified.expert_subsets_syncs's default: the warm-up of the `routed` arm
# the data settings: the stdlib families and their IID counterpart (the whole standard library split across the
# clusters); the four languages (one per cluster, docs/noniid.md) and theirs (`lang:all` split across them)
DATA = {"noniid": ["data.split=by_family"], "iid": [], "lang": ["data.split=by_language"],
        "lang_iid": ["data.source=lang:all"]}
IID_OF = {"noniid": "iid", "iid": "iid", "lang": "lang_iid", "lang_iid": "lang_iid"}
SETTLED = 5  # intervals after which routing has settled (the skew is measured from there on)
TAG, EXTRA = 16, 5  # a tag after every piece and exchange row; the exchange's per-cluster scalars (round.EXTRA)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = C.parser(__doc__, out="moe_sync.json", plot="moe_sync.png", workdir="moe_sync", reuse=True,
                  timeout=4 * 3600.0)
    ap.add_argument("--quick", action="store_true", help="tiny, 2 clusters, seed 0 (noniid + iid, every arm)")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(STEPS))
    ap.add_argument("--clusters", type=int, nargs="+", default=None)
    ap.add_argument("--data", nargs="+", default=["noniid", "iid"], choices=sorted(DATA))
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--min-tokens", type=int, default=512, help="expert_min_tokens of the `skip` arm")
    ap.add_argument("--steps", type=int, default=None, help="train.steps (default: tiny 320, small 160)")
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=80)
    ap.add_argument("--tuned", type=Path, default=RECORDS / "convergence_tuned.json",
                    help="edit's tuned point (tune.best.edit)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more overrides for every run (use another --workdir: run directories do not name them)")
    ap.add_argument("--finished-only", action="store_true",
                    help="report the grid's finished runs (identical overrides) and start none; list the rest")
    ap.add_argument("--plot-only", action="store_true", help="draw --plot from the summary in --out, run nothing")
    a = C.parse(ap, argv)
    if a.smoke:  # tiny, one data split, two arms
        a.quick, a.data, a.arms = True, a.data[:1], a.arms[:2]
    a.models = a.models or ["tiny"] if a.quick else a.models or ["tiny", "small"]
    a.clusters = a.clusters or ([2] if a.quick else [2, 4])
    a.seeds = a.seeds if a.seeds is not None else ([0] if a.quick else [0, 1, 2])
    return a


def tuned_point(path: Path) -> list[str]:
    best = json.loads(path.read_text())["tune"]["best"]["edit"]
    nesterov = str(bool(best["nesterov"])).lower()
    return [f"train.lr={best['lr']:g}", f"algo.outer.lr={best['outer_lr']:g}",
            f"algo.outer.momentum={best['outer_momentum']:g}", f"algo.outer.nesterov={nesterov}"]


def overrides(a: argparse.Namespace, model: str, groups: int, data: str, seed: int, arm: str) -> list[str]:
    out = ["cluster=local", f"cluster.count={groups}", "cluster.ranks=1", f"model={model}", "algo=edit",
           f"seed={seed}", f"train.steps={a.steps or STEPS[model]}", "train.batch_size=8", "train.seq_len=128",
           f"train.eval_every={a.eval_every}", f"train.eval_batches={a.eval_batches}", "algo.interval=8",
           "algo.warmup_steps=0", *tuned_point(a.tuned)]
    out += DATA[data] + list(a.set)
    if arm != "default":
        out.append("algo.rule.verified.expert_weights=tokens")
    if arm == "skip":
        out.append(f"algo.rule.verified.expert_min_tokens={a.min_tokens}")
    if arm == "subsets":  # SPES-style: expert e is cluster (e mod P)'s; the others stay at the anchor on it
        out.append("algo.rule.verified.expert_subsets=split")
    if arm == "routed":  # the experts each cluster routed most to over the first ROUTED_SYNCS syncs
        out.append("algo.rule.verified.expert_subsets=routed")
    return out


def model_shape(model: str) -> dict[str, Any]:
    """Sync units (their number and sizes), parameters, and the routed-count row (MoE layers x experts)."""
    from edit_train.cli.common import compose
    from edit_train.cluster.mesh import fsdp_units
    from edit_train.local_sgd.sync.round import build_units
    from edit_train.model import CausalLM

    cfg = compose([f"model={model}"])
    import torch

    with torch.device("meta"):
        m = CausalLM(cfg.model)
    units = build_units(m, fsdp_units(m))
    expert = 3 * cfg.model.hidden_size * cfg.model.moe_intermediate_size  # one expert's gate, up, down rows
    return {"units": len(units), "params": sum(p.numel() for p in m.parameters()),
            "counts": len(m.moe_layers()) * cfg.model.num_experts, "moe_layers": len(m.moe_layers()),
            "experts": cfg.model.num_experts, "expert_params": expert}


def subsets_unsent(shape: dict[str, Any], clusters: int) -> list[int]:
    """Expert subsets (`split`): the elements each cluster leaves at home per sync — the experts it does not own
    (E − ⌈(E − i) / P⌉ of them for cluster i), every MoE layer's."""
    e = shape["experts"]
    return [(e - len(range(i, e, clusters))) * shape["expert_params"] * shape["moe_layers"] for i in range(clusters)]


def formula(shape: dict[str, Any], clusters: int, unsent: int) -> int:
    """docs/sync_math.md, "Experts": a gathered sync of one rank per cluster, the probe scores in the exchange."""
    p, u = clusters, shape["units"]
    return (p - 1) * (4 * (shape["params"] - unsent) + TAG * u) \
        + (p - 1) * (8 * (u + 1 + shape["counts"] + EXTRA + p) + TAG) + (p - 1) * (8 + TAG)


def run_dir_of(a: argparse.Namespace, model: str, groups: int, data: str, seed: int, arm: str) -> Path:
    return a.workdir / f"{model}_{a.steps or STEPS[model]}steps" / f"g{groups}" / data / f"seed{seed}" / arm


def _settled(experts: list[dict[str, Any]]) -> list[dict[str, list[list[int]]]]:
    """Per settled interval that every cluster reported (from the sixth on): each cluster's counts [layer][expert]."""
    by: dict[int, dict[str, list[list[int]]]] = {}
    for e in experts:
        by.setdefault(e["interval"], {})[e["cluster"]] = e["counts"]
    clusters = {c for row in by.values() for c in row}
    if len(clusters) < 2:
        return []
    return [row for k, row in sorted(by.items()) if k >= SETTLED and set(row) == clusters]


def _skew(row: dict[str, list[list[int]]]) -> list[float]:
    """Per layer and expert, each cluster's token weight with equal backing, wᵢₑ = sᵢₑ / Σⱼ sⱼₑ (sᵢₑ its share
    of its own routed tokens), against 1/P: every |wᵢₑ − 1/P|."""
    p, devs = len(row), []
    for layer in zip(*row.values()):  # per MoE layer: each cluster's counts
        shares = [[c / max(sum(counts), 1) for c in counts] for counts in layer]
        for col in zip(*shares):
            total = sum(col)
            devs += [abs(x / total - 1 / p) for x in col] if total > 0 else []
    return devs


def routing_skew(experts: list[dict[str, Any]]) -> float | None:
    """How differently the sites route, over the run: each cluster's counts summed over the settled intervals, then
    the mean |wᵢₑ − 1/P| (`_skew`). 0 when every cluster routes alike in expectation (IID) — what is left there is
    sampling noise, which shrinks with the tokens counted; a language's own routing does not. Acceptance 1 of
    issue 54 compares this between a setting and its IID counterpart at the same steps (the same tokens)."""
    rows = _settled(experts)
    if not rows:
        return None
    summed = {c: [[sum(r[c][li][e] for r in rows) for e in range(len(layer))] for li, layer in enumerate(rows[0][c])]
              for c in rows[0]}
    devs = _skew(summed)
    return statistics.fmean(devs) if devs else None


def interval_skew(experts: list[dict[str, Any]]) -> float | None:
    """How far token weights are from today's rule at each sync: the mean |wᵢₑ − 1/P| of every settled interval's
    own counts — what `expert_weights=tokens` acts on. Batch-to-batch noise (a few sequences per interval) counts
    here as much as a site's own routing, so an IID split already scores well above 0."""
    devs = [d for row in _settled(experts) for d in _skew(row)]
    return statistics.fmean(devs) if devs else None


def run_one(a: argparse.Namespace, model: str, groups: int, data: str, seed: int, arm: str,
            shape: dict[str, Any]) -> dict[str, Any]:
    run_dir = run_dir_of(a, model, groups, data, seed, arm)
    before = C.load()
    job = C.run_job(f"{model} x{groups} {data} seed {seed} {arm}", run_dir,
                    overrides(a, model, groups, data, seed, arm), timeout=a.timeout,
                    reuse=a.reuse or a.finished_only)
    syncs = job.events("sync")
    off = [e for e in syncs if e["bytes"] != formula(shape, len(e["quorum"]), e.get("unsent_params", 0))]
    mine = [e for e in syncs if e.get("cluster") == "c0"]
    home = subsets_unsent(shape, groups) if arm in ("subsets", "routed") else [0] * groups
    # the map holds from the sync after `routed`'s warm-up (its sizes: split's, balanced)
    mapped = [e for e in syncs if arm != "routed" or e["sync"] > ROUTED_SYNCS]
    # an owner that routed no token to its expert in an interval leaves it home too: at least the formula's
    below_home = [e for e in mapped if e.get("unsent_params", 0) < home[e.get("cluster_index", 0) % groups]]
    return {"model": model, "clusters": groups, "data": data, "seed": seed, "arm": arm,
            "final_val_loss": job.summary.get("final_val_loss"), "curve": job.eval_curve(),
            "val_loss_by_source": job.summary.get("final_val_loss_by_source"),
            "syncs": len(mine), "bytes_per_sync": statistics.fmean(e["bytes"] for e in syncs) if syncs else None,
            "formula_per_sync_full": formula(shape, groups, 0),
            "unsent_share": statistics.fmean(e.get("unsent_params", 0) for e in syncs) / shape["params"]
            if syncs else None,
            "sync_events": len(syncs), "off_formula": len(off), "anomalies": job.summary.get("anomalies"),
            "subsets_home": home, "subsets_home_exact": sum(e.get("unsent_params", 0) == home[
                e.get("cluster_index", 0) % groups] for e in mapped), "below_home": len(below_home),
            "routing_skew": routing_skew(job.events("experts")), "interval_skew": interval_skew(job.events("experts")),
            "job_wall_s": job.wall_s, "load_before": before, "load_after": C.load(), "run_dir": str(run_dir)}


def spread(xs: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "min": min(xs),
            "max": max(xs), "n": len(xs)} if xs else {}


def paired_noise(runs: list[dict[str, Any]], model: str, clusters: int, data: str = "iid") -> dict[str, Any]:
    """IID (`data`: `iid` or `lang_iid`), `tokens` − `default` per seed: what a small change of the merge does to
    a run's final loss."""
    loss = {(r["arm"], r["seed"]): r["final_val_loss"] for r in runs
            if (r["model"], r["clusters"], r["data"]) == (model, clusters, data)}
    diffs = [loss[("default", s)] - loss[("tokens", s)] for a, s in loss if a == "default" and ("tokens", s) in loss]
    return {**spread(diffs), "max_abs": max(abs(d) for d in diffs)} if diffs else {}


def skew_against_iid(runs: list[dict[str, Any]], model: str, clusters: int, data: str) -> dict[str, Any] | None:
    """The setting's routing skew (its `default` runs, per seed) against its IID counterpart's mean at the same
    model, cluster count and steps: acceptance 1 of issue 54 asks every run for ≥ 3 ×. None for an IID setting or
    without both."""
    if IID_OF[data] == data:
        return None
    def skews(d: str) -> dict[int, float]:
        return {r["seed"]: r["routing_skew"] for r in runs if (r["model"], r["clusters"], r["data"], r["arm"])
                == (model, clusters, d, "default") and r.get("routing_skew") is not None}
    mine, iid = skews(data), skews(IID_OF[data])
    if not (mine and iid):
        return None
    floor = statistics.fmean(iid.values())
    ratio = {s: v / floor for s, v in sorted(mine.items())}
    return {"iid_mean": floor, "iid_max": max(iid.values()), "per_seed": ratio, "min_ratio": min(ratio.values()),
            "mean_ratio": statistics.fmean(ratio.values()), "min_vs_iid_max": min(mine.values()) / max(iid.values())}


def summarize(runs: list[dict[str, Any]], arms: list[str]) -> list[dict[str, Any]]:
    """Per setting (model, clusters, data): each arm's losses by seed, its paired gain over default (seed by seed:
    mean and 95 % t interval, overall and per validation source), its bytes, and (with the IID runs of its model
    and cluster count) whether the gain is beyond the IID paired noise."""
    out = []
    for key in sorted({(r["model"], r["clusters"], r["data"]) for r in runs}):
        rs = [r for r in runs if (r["model"], r["clusters"], r["data"]) == key]
        loss = {arm: {r["seed"]: r["final_val_loss"] for r in rs if r["arm"] == arm} for arm in arms}
        noise = paired_noise(runs, key[0], key[1], IID_OF[key[2]])
        row: dict[str, Any] = {"model": key[0], "clusters": key[1], "data": key[2], "loss": loss,
                               "iid_paired_noise": noise or None,
                               "skew_vs_iid": skew_against_iid(runs, key[0], key[1], key[2])}
        for arm in arms:
            rr = [r for r in rs if r["arm"] == arm]
            seeds = sorted(set(loss[arm]) & set(loss.get("default", {})))
            gain = [loss["default"][s] - loss[arm][s] for s in seeds]
            by_source = {r["seed"]: r.get("val_loss_by_source") or {} for r in rr}
            base = {r["seed"]: r.get("val_loss_by_source") or {} for r in rs if r["arm"] == "default"}
            sources = sorted({src for v in by_source.values() for src in v})
            row[arm] = {"loss": spread(list(loss[arm].values())),
                        "gain": {**spread(gain), **paired_gain(loss.get("default", {}), loss[arm])}
                        if arm != "default" else None,
                        "gain_by_source": {src: paired_gain({s: v[src] for s, v in base.items() if src in v},
                                                            {s: v[src] for s, v in by_source.items() if src in v})
                                           for src in sources} if arm != "default" else None,
                        "le_default_every_seed": all(g >= 0 for g in gain) if gain and arm != "default" else None,
                        # a mean gain (or cost) larger than the largest IID paired difference
                        "beyond_noise": (abs(statistics.fmean(gain)) > noise["max_abs"])
                        if gain and noise and arm != "default" and IID_OF[key[2]] != key[2] else None,
                        "bytes_per_sync": spread([r["bytes_per_sync"] for r in rr if r["bytes_per_sync"]]),
                        "unsent_share": spread([r["unsent_share"] for r in rr if r["unsent_share"] is not None]),
                        "routing_skew": spread([r["routing_skew"] for r in rr if r.get("routing_skew") is not None]),
                        "interval_skew": spread([r["interval_skew"] for r in rr if r.get("interval_skew") is not None]),
                        "off_formula": sum(r["off_formula"] for r in rr),
                        "sync_events": sum(r["sync_events"] for r in rr)}
        out.append(row)
    return out


def plot(rows: list[dict[str, Any]], arms: list[str], path: Path) -> Path:
    plt = C.pyplot()
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(18, 4.8))
    labels = [f"{r['model']} x{r['clusters']}\n{r['data']}" for r in rows]
    for i, r in enumerate(rows):  # the IID paired noise of the setting's model and cluster count
        n = r.get("iid_paired_noise")
        if n:
            ax.fill_between([i - 0.45, i + 0.45], -n["max_abs"], n["max_abs"], color="0.88", zorder=0,
                            label="IID paired noise (largest |tokens − default|)" if i == 0 else None)
    others = [a for a in arms if a != "default"]
    width = 0.8 / max(len(others), 1)
    labelled: set[str] = set()
    for k, arm in enumerate(others):
        for i, r in enumerate(rows):
            seeds = sorted(set(r["loss"].get(arm, {})) & set(r["loss"].get("default", {})))
            gains = [r["loss"]["default"][s] - r["loss"][arm][s] for s in seeds]
            x = i + (k - (len(others) - 1) / 2) * width
            ax.scatter([x] * len(gains), gains, color=f"C{k + 1}", s=18, label=arm if i == 0 else None)
            if gains:
                half = (r[arm]["gain"] or {}).get("half_width") or 0.0  # the paired 95 % t interval
                ax.errorbar([x], [statistics.fmean(gains)], yerr=[half], color=f"C{k + 1}", fmt="_", markersize=14,
                            capsize=4)
            b, d, u = r[arm]["bytes_per_sync"], r["default"]["bytes_per_sync"], r[arm]["unsent_share"]
            if b and d:
                bx.bar(x, 100 * (1 - b["mean"] / d["mean"]), width=width * 0.9, color=f"C{k + 1}",
                       label=f"{arm}: bytes saved" if f"{arm}: bytes saved" not in labelled else None)
                labelled.add(f"{arm}: bytes saved")
            if u:
                bx.scatter([x], [100 * u["mean"]], color="k", marker="x", s=30,
                           label="share of the model left out" if "left" not in labelled else None)
                labelled.add("left")
    cw = 0.8 / max(len(arms), 1)
    for k, arm in enumerate(arms):  # routing skew over the run (bars) and per interval (hollow markers)
        for i, r in enumerate(rows):
            sk, per = r[arm].get("routing_skew") or {}, r[arm].get("interval_skew") or {}
            x = i + (k - (len(arms) - 1) / 2) * cw
            if sk:
                cx.bar(x, sk["mean"], width=cw * 0.9, color=f"C{k}", yerr=[sk.get("std", 0.0)], capsize=3,
                       label=f"{arm}: over the run" if i == 0 else None)
            if per:
                cx.scatter([x], [per["mean"]], facecolors="none", edgecolors=f"C{k}", s=40,
                           label=f"{arm}: per interval" if i == 0 else None)
        for i, r in enumerate(rows):
            v = r.get("skew_vs_iid")
            if v and k == 0:
                cx.annotate(f"{v['mean_ratio']:.1f}x IID", (i, (r["default"].get("routing_skew") or {}).get("mean", 0)),
                            textcoords="offset points", xytext=(0, 12), ha="center", fontsize=8)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("val loss gain over default (default − arm)")
    ax.set_title("per seed (dots), mean and its paired 95 % CI")
    ax.legend(fontsize=8)
    bx.axhline(0, color="k", lw=0.8)
    bx.set_xticks(range(len(rows)), labels, fontsize=8)
    bx.set_ylabel("% of default's bytes per sync")
    bx.set_title("bytes saved per sync, and the untouched rows' share")
    bx.legend(fontsize=8)
    cx.set_xticks(range(len(rows)), labels, fontsize=8)
    cx.set_ylabel("mean |token weight − 1/P| (settled intervals)")
    cx.set_title("routing skew: how differently the sites route")
    cx.legend(fontsize=8)
    return C.save_fig(fig, path)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.plot_only:
        saved = json.loads(a.out.read_text())
        print(f"wrote {plot(saved['summary'], saved['setup']['arms'], a.plot)}")
        return 0
    t0, start_load = time.perf_counter(), C.load()
    plan = [(m, g, d, s, arm) for m in a.models for g in a.clusters for d in a.data for s in a.seeds for arm in a.arms]
    if a.finished_only:
        done = [p for p in plan if C.finished_run(run_dir_of(a, *p).resolve(), overrides(a, *p)) is not None]
        for p in plan:
            if p not in done:
                print("  not run: {} x{} {} seed {} {}".format(*p))
        plan = done
    print(f"{len(plan)} runs: models {a.models}, clusters {a.clusters}, data {a.data}, seeds {a.seeds}, arms {a.arms}")
    shapes = {m: model_shape(m) for m in a.models}
    runs: list[dict[str, Any]] = []
    walls: dict[tuple[str, int], list[float]] = {}
    for k, (m, g, d, s, arm) in enumerate(plan):
        r = run_one(a, m, g, d, s, arm, shapes[m])
        runs.append(r)
        walls.setdefault((m, g), []).append(r["job_wall_s"])
        left = sum(statistics.fmean(walls.get((pm, pg), [r["job_wall_s"] * pg / g])) for pm, pg, *_ in plan[k + 1:])
        print(f"  [{k + 1}/{len(plan)}] loss {r['final_val_loss']:.4f}, {r['bytes_per_sync'] or 0:,.0f} B/sync, "
              f"left out {100 * (r['unsent_share'] or 0):.1f} %, off formula {r['off_formula']}; ~{left / 60:.0f} min "
              "left", flush=True)
        rows = summarize(runs, a.arms)
        C.write_json(a.out, {"benchmark": "moe_sync", "quick": a.quick, "setup": {
            "steps": {m: a.steps or STEPS[m] for m in a.models}, "interval": 8, "batch_size": 8, "seq_len": 128,
            "eval_every": a.eval_every, "eval_batches": a.eval_batches, "tuned": tuned_point(a.tuned),
            "min_tokens": a.min_tokens, "models": a.models, "clusters": a.clusters, "data": a.data, "seeds": a.seeds,
            "arms": a.arms, "shapes": shapes}, "summary": rows, "runs": runs,
            "wall_s": time.perf_counter() - t0, "load_start": start_load, "load_end": C.load(),
            "env": C.environment()})
    rows = summarize(runs, a.arms)
    plot(rows, a.arms, a.plot)
    for r in rows:
        for arm in a.arms:
            x = r[arm]
            gain = x["gain"] or {}
            ci = gain.get("ci") or [None, None]
            print(f"{r['model']:5s} x{r['clusters']} {r['data']:6s} {arm:7s} loss {C.fmt(x['loss'].get('mean'))} "
                  f"± {C.fmt(x['loss'].get('std'))}  gain {C.fmt(gain.get('mean'), '+.4f')} ± {C.fmt(gain.get('std'))} "
                  f"95 % CI [{C.fmt(ci[0], '+.4f')}, {C.fmt(ci[1], '+.4f')}] "
                  f"(min {C.fmt(gain.get('min'), '+.4f')}) ≤ default every seed: {C.fmt(x['le_default_every_seed'])}  "
                  f"B/sync {C.fmt((x['bytes_per_sync'] or {}).get('mean'), ',.0f')}  left out "
                  f"{C.fmt(100 * (x['unsent_share'] or {}).get('mean', 0), '.1f')} %  off formula {x['off_formula']}"
                  f"/{x['sync_events']}  routing skew {C.fmt((x['routing_skew'] or {}).get('mean'))} (per interval "
                  f"{C.fmt((x.get('interval_skew') or {}).get('mean'))})  beyond the IID "
                  f"paired noise: {C.fmt(x.get('beyond_noise'))}")
        if v := r.get("skew_vs_iid"):
            print(f"{r['model']:5s} x{r['clusters']} {r['data']} routing skew against its IID counterpart's mean "
                  f"{C.fmt(v['iid_mean'])}: {v['mean_ratio']:.2f} x (lowest run {v['min_ratio']:.2f} x; lowest run "
                  f"against IID's highest {v['min_vs_iid_max']:.2f} x)")
        if IID_OF[r["data"]] != r["data"] and r["iid_paired_noise"]:
            n = r["iid_paired_noise"]
            print(f"{r['model']:5s} x{r['clusters']} IID paired noise (tokens − default per seed): std "
                  f"{C.fmt(n['std'])}, largest |difference| {C.fmt(n['max_abs'])}")
    print(f"wrote {a.out} and {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
