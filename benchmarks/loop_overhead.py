"""Does edit-train's training loop cost anything over a bare loop? DiLoCo, side by side, in alternating pairs.

Both sides train the same model class (`edit_train.model.CausalLM`, `model=tiny`), on the same data (each
cluster's part of `TokenLoader`), with the same LR schedule, inner AdamW, gradient clipping, seed and outer
optimizer (`algo=diloco`: Nesterov SGD, `algo.interval` local steps per sync), as 2 clusters of 1 rank each on
this host (`cluster=local_2x1`), fp32, `train.eval_every=0`, and `OMP_NUM_THREADS=--threads` for every training
process of both sides (default cores ÷ 2: what edit-train's thread budget picks for 2 training processes):

  * bare: `benchmarks/_bare_diloco.py`, two processes spawned here, a hand-written loop around torchft 0.2's
    `Manager` + `torchft.local_sgd.DiLoCo` (gloo, `init_sync=False`, healing off) with a torchft
    `LighthouseServer` started here on 127.0.0.1; the trailing `steps % interval` local steps are synced once
    more at the end, as edit-train does;
  * edit-train: the real CLI, `edit-train algo=diloco cluster=local_2x1 model=tiny train.steps=S ...`.

Run bare, edit-train, bare, edit-train, ... (`--pairs`). Per run and cluster:

  * training tokens/s = the cluster's training tokens / the wall seconds of its training loop: from just before
    step 0 (after process start, data preparation, model build, meeting the other cluster and the initial
    eval) to the end of the final sync, evals excluded. edit-train: `summary.json` per_cluster.time,
    wall_s − startup − eval − checkpoint (what is left is compute, sync, blocked, data, slowdown and `other`,
    the loop's time outside any span); bare: timed by the worker with `perf_counter`. A run's value is the
    sum over its clusters; the ratio is edit-train / bare within a pair;
  * compute tokens/s = tokens / compute seconds (edit-train: the `compute` bucket; bare: loop − data − sync,
    so it also holds the bare loop's own per-step bookkeeping, of which there is next to none);
  * sync seconds per sync (edit-train: sync + blocked buckets; bare: DiLoCo's work inside `optimizer.step()`);
    the bare records also hold their loop's CPU seconds and involuntary context switches (contention);
  * the losses: edit-train's `train` events (every `train.log_every` steps) against the bare loop's loss of the
    same step, and both final val losses (edit-train's `evaluate` on the same batches). Equal is bit-equal.

Target: edit-train's training tokens/s >= the bare loop's (mean ratio >= 1). On a shared box wall-clock numbers
drift between runs (the compute tok/s column shows it; on 2 shared cores one --quick run saw pair ratios from
0.67 to 1.15): alternation spreads the drift over both sides, more pairs narrow it, a quiet host removes it.

    python benchmarks/loop_overhead.py --quick    # 3 pairs x 72 steps, ~3-4 min on 2 cores
    python benchmarks/loop_overhead.py            # 3 pairs x 200 steps, batch 16 x 128, H = algo.interval (32)
    python benchmarks/loop_overhead.py --pairs 5 --steps 400 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

BARE = C.BENCH_DIR / "_bare_diloco.py"
NOT_TRAINING = ("startup", "eval", "checkpoint")  # edit-train buckets outside the training loop


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = C.parser(__doc__, out="loop_overhead.json", workdir="loop_overhead")
    ap.add_argument("--quick", action="store_true", help="72 steps per run (2 syncs + a trailing one)")
    ap.add_argument("--pairs", type=int, default=3, help="bare/edit-train pairs, run alternately")
    ap.add_argument("--steps", type=int, default=None, help="train.steps (default 200, --quick 72)")
    ap.add_argument("--batch-size", type=int, default=None, help="train.batch_size (default: the config's)")
    ap.add_argument("--seq-len", type=int, default=None, help="train.seq_len (default: the config's)")
    ap.add_argument("--interval", type=int, default=None, help="algo.interval (default: diloco's)")
    ap.add_argument("--eval-batches", type=int, default=8, help="train.eval_batches of the final val loss")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) // 2),
                    help="OMP_NUM_THREADS of every training process (default: cores / 2)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for both sides (repeatable)")
    a = C.parse(ap, argv)
    a.steps = a.steps or (72 if a.quick else 200)
    a.pairs = 1 if a.smoke else a.pairs
    return a


def overrides(a: argparse.Namespace) -> list[str]:
    """The overrides both sides compose their config from (edit-train adds `_common.BASE_OVERRIDES`)."""
    out = ["algo=diloco", "cluster=local_2x1", "model=tiny", f"seed={a.seed}", f"train.steps={a.steps}",
           "train.eval_every=0", f"train.eval_batches={a.eval_batches}"]
    for key, val in (("train.batch_size", a.batch_size), ("train.seq_len", a.seq_len), ("algo.interval", a.interval)):
        if val is not None:
            out.append(f"{key}={val}")
    return out + list(a.extra)


def run_bare(run_dir: Path, ovr: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Start a Lighthouse and one `_bare_diloco.py` per cluster; their JSON records by cluster name."""
    from torchft.coordination import LighthouseServer

    from edit_train.cli.common import compose
    from edit_train.config import cluster_specs

    if C.SMOKE is not None:  # both sides on the smoke's one cluster; the bare loop in this process
        ovr = C.smoke_overrides(ovr)
    cfg = compose(ovr)
    names = [s.name for s in cluster_specs(cfg)]
    run_dir.mkdir(parents=True, exist_ok=True)
    f = cfg.federation  # the same Lighthouse settings as edit-train's (federation/quorum.py)
    house = LighthouseServer(bind="127.0.0.1:0", min_replicas=len(names), quorum_tick_ms=50,
                             join_timeout_ms=int(f.join_timeout_s * 1000),
                             heartbeat_timeout_ms=int(f.heartbeat_timeout_s * 1000))
    lighthouse = "http://127.0.0.1:" + house.address().rsplit(":", 1)[-1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    print(f"[{time.strftime('%H:%M:%S')}] bare: {BARE.name} x {len(names)} {' '.join(ovr)}", flush=True)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[str]] = []
    try:
        if C.SMOKE is not None:
            import _bare_diloco

            for name in names:
                _bare_diloco.main(["--cluster", name, "--lighthouse", lighthouse, "--out",
                                   str(run_dir / f"{name}.json"), *ovr])
        for name in names if C.SMOKE is None else []:
            (run_dir / f"{name}.json").unlink(missing_ok=True)
            logs.append((run_dir / f"{name}.log").open("w"))
            procs.append(subprocess.Popen([sys.executable, str(BARE), "--cluster", name, "--lighthouse", lighthouse,
                                           "--out", str(run_dir / f"{name}.json"), *ovr], env=env,
                                          stdout=logs[-1], stderr=subprocess.STDOUT, cwd=str(C.BENCH_DIR.parent)))
        deadline = time.time() + timeout  # poll: a cluster that fails leaves the other waiting for its quorum
        while time.time() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
        house.shutdown()
    out: dict[str, dict[str, Any]] = {}
    for name, rc in zip(names, [p.returncode for p in procs] or [0] * len(names)):
        path = run_dir / f"{name}.json"
        if rc != 0 or not path.exists():
            tail = "\n".join((run_dir / f"{name}.log").read_text(errors="replace").splitlines()[-25:])
            raise C.JobError(f"bare cluster {name} failed (rc={rc}); log {run_dir / name}.log:\n{tail}")
        out[name] = json.loads(path.read_text())
    return out


