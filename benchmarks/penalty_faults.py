"""The `verified` aggregation rule against one faulty cluster: is it left out, and what does the fault cost?

For every fault kind (training-side: `garbage_data`, `lr_spike` ×`--lr-factor`; at the transport:
`sign_flip`, `random_direction`, `lie_norm`, `nan_payload`), every cluster count N (`cluster=local
cluster.count=N cluster.ranks=1`) and every seed, `algo=edit` (layer-wise, H = `algo.interval` = 8,
W = `algo.rule.verified.warmup_syncs` = 5) trains `model=tiny` for 240 steps (batch 8 × 128 tokens per cluster,
`train.spike_factor=0`) with cluster c1 faulty for steps [56, 152), against references with the same N and
seed: `clean` (no fault) and an ORACLE — the same fault, but a rule that knows the window
(`benchmarks/_oracle_rule.py`, `algo.rule.name=_oracle_rule:OracleRule`) drops exactly c1's window syncs
and is the `verified` rule otherwise: what the lost tokens cost. The oracle is not one run for every kind:
a training-side fault leaves c1's replica and AdamW state off after the window (measured, 2 clusters, seed 0:
the garbage_data oracle ends 1.2 % above an oracle whose c1 trained healthily), so each training-side kind
has its own (`oracle_garbage_data`, `oracle_lr_spike`); a payload fault leaves c1's training healthy and
its contributions are dropped anyway, so the four share `oracle_payload` (no fault, syncs 7..18 dropped).

The window: sync k is taken at step k·H. The norm test is live from sync W+1 (step 48), the direction test
from sync W+2 (step 56: the reference exists from sync 1, so its statistics hold W values by then), so the
window starts at step 56 when every test is warm. A payload fault corrupts what is sent during its steps:
syncs 7..18 (steps 56..144); a training-side fault contaminates the syncs whose local steps [step − H, step)
overlap it: syncs 8..19 (steps 64..152). 12 syncs either way: the usefulness probe scores an update one sync
late, so a fault only it catches is missed at the window's first sync (1 of 12 = 8 %, inside the 10 %
allowance) — and then taken back at the next sync (`local_sgd/aggregation/retract.py`; `c1_retracted` and the
"w=0|back" column count it) — and the 11 syncs after the window show the recovery.

Acceptance (printed per (N, kind) over the seeds, each with pass/FAIL):
  * c1's `weight` is 0 (left out of every module) in >= 90 % of the window's syncs (min over seeds);
  * false flags on the clean (and clean_jitter) runs <= 1 % per check (a check = one cluster × one module × one
    sync, all syncs; flagged modules counted from `anomalous_modules` of every cluster);
  * final val loss <= 1.01 × clean and <= 1.005 × oracle (one-sided: better than the oracle is fine). The final
    val loss is the end model's (cluster 0's end checkpoint, the anchor) on the first `--end-eval-batches` = 128
    val batches (131,072 tokens, the same for every run; `_end_eval.py`), not the trainer's last 8-batch eval,
    which moved a faulty/oracle ratio by up to 0.9 %;
  * the resolution of those ratios, per (N, seed): a `clean_jitter` run, the clean run with the outer lr
    × (1 + 1e-5) — a change that costs nothing by itself, so `clean_jitter / clean` is how far two runs end
    apart once their trajectories part anywhere (printed, and in the JSON's `resolution`; `--no-jitter` skips it);
  * NaN never reaches an anchor: every tensor of `checkpoints/<cluster>/step_*/rank*-outer.safetensors`
    (anchors and outer Nesterov momentum) at the end of every run is finite (`checkpoint.at_end=true`,
    unlike `_common.BASE_OVERRIDES`). A non-finite outer step would leave the momentum non-finite for
    good, so the end-of-run check covers the whole run;
  * and, as checks of the benchmark, every oracle dropped exactly its window's syncs, and every run was in
    lockstep: each cluster took exactly H local steps before every sync. On a loaded machine a cluster's first
    connection can fail and it joins sync 1 with 0 steps — the federation is fine with that, but the run then
    follows another trajectory than its references; such a run is deleted and run again (up to 3 tries).
JSON (`--out`) + plot (`--plot`: every cluster's weight per sync for each kind, first seed, smallest N;
val loss / clean and / oracle per kind and N) + printed tables.

    python benchmarks/penalty_faults.py --quick   # N=2, seed 0, garbage_data sign_flip nan_payload: 7 runs
    python benchmarks/penalty_faults.py           # N=2,3,4 × seeds 0,1,2 × (clean, jitter, 3 oracles, 6 kinds)
    python benchmarks/penalty_faults.py --steps 960 --clusters 2 --kinds sign_flip garbage_data  # 18 runs, 37 min
    python benchmarks/penalty_faults.py --kinds lie_norm --clusters 3 --seeds 0 --reuse

Measured wall time (2 CPU cores shared with other jobs, so noisy): `--quick` (6 runs before the jitter run) ~5 min
with the cores nearly free (a 2-cluster run 47-54 s; 115-120 s at 960 steps), 11.7 min with them shared (88-151 s
a run). A 4-cluster run costs ~2-3× a 2-cluster one, so the full grid takes ~2 h on free cores (107 min measured;
the ETA printed after each run is the better guide). Runs in lockstep are deterministic: a rerun gives the same
val losses to the last digit.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import _oracle_rule  # noqa: E402
from _end_eval import end_val_loss  # noqa: E402
from _penalty_faults_plot import plot  # noqa: E402

KINDS = ("garbage_data", "lr_spike", "sign_flip", "random_direction", "lie_norm", "nan_payload")
TRAINING_SIDE = ("garbage_data", "lr_spike")  # the rest corrupt what is sent (sim/byzantine.py)
QUICK_KINDS = ("garbage_data", "sign_flip", "nan_payload")
FAULT_GROUP, FAULTY = 1, "c1"
TARGETS = {"weight0_share": 0.9, "false_flags": 0.01, "vs_clean": 1.01, "vs_oracle": 1.005}
ORACLE_RULE = "algo.rule.name=_oracle_rule:OracleRule"
JITTER = "clean_jitter"  # the clean run with the outer lr × (1 + 1e-5): how far two runs that part anywhere end apart


def oracle_of(kind: str) -> str:
    """The oracle run a fault kind is compared with (a payload fault leaves c1's training healthy)."""
    return f"oracle_{kind}" if kind in TRAINING_SIDE else "oracle_payload"


def window_kind(run: str) -> str | None:
    """The fault kind whose window a run's syncs are counted against (None: the clean run)."""
    kind = run.removeprefix("oracle_")
    return None if run in ("clean", JITTER) else "sign_flip" if kind == "payload" else kind


def jitter_override(extra: list[str], clusters: int, interval: int) -> str:
    """The outer lr (a `--set algo.outer.lr=…`, else conf/algo/edit.yaml's, else — unset there — the default for
    `clusters` clusters at `interval`) × (1 + 1e-5): a perturbation that costs nothing by itself, so the jittered
    run's distance from the clean one is the per-seed resolution of every loss ratio here."""
    from omegaconf import OmegaConf

    from edit_train.local_sgd.sync.outer import default_outer_step

    key = "algo.outer.lr="
    given = [e.removeprefix(key) for e in extra if e.startswith(key)]
    preset = OmegaConf.load(C.BENCH_DIR.parent / "conf/algo/edit.yaml").outer.lr
    lr = float(given[-1]) if given else float(preset) if preset is not None else \
        default_outer_step(clusters, interval)[0]
    return f"{key}{lr * (1 + 1e-5)!r}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = C.parser(__doc__, out="penalty_faults.json", plot="penalty_faults.png", workdir="penalty_faults", reuse=True,
                  timeout=3600.0)
    ap.add_argument("--quick", action="store_true", help="2 clusters, seed 0, garbage_data sign_flip nan_payload")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=None)
    ap.add_argument("--clusters", type=int, nargs="+", default=None, help="cluster counts (default 2 3 4)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2; --quick: 0")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--interval", type=int, default=8, help="H = algo.interval")
    ap.add_argument("--warmup-syncs", type=int, default=5, help="W = algo.rule.verified.warmup_syncs")
    ap.add_argument("--start", type=int, default=None, help="first faulty step; default (W+2)*H")
    ap.add_argument("--end", type=int, default=None, help="end of the window (exclusive); default start + 12*H")
    ap.add_argument("--lr-factor", type=float, default=10.0, help="inner LR multiplier of lr_spike")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=48)
    ap.add_argument("--eval-batches", type=int, default=8, help="train.eval_batches (the trainer's val curve)")
    ap.add_argument("--end-eval-batches", type=int, default=128,
                    help="val batches the end model is scored on (0: the trainer's last eval); see _end_eval.py")
    ap.add_argument("--no-jitter", dest="jitter", action="store_false",
                    help=f"skip the {JITTER} run per (clusters, seed) that measures the per-seed resolution")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for every run (repeatable)")
    a = C.parse(ap, argv)
    if a.smoke:  # one payload kind at 2 clusters, seed 0, no jitter run, the end model on 2 val batches
        a.quick, a.kinds, a.jitter, a.end_eval_batches = True, a.kinds or ["sign_flip"], False, 2
    a.kinds = a.kinds or list(QUICK_KINDS if a.quick else KINDS)
    a.clusters = a.clusters or ([2] if a.quick else [2, 3, 4])
    a.seeds = a.seeds if a.seeds is not None else ([0] if a.quick else [0, 1, 2])
    a.start = a.start if a.start is not None else (a.warmup_syncs + 2) * a.interval
    a.end = a.end if a.end is not None else a.start + 12 * a.interval
    if min(a.clusters) < 2:
        ap.error("--clusters: the faulty cluster c1 needs at least 2 clusters")
    if not 0 <= a.start < a.end <= a.steps - a.interval:
        ap.error(f"fault window [{a.start}, {a.end}) must lie inside [0, {a.steps - a.interval}) (a sync after it)")
    if a.start < (a.warmup_syncs + 2) * a.interval:
        print(f"warning: the window starts at step {a.start}, before every test is warm (step "
              f"{(a.warmup_syncs + 2) * a.interval} = (W+2)*H)", flush=True)
    return a


