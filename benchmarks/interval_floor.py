"""How close can averaging get to DDP at all? Local SGD with Muon at H = 1, 2, 4, 8 in the one-process harness
(issue 51's acceptance 1: edit ≤ 1.02 × DDP at H = 8, 320 steps, `model=tiny`).

Every run is `benchmarks/inner_state.py` (G replicas of tiny on the clusters' own data parts, the real optimizer,
schedule, clip and evaluation, the replicas' parameters averaged every H steps and nothing else — what edit
without the rule's clip and with outer lr 1, no momentum computes; when the harness was written it agreed with the
product to 0.3 %, and on 2026-11-29 its DDP ended 0.8 % under the product's seed-0 run, so every ratio here
divides by the harness's own DDP).
H = 1 is the floor of that family: a sync after every step, the most any local-SGD schedule can communicate.
If averaging every step already sits near the bar, no outer-loop option at H = 8 reaches it by doing what
averaging does more often; it has to beat averaging itself.

Muon at lr 3e-2 for all (DDP's and edit's best lr in `benchmarks/muon_lr.py`). DDP at its tuned momentum 0.8;
the replicas at momentum 0.8 and 0.9 (edit's best at H = 8), the better of the two kept — one point more than
DDP gets, on the replicas' side. At H = 1 also with every optimizer state tensor averaged at each sync
(`--mode local_state`).

    python benchmarks/interval_floor.py --reuse --workdir /work/bench_s62/floor   # 27 runs, ~80 min on 2 cores

Output: docs/interval_floor.json and docs/interval_floor.png (edit-style averaging / DDP against H).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

HARNESS = Path(__file__).resolve().parent / "inner_state.py"
DOCS = Path(__file__).resolve().parents[1] / "docs"
LR = 3e-2
DDP_MOMENTUM = 0.8
MOMENTA = (0.8, 0.9)
BAR = 1.02


@dataclass(frozen=True)
class Point:
    """One harness run."""

    mode: str  # ddp | local | local_state
    clusters: int
    seed: int
    interval: int = 8
    momentum: float = DDP_MOMENTUM
    lr: float = LR

    @property
    def name(self) -> str:
        h = "" if self.mode == "ddp" else f"_H{self.interval}"
        return f"{self.mode}_g{self.clusters}_s{self.seed}{h}_m{self.momentum:g}_lr{self.lr:g}"

    def argv(self, out: Path, data_dir: Path) -> list[str]:
        return ["--mode", self.mode, "--clusters", str(self.clusters), "--seed", str(self.seed),
                "--interval", str(self.interval), "--lr", repr(self.lr), "--momentum", repr(self.momentum),
                "--run-dir", str(data_dir), "--out", str(out)]


def points() -> list[Point]:
    """2 clusters seed 0: H = 1, 2, 4, 8; 4 clusters seed 0: H = 1, 8; seeds 1, 2 at 2 and 4 clusters: H = 1 (the
    floor's spread). Each with DDP beside it."""
    out: list[Point] = []
    for clusters, seed, intervals in ((2, 0, (1, 2, 4, 8)), (4, 0, (1, 8)), (2, 1, (1,)), (2, 2, (1,)),
                                      (4, 1, (1,)), (4, 2, (1,))):
        out.append(Point("ddp", clusters, seed))
        out += [Point("local", clusters, seed, h, m) for h in intervals for m in MOMENTA]
    out.append(Point("local_state", 2, 0, 1, DDP_MOMENTUM))
    return out


def finished(p: Point, out: Path) -> float | None:
    """The final val loss of a run already on disk with exactly these arguments, else None."""
    if not out.is_file():
        return None
    d = json.loads(out.read_text())
    want = {"mode": p.mode, "clusters": str(p.clusters), "seed": str(p.seed), "lr": str(p.lr),
            "momentum": str(p.momentum), "optimizer": "muon", "steps": "320"}
    if p.mode != "ddp":
        want["interval"] = str(p.interval)
    args = d.get("args", {})
    return float(d["final_val_loss"]) if all(args.get(k) == v for k, v in want.items()) else None


def run(p: Point, workdir: Path, reuse: bool, timeout: float) -> float:
    out = workdir / f"{p.name}.json"
    if reuse and (v := finished(p, out)) is not None:
        return v
    log = workdir / f"{p.name}.log"
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, str(HARNESS), *p.argv(out, workdir / "data")], stdout=f,
                            stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-5:]
        raise C.JobError(f"{p.name} failed (rc {rc}): " + " | ".join(tail))
    return float(json.loads(out.read_text())["final_val_loss"])


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cluster count and seed: DDP's loss, and per H the replicas' best momentum, its loss and its ratio to
    DDP (plus the H = 1 run with the whole optimizer state averaged, where there is one)."""
    out: dict[str, Any] = {}
    for r in (r for r in rows if r["mode"] == "ddp"):
        ddp = r["final_val_loss"]
        mine = [x for x in rows if (x["clusters"], x["seed"]) == (r["clusters"], r["seed"])]
        entry: dict[str, Any] = {"ddp": ddp, "intervals": {}}
        for h in sorted({x["interval"] for x in mine if x["mode"] == "local"}):
            tried = [x for x in mine if x["mode"] == "local" and x["interval"] == h]
            best = min(tried, key=lambda x: x["final_val_loss"])
            entry["intervals"][str(h)] = {"momentum": best["momentum"], "loss": best["final_val_loss"],
                                          "ratio": best["final_val_loss"] / ddp,
                                          "tried": {f"{x['momentum']:g}": x["final_val_loss"] for x in tried}}
        for x in (x for x in mine if x["mode"] == "local_state"):
            entry[f"state_averaged_H{x['interval']}"] = {"loss": x["final_val_loss"],
                                                         "ratio": x["final_val_loss"] / ddp}
        out[f"g{r['clusters']} s{r['seed']}"] = entry
    return out


def floor(summary: dict[str, Any]) -> dict[str, Any]:
    """The H = 1 ratio per cluster count over the seeds that have it: mean, min, max, and each seed's."""
    per: dict[str, dict[str, float]] = {}
    for key, e in summary.items():
        if "1" in e["intervals"]:
            clusters, seed = key.split()
            per.setdefault(clusters, {})[seed] = e["intervals"]["1"]["ratio"]
    return {g: {"mean": sum(v.values()) / len(v), "min": min(v.values()), "max": max(v.values()), "seeds": v}
            for g, v in per.items()}