def bare_row(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    per = {n: {"tokens": r["tokens"], "train_s": r["loop_s"], "compute_s": r["compute_s"], "data_s": r["data_s"],
               "sync_s": r["sync_s"], "syncs": r["syncs"], "other_s": 0.0, "loop_cpu_s": r.get("loop_cpu_s"),
               "loop_nivcsw": r.get("loop_nivcsw")} for n, r in records.items()}
    first = next(iter(records.values()))
    return totals("bare", per, first["final_val_loss"], first["initial_val_loss"],
                  {n: {i + 1: loss for i, loss in enumerate(r["losses"])} for n, r in records.items()})


def edit_row(job: C.Job) -> dict[str, Any]:
    per, losses = {}, {}
    for name, c in job.summary["per_cluster"].items():
        t = c["time"]
        per[name] = {"tokens": c["tokens"], "train_s": t["wall_s"] - sum(t[b] for b in NOT_TRAINING),
                     "compute_s": t["compute"], "data_s": t["data"], "sync_s": t["sync"] + t["blocked"],
                     "syncs": c["syncs"], "other_s": t["other"] + t["slowdown"], "time": t}
        losses[name] = {int(e["step"]): float(e["loss"]) for e in job.events("train") if e.get("cluster") == name}
    s = job.summary
    return totals("edit-train", per, s["final_val_loss"], s["initial_val_loss"], losses)


def totals(side: str, per: dict[str, dict[str, Any]], final: float, initial: float | None,
           losses: dict[str, dict[int, float]]) -> dict[str, Any]:
    """A run's row: tokens/s summed over clusters, seconds averaged over them."""
    n = len(per)
    return {"side": side, "per_cluster": per, "final_val_loss": final, "initial_val_loss": initial, "losses": losses,
            "train_tokens_per_s": sum(c["tokens"] / c["train_s"] for c in per.values()),
            "compute_tokens_per_s": sum(c["tokens"] / c["compute_s"] for c in per.values()),
            "train_s": sum(c["train_s"] for c in per.values()) / n,
            "compute_s": sum(c["compute_s"] for c in per.values()) / n,
            "data_s": sum(c["data_s"] for c in per.values()) / n,
            "other_s": sum(c["other_s"] for c in per.values()) / n,
            "sync_per_sync_s": sum(c["sync_s"] / max(c["syncs"], 1) for c in per.values()) / n,
            "syncs": max(c["syncs"] for c in per.values())}


def compare_losses(bare: dict[str, Any], edit: dict[str, Any]) -> dict[str, Any]:
    """edit-train's logged losses vs the bare loop's at the same steps, and the val losses."""
    diffs = []
    for name, logged in edit["losses"].items():
        mine = bare["losses"][name]
        diffs += [abs(loss - mine[step]) for step, loss in logged.items() if step in mine]
    val = [abs(edit[k] - bare[k]) for k in ("final_val_loss", "initial_val_loss") if edit[k] is not None]
    return {"compared_steps": len(diffs), "train_equal": bool(diffs) and max(diffs) == 0.0,
            "train_max_abs_diff": max(diffs) if diffs else None, "val_equal": max(val) == 0.0,
            "val_max_abs_diff": max(val)}


def print_pair(i: int, bare: dict[str, Any], edit: dict[str, Any], cmp: dict[str, Any]) -> None:
    cols = [("side", "side", ""), ("train_tokens_per_s", "train tok/s", ",.0f"),
            ("compute_tokens_per_s", "compute tok/s", ",.0f"), ("train_s", "loop s", ".2f"),
            ("compute_s", "compute s", ".2f"), ("data_s", "data s", ".3f"), ("other_s", "other s", ".3f"),
            ("sync_per_sync_s", "s/sync", ".3f"), ("syncs", "syncs", ""), ("final_val_loss", "val loss", ".6f")]
    print(f"pair {i}: edit-train / bare training tokens/s = "
          f"{edit['train_tokens_per_s'] / bare['train_tokens_per_s']:.4f} (loop s and compute s: mean over clusters)")
    print(C.table([bare, edit], cols))
    print(f"  losses: {cmp['compared_steps']} logged steps equal: {C.fmt(cmp['train_equal'])} (max |diff| "
          f"{C.fmt(cmp['train_max_abs_diff'], '.3g')}); val losses equal: {C.fmt(cmp['val_equal'])}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # inherited by both sides' training processes
    os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse logs every quorum at INFO otherwise
    ovr = overrides(a)
    timeout = 30.0 * a.steps + 600.0
    pairs: list[dict[str, Any]] = []
    for i in range(a.pairs):
        bare = bare_row(run_bare(a.workdir / f"bare_{i}", ovr, timeout))
        edit = edit_row(C.run_job(f"edit-train {i}", a.workdir / f"edit_{i}", ovr, timeout=timeout))
        cmp = compare_losses(bare, edit)
        pairs.append({"pair": i, "bare": bare, "edit_train": edit, "losses": cmp,
                      "ratio": edit["train_tokens_per_s"] / bare["train_tokens_per_s"],
                      "compute_ratio": edit["compute_tokens_per_s"] / bare["compute_tokens_per_s"]})
        print_pair(i, bare, edit, cmp)
    ratios = [p["ratio"] for p in pairs]
    result = {
        "benchmark": "loop_overhead", "quick": a.quick,
        "setup": {"overrides": ovr, "steps": a.steps, "pairs": a.pairs, "threads_per_process": a.threads,
                  "commands": {"edit_train": " ".join(["edit-train", *C.BASE_OVERRIDES, *ovr]),
                               "bare": " ".join(["python", str(BARE.relative_to(C.BENCH_DIR.parent)),
                                                 "--cluster", "NAME", "--lighthouse", "URL", "--out", "F", *ovr])},
                  "training_tokens_per_s": "sum over clusters of tokens / training-loop wall seconds (step 0 to "
                                           "the end of the final sync; start-up, evals and checkpoints excluded)"},
        "pairs": pairs, "mean_ratio": statistics.fmean(ratios), "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios), "max_ratio": max(ratios),
        "mean_compute_ratio": statistics.fmean(p["compute_ratio"] for p in pairs),
        "losses_equal": all(p["losses"]["train_equal"] and p["losses"]["val_equal"] for p in pairs),
        "target_edit_ge_bare": statistics.fmean(ratios) >= 1.0, "env": C.environment(),
    }
    C.write_json(a.out, result)
    print(C.table(({"pair": p["pair"], "bare": p["bare"]["train_tokens_per_s"],
                    "edit": p["edit_train"]["train_tokens_per_s"], "ratio": p["ratio"],
                    "compute_ratio": p["compute_ratio"],
                    "equal": p["losses"]["train_equal"] and p["losses"]["val_equal"]} for p in pairs),
                  [("pair", "pair", ""), ("bare", "bare tok/s", ",.0f"), ("edit", "edit-train tok/s", ",.0f"),
                   ("ratio", "edit/bare", ".4f"), ("compute_ratio", "compute edit/bare", ".4f"),
                   ("equal", "losses equal", "")]))
    for k in ("mean_ratio", "median_ratio", "min_ratio", "max_ratio", "mean_compute_ratio", "losses_equal",
              "target_edit_ge_bare"):
        print(f"  {k}: {C.fmt(result[k])}")
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