def window_syncs(a: argparse.Namespace, kind: str, steps: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """The syncs a fault on [start, end) concerns. `steps`: sync -> (step, local steps) from the events;
    None: the schedule (sync k at step k·H)."""
    if steps is None:
        steps = {k: (k * a.interval, a.interval) for k in range(1, a.steps // a.interval + 1)}
    if kind in TRAINING_SIDE:
        return sorted(k for k, (s, n) in steps.items() if s - n < a.end and s > a.start)
    return sorted(k for k, (s, _) in steps.items() if a.start <= s < a.end)


def fault_spec(a: argparse.Namespace, kind: str) -> str:
    fields = f"kind:{kind},cluster:{FAULT_GROUP},start:{a.start},end:{a.end}"
    return f"faults=[{{{fields}{f',factor:{a.lr_factor}' if kind == 'lr_spike' else ''}}}]"


def common_overrides(a: argparse.Namespace, n: int, seed: int) -> list[str]:
    return ["model=tiny", "algo=edit", "cluster=local", f"cluster.count={n}", "cluster.ranks=1",
            "checkpoint.at_end=true",  # the anchors are checked for NaN (BASE_OVERRIDES turns it off)
            "algo.rule.name=verified", "train.spike_factor=0", f"seed={seed}", f"train.steps={a.steps}",
            f"train.batch_size={a.batch_size}", f"train.seq_len={a.seq_len}", f"train.eval_every={a.eval_every}",
            f"train.eval_batches={a.eval_batches}", f"algo.interval={a.interval}", "algo.warmup_steps=0",
            f"algo.rule.verified.warmup_syncs={a.warmup_syncs}",
            f"algo.rule.edit_norm.warmup_syncs={a.warmup_syncs}", *a.extra]


def plan(a: argparse.Namespace) -> list[tuple[int, int, str, list[str], dict[str, str]]]:
    """(clusters, seed, run, overrides, extra environment) of every run, in order."""
    out = []
    for n in a.clusters:
        for seed in a.seeds:
            base = common_overrides(a, n, seed)
            out.append((n, seed, "clean", base, {}))
            if a.jitter:
                out.append((n, seed, JITTER, [*base, jitter_override(a.extra, n, a.interval)], {}))
            for oracle in dict.fromkeys(oracle_of(k) for k in a.kinds):
                kind = window_kind(oracle)
                win = window_syncs(a, kind)
                fault = [fault_spec(a, kind)] if kind in TRAINING_SIDE else []
                spec = f"{FAULTY}:{win[0]}:{win[-1]}"  # run.name: the window is in the overrides (--reuse)
                # a rule of one's own gets algo.rule.options (the oracle wraps the verified rule: its parameters)
                options = f"+algo.rule.options.warmup_syncs={a.warmup_syncs}"
                out.append((n, seed, oracle, [*base, *fault, ORACLE_RULE, options,
                                              f"run.name=oracle-{spec.replace(':', '-')}"],
                            {_oracle_rule.ENV: spec}))
            out += [(n, seed, k, [*base, fault_spec(a, k)], {}) for k in a.kinds]
    return out


def run_with_env(name: str, run_dir: Path, overrides: list[str], env: dict[str, str],
                 a: argparse.Namespace) -> C.Job:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return C.run_job(name, run_dir, overrides, timeout=a.timeout, reuse=a.reuse)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def out_of_step(job: C.Job, a: argparse.Namespace) -> list[int]:
    """The syncs at which some cluster had not taken exactly H local steps: a cluster that joined late (e.g. its
    first connection failed on a loaded machine) or missed a sync. Such a run follows another trajectory from
    there and cannot be compared with its references; the runs are deterministic only in lockstep."""
    return sorted({int(e["sync"]) for e in job.events("sync") if int(e["local_steps"]) != a.interval})


def run_in_step(label: str, run_dir: Path, overrides: list[str], env: dict[str, str],
                a: argparse.Namespace, tries: int = 3) -> C.Job:
    """A run in lockstep: one that was not (see `out_of_step`) is deleted and run again, up to `tries` times."""
    tries = 1 if a.smoke else tries  # a smoke's two steps are never a whole interval
    for attempt in range(tries):
        job = run_with_env(label, run_dir, overrides, env, a)
        bad = out_of_step(job, a)
        if not bad:
            return job
        print(f"  {label}: not in lockstep at syncs {bad} (a late join or a missed sync); "
              f"{'running it again' if attempt + 1 < tries else 'giving up'}", flush=True)
        if attempt + 1 < tries:
            shutil.rmtree(run_dir)
    return job


def measure(job: C.Job, a: argparse.Namespace, n: int, seed: int, run: str, trace: bool) -> dict[str, Any]:
    """Per-run numbers: c1's weight over the window syncs, flags per check, anchors, val loss."""
    by: dict[int, dict[str, dict[str, Any]]] = {}
    for e in job.events("sync"):
        by.setdefault(int(e["sync"]), {})[str(e["cluster"])] = e
    syncs = sorted(by)
    steps = {k: (int(by[k][FAULTY]["step"]), int(by[k][FAULTY]["local_steps"])) for k in syncs if FAULTY in by[k]}
    kind = window_kind(run)
    win = [] if kind is None else window_syncs(a, kind, steps)
    c1 = {k: by[k][FAULTY] for k in steps}
    zero = [k for k in win if float(c1[k]["weight"]) <= 1e-12]
    # updates taken back one sync late after the probe judged them harmful: {sync of the update: sync taken back}
    taken = {int(v["sync"]): k for k in syncs for e in by[k].values() for who, v in e.get("retracted", {}).items()
             if who == FAULTY}
    retractions = sum(len(e.get("retracted", {})) for k in syncs for e in by[k].values() if e["cluster"] == FAULTY)
    files, nonfinite, modules = C.anchor_check(job.run_dir)
    events = [e for k in syncs for e in by[k].values()]
    checks = len(events) * len(modules)
    flags = sum(len(e.get("anomalous_modules", [])) for e in events)
    honest = [e for e in events if e["cluster"] != FAULTY]
    honest_flags = sum(len(e.get("anomalous_modules", [])) for e in honest)
    reasons = {k: sorted({r for d in c1[k].get("anomaly_details", {}).values() for r in d.get("reasons", [])})
               for k in c1 if c1[k].get("anomalous")}
    _, losses = job.eval_curve()
    s = job.summary
    final, tokens = (end_val_loss(job.run_dir, a.end_eval_batches) if a.end_eval_batches > 0
                     else (s.get("final_val_loss"), a.eval_batches * a.batch_size * a.seq_len))
    rec: dict[str, Any] = {
        "clusters": n, "seed": seed, "run": run, "faulty": FAULTY, "final_val_loss": final,
        "final_val_tokens": tokens, "train_final_val_loss": s.get("final_val_loss"),
        "window_syncs": win, "weight0_syncs": zero, "weight0_share": len(zero) / len(win) if win else None,
        "c1_weight_in_window": [round(float(c1[k]["weight"]), 4) for k in win],
        "c1_flag_reasons": {str(k): v for k, v in reasons.items()},
        "c1_retracted": {str(k): v for k, v in sorted(taken.items())},  # its update of sync k was taken back at v
        "weight0_or_retracted_share": len([k for k in win if k in zero or k in taken]) / len(win) if win else None,
        "retractions": retractions,  # clusters taken back, summed over the syncs (as c1 saw them)
        "c1_dropped_outside_window": [k for k in c1 if k not in win and float(c1[k]["weight"]) <= 1e-12],
        "checks": checks, "flags": flags,
        "false_flag_rate": flags / checks if run in ("clean", JITTER) and checks else None,
        "honest_flags": honest_flags, "honest_flag_rate": honest_flags / max(len(honest) * len(modules), 1),
        "anchor_files": files, "nonfinite_anchor_tensors": nonfinite[:20], "nan_in_anchors": bool(nonfinite),
        "val_losses_finite": all(math.isfinite(v) for v in [*losses, s.get("final_val_loss", math.nan), final]),
        "syncs": len(syncs), "modules": modules, "job_wall_s": job.wall_s, "run_dir": job.run_dir,
        "out_of_step": out_of_step(job, a),
    }
    if run.startswith("oracle_"):
        rec["oracle_dropped"] = [k for k in c1 if "oracle" in reasons.get(k, [])]
        rec["oracle_window_ok"] = rec["oracle_dropped"] == win
    if trace:
        rec["trace"] = {"syncs": syncs, "steps": [next(iter(by[k].values()))["step"] for k in syncs],
                        "weights": {c: [round(float(by[k][c]["weight"]), 4) if c in by[k] else None for k in syncs]
                                    for c in sorted({c for k in syncs for c in by[k]})},
                        "anomalous": {c: [k for k in syncs if c in by[k] and by[k][c].get("anomalous")]
                                      for c in sorted({c for k in syncs for c in by[k]})}}
    return rec


def aggregate(runs: list[dict[str, Any]], a: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (clusters, kind) over the seeds (the oracles too)."""
    ref = {(r["clusters"], r["seed"], r["run"]): r for r in runs}
    rows = []
    for n in a.clusters:
        for kind in [*a.kinds, *dict.fromkeys(oracle_of(k) for k in a.kinds), *([JITTER] if a.jitter else [])]:
            rs = [r for r in runs if r["clusters"] == n and r["run"] == kind]
            if not rs:
                continue
            vs_c = [r["final_val_loss"] / ref[(n, r["seed"], "clean")]["final_val_loss"] for r in rs]
            oracle = kind.startswith("oracle_") or kind == JITTER  # references: judged on their own checks
            vs_o = [] if oracle else [r["final_val_loss"] / ref[(n, r["seed"], oracle_of(kind))]["final_val_loss"]
                                      for r in rs]
            clean_ff = [ref[(n, r["seed"], "clean")]["false_flag_rate"] for r in rs]
            shares = [r["weight0_share"] for r in rs if r["weight0_share"] is not None]  # none: no window
            row = {"clusters": n, "kind": kind, "seeds": [r["seed"] for r in rs],
                   "weight0_min": min(shares) if shares else None,
                   "weight0_mean": sum(shares) / len(shares) if shares else None,
                   "weight0_or_back_min": (min(r.get("weight0_or_retracted_share") or 0.0 for r in rs)
                                           if shares else None),
                   "clean_retractions": max(ref[(n, r["seed"], "clean")].get("retractions", 0) for r in rs),
                   "clean_ff_max": max(clean_ff), "honest_ff_max": max(r["honest_flag_rate"] for r in rs),
                   "vs_clean_mean": sum(vs_c) / len(vs_c), "vs_clean_worst": max(vs_c), "vs_clean_best": min(vs_c),
                   "vs_oracle_mean": sum(vs_o) / len(vs_o) if vs_o else None,
                   "vs_oracle_worst": max(vs_o, default=None), "vs_oracle_best": min(vs_o, default=None),
                   "nan": any(r["nan_in_anchors"] or not r["val_losses_finite"] for r in rs)}
            if oracle:
                row["ok"] = all(r.get("oracle_window_ok", True) for r in rs) and not row["nan"]
            else:
                row["ok"] = (row["weight0_min"] is not None and row["weight0_min"] >= TARGETS["weight0_share"]
                             and row["clean_ff_max"] <= TARGETS["false_flags"] and row["vs_clean_worst"] <= TARGETS["vs_clean"]
                             and row["vs_oracle_worst"] <= TARGETS["vs_oracle"] and not row["nan"])
            rows.append(row)
    return rows


def targets(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    faulty = [r for r in rows if not (r["kind"].startswith("oracle_") or r["kind"] == JITTER)]
    worst = {"weight0_share": min((r["weight0_min"] for r in faulty), default=None),
             "false_flags": max((r["false_flag_rate"] for r in runs if r["run"] in ("clean", JITTER)), default=None),
             "vs_clean": max((r["vs_clean_worst"] for r in faulty), default=None),
             "vs_oracle": max((r["vs_oracle_worst"] for r in faulty), default=None)}
    out = {}
    for key, what in (("weight0_share", "c1 weight 0 in >= 90% of window syncs (min)"),
                      ("false_flags", "clean (and clean_jitter) false flags per check <= 1% (max)"),
                      ("vs_clean", "final val loss / clean <= 1.01 (worst)"),
                      ("vs_oracle", "final val loss / oracle <= 1.005 (worst)")):
        v, bound = worst[key], TARGETS[key]
        ok = v is not None and (v >= bound if key == "weight0_share" else v <= bound)
        out[what] = {"value": v, "bound": bound, "pass": ok}
    bad = [f"{r['clusters']}/{r['seed']}/{r['run']}" for r in runs
           if r["nan_in_anchors"] or not r["val_losses_finite"]]
    out["no NaN in any anchor (end checkpoints, every run)"] = {"value": bad, "pass": not bad}
    miss = [f"{r['clusters']}/{r['seed']}/{r['run']}" for r in runs if not r.get("oracle_window_ok", True)]
    out["every oracle dropped exactly its window syncs"] = {"value": miss, "pass": not miss}
    late = [f"{r['clusters']}/{r['seed']}/{r['run']}" for r in runs if r.get("out_of_step")]
    out["every run in lockstep (H local steps per cluster and sync)"] = {"value": late, "pass": not late}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    bench = str(C.BENCH_DIR)  # the oracle rule is imported by every edit-train process
    os.environ["PYTHONPATH"] = os.pathsep.join([bench, *[p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and p != bench]])
    todo = plan(a)
    oracles = list(dict.fromkeys(oracle_of(k) for k in a.kinds))
    print(f"{len(todo)} runs: clusters {a.clusters} × seeds {a.seeds} × (clean + {' '.join(oracles)} + "
          f"{' '.join(a.kinds)}); fault on {FAULTY} for steps [{a.start}, {a.end}), {a.steps} steps, H={a.interval},"
          f" W={a.warmup_syncs}; window syncs: payload {window_syncs(a, 'sign_flip')}, "
          f"training-side {window_syncs(a, 'garbage_data')}", flush=True)
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    spent, spent_n = 0.0, 0  # seconds and cluster-runs of the runs not reused (ETA: cost ∝ cluster count)
    for i, (n, seed, run, overrides, env) in enumerate(todo):
        t = time.perf_counter()
        job = run_in_step(f"[{i + 1}/{len(todo)}] n{n} seed {seed} {run}", a.workdir / f"n{n}" / f"seed{seed}" / run,
                          overrides, env, a)
        if time.perf_counter() - t > 1.0:
            spent, spent_n = spent + time.perf_counter() - t, spent_n + n
        runs.append(measure(job, a, n, seed, run, trace=seed == a.seeds[0]))
        left = sum(m for m, *_ in todo[i + 1:])
        if spent_n and left:
            print(f"  ETA ~{spent / spent_n * left / 60:.0f} min for the {len(todo) - i - 1} runs left", flush=True)
    rows = aggregate(runs, a)
    tg = targets(runs, rows)
    resolution = {str(r["clusters"]): [r["vs_clean_best"], r["vs_clean_worst"]] for r in rows if r["kind"] == JITTER}
    wall = time.perf_counter() - t0
    result = {
        "benchmark": "penalty_faults", "quick": a.quick,
        "setup": {"kinds": a.kinds, "clusters": a.clusters, "seeds": a.seeds, "faulty": FAULTY,
                  "window": [a.start, a.end], "window_syncs": {"payload": window_syncs(a, "sign_flip"),
                                                               "training_side": window_syncs(a, "garbage_data")},
                  "steps": a.steps, "interval": a.interval, "warmup_syncs": a.warmup_syncs,
                  "lr_factor": a.lr_factor, "batch_size": a.batch_size, "seq_len": a.seq_len,
                  "eval_batches": a.eval_batches, "end_eval_batches": a.end_eval_batches,
                  "targets": TARGETS, "extra": a.extra},
        "rows": rows, "targets": tg, "resolution": resolution, "runs": runs, "wall_s": wall, "env": C.environment(),
    }
    C.write_json(a.out, result)
    plot(result, a.plot)
    cols = [("kind", "kind", ""), ("weight0_min", "c1 w=0 (min)", ".2f"), ("weight0_mean", "mean", ".2f"),
            ("weight0_or_back_min", "w=0|back", ".2f"), ("clean_ff_max", "clean FF/check", ".4f"),
            ("clean_retractions", "clean back", ""), ("honest_ff_max", "honest FF", ".4f"),
            ("vs_clean_mean", "/clean", ".4f"), ("vs_clean_worst", "worst", ".4f"),
            ("vs_oracle_mean", "/oracle", ".4f"), ("vs_oracle_worst", "worst", ".4f"), ("nan", "NaN", ""),
            ("ok", "pass", "")]
    for n in a.clusters:
        print(f"\n{n} clusters, seeds {a.seeds} (c1 w=0: share of window syncs where c1 had weight 0; FF: "
              "flagged modules per check; honest FF: the other clusters in the faulty run):")
        print(C.table([r for r in rows if r["clusters"] == n], cols))
    for r in runs:
        if r["run"] in a.kinds and r["seed"] == a.seeds[0] and r["clusters"] == a.clusters[0]:
            kept = {k: w for k, w in zip(r["window_syncs"], r["c1_weight_in_window"]) if k not in r["weight0_syncs"]}
            print(f"  n{r['clusters']} seed {r['seed']} {r['run']}: c1 kept weight at window syncs {kept or '-'}; "
                  f"taken back (sync: at) {r.get('c1_retracted') or '-'}; "
                  f"weight 0 outside the window at syncs {r['c1_dropped_outside_window'] or '-'}")
    for n, (lo, hi) in resolution.items():
        print(f"  resolution at {n} clusters: {JITTER} / clean = {lo:.4f} … {hi:.4f} over the seeds (the outer lr "
              "× (1 + 1e-5): any two runs that part somewhere end this far apart)")
    print(f"\ntotal wall {wall / 60:.1f} min; targets:")
    C.print_targets({k: f"{'pass' if v['pass'] else 'FAIL'} ({C.fmt(v['value'])})" for k, v in tg.items()},
                    a.out, a.plot)
    return result


if __name__ == "__main__":
    main()