def plot(summary: dict[str, Any], path: Path) -> Path:
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, e in summary.items():
        hs = sorted(int(h) for h in e["intervals"])
        if not hs:
            continue
        ratios = [e["intervals"][str(h)]["ratio"] for h in hs]
        ax.plot(hs, ratios, marker="o", ls="-" if len(hs) > 1 else "none", label=f"averaging / DDP, {key}")
        for k, v in e.items():
            if k.startswith("state_averaged_H"):
                ax.plot([int(k.removeprefix("state_averaged_H"))], [v["ratio"]], marker="s", ls="none",
                        mfc="none", label=f"+ optimizer state averaged, {key}")
    ax.axhline(BAR, color="gray", ls="--", lw=1, label=f"issue 51's bar ({BAR})")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.set_xlabel("H: local steps between averages")
    ax.set_ylabel("validation loss / DDP's")
    ax.set_title("tiny, Muon, 320 steps: averaging / DDP against H (H = 1: the floor)")
    ax.legend(fontsize=7)
    return C.save_fig(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs with identical arguments")
    ap.add_argument("--workdir", type=Path, default=C.RUNS_DIR / "interval_floor")
    ap.add_argument("--out", type=Path, default=DOCS / "interval_floor.json")
    ap.add_argument("--plot", type=Path, default=DOCS / "interval_floor.png")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    a = ap.parse_args(argv)
    a.workdir.mkdir(parents=True, exist_ok=True)
    t0, rows, todo = time.time(), [], points()
    for i, p in enumerate(todo, start=1):
        t = time.time()
        try:
            loss = run(p, a.workdir, a.reuse, a.timeout)
        except (C.JobError, subprocess.TimeoutExpired) as e:
            print(f"error: {e}".splitlines()[0], file=sys.stderr)
            return 1
        rows.append({**asdict(p), "name": p.name, "final_val_loss": loss})
        print(f"[{i}/{len(todo)}] {p.name}: {loss:.4f} ({time.time() - t:.0f} s)", flush=True)
    summary = summarize(rows)
    C.write_json(a.out, {"benchmark": "interval_floor", "setup": {"lr": LR, "ddp_momentum": DDP_MOMENTUM,
                                                                  "momenta": MOMENTA, "steps": 320,
                                                                  "model": "tiny", "optimizer": "muon"},
                         "summary": summary, "floor_H1": floor(summary), "runs": rows,
                         "wall_s": time.time() - t0, "env": C.environment()})
    print(json.dumps(summary, indent=1))
    print(f"wrote {a.out} and {plot(summary, a.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
