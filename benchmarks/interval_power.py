"""Syncs that follow the lr (`algo.interval_power`, issue 51): edit at each optimizer's tuned point with the
syncs every 8 steps (p = 0) and at equal quantiles of Σ lr (p = 1, the same 40 syncs), against DDP at its own
tuned point — the `model=tiny` 320-step setting of `benchmarks/muon_lr.py`, whose runs this reuses (same
work directory, same run names): only the p = 1 runs are new.

    python benchmarks/interval_power.py --reuse --workdir /work/bench_i51/muon_lr   # 5 new runs, ~9 min on 2 cores

Muon: edit at lr 3e-2, momentum 0.9, averaging without the rule's clip (muon_lr.py's best), DDP at lr 3e-2,
momentum 0.8 — seeds 0, 1, 2 at 2 clusters and seed 0 at 4. AdamW: edit at lr 3e-3, outer 0.5 / 0.5 Nesterov,
DDP at 3e-3 (seed 0). Why p = 1: in the one-process harness (`inner_state.py --lr-power`) p = 1 beat p = 0 and
p = 2 with Muon (1.6155 / 1.6503 / 1.6557), and a linear ramp of the intervals the other way lost (1.6947).
Output: docs/interval_power.json and docs/interval_power.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import muon_lr as M  # noqa: E402

POWER = 1.0


def with_power(s: dict[str, Any], power: float) -> dict[str, Any]:
    """The same setting with the syncs at equal quantiles of Σ lr^power (0: unchanged, the muon_lr.py run)."""
    if power == 0:
        return {**s, "power": 0.0}
    return {**s, "power": power, "name": f"{s['name']}_p{power:g}",
            "overrides": [*s["overrides"], f"algo.interval_power={power!r}"]}


def settings() -> list[dict[str, Any]]:
    out = []
    for clusters, seed in ((2, 0), (2, 1), (2, 2), (4, 0)):
        out.append(with_power(M.setting("ddp", "muon", 3e-2, None, seed=seed, clusters=clusters, momentum=0.8), 0))
        for p in (0.0, POWER):
            out.append(with_power(M.setting("edit", "muon", 3e-2, "1.0/0-noclip", seed=seed, clusters=clusters,
                                            momentum=0.9), p))
    out.append(with_power(M.setting("ddp", "adamw", 3e-3, None), 0))
    out += [with_power(M.setting("edit", "adamw", 3e-3, "0.5/0.5N"), p) for p in (0.0, POWER)]
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """edit / DDP per optimizer, cluster count and seed, with p = 0 and p = 1."""
    out: dict[str, Any] = {}
    for r in rows:
        if r["algo"] != "edit":
            continue
        ddp = next(d for d in rows if d["algo"] == "ddp" and (d["optimizer"], d["seed"], d["clusters"])
                   == (r["optimizer"], r["seed"], r["clusters"]))
        key = f"{r['optimizer']} g{r['clusters']} s{r['seed']}"
        out.setdefault(key, {"ddp": ddp["final_val_loss"]})[f"p{r['power']:g}"] = {
            "edit": r["final_val_loss"], "ratio": r["final_val_loss"] / ddp["final_val_loss"]}
    return out


def plot(summary: dict[str, Any], path: Path) -> Path:
    plt = C.pyplot()
    keys = list(summary)
    fig, ax = plt.subplots(figsize=(8, 4))
    for j, p in enumerate(("p0", f"p{POWER:g}")):
        vals = [summary[k].get(p, {}).get("ratio", float("nan")) for k in keys]
        ax.bar([i + (j - 0.5) * 0.38 for i in range(len(keys))], vals, width=0.38,
               label="every 8 steps (p = 0)" if p == "p0" else f"following the lr (p = {POWER:g})")
    ax.axhline(1.02, color="gray", ls="--", lw=1, label="issue 51's bar (1.02)")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(keys)), keys)
    ax.set_ylim(0.98, max(1.12, *[v["p0"]["ratio"] for v in summary.values() if "p0" in v]) + 0.01)
    ax.set_ylabel("edit / DDP validation loss")
    ax.set_title("tiny, 320 steps, 40 syncs: where the syncs go")
    ax.legend(fontsize=8)
    return C.save_fig(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs with identical overrides")
    ap.add_argument("--workdir", type=Path, default=C.RUNS_DIR / "muon_lr", help="muon_lr.py's run directories")
    ap.add_argument("--out", type=Path, default=M.DOCS / "interval_power.json")
    ap.add_argument("--plot", type=Path, default=M.DOCS / "interval_power.png")
    ap.add_argument("--timeout", type=float, default=3600.0)
    a = ap.parse_args(argv)
    a.adopt, a.finished_only = False, False
    t0, rows = time.time(), []
    todo = settings()
    for i, s in enumerate(todo, start=1):
        print(f"[{i}/{len(todo)}] {s['name']}", flush=True)
        r = M.run(a, s)
        if r is not None:
            rows.append(r)
    summary = summarize(rows)
    out = {"benchmark": "interval_power", "setup": {"base": M.BASE, "local": M.LOCAL, "power": POWER},
           "summary": summary, "runs": rows, "wall_s": time.time() - t0, "env": C.environment()}
    C.write_json(a.out, out)
    print(json.dumps(summary, indent=1))
    print(f"wrote {a.out} and {plot(summary, a.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
