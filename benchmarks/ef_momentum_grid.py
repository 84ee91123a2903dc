"""Error feedback as outer momentum on grouped top-k at 1/100 of the bytes: the decay x outer-lr grid (issue 51).

`benchmarks/compression.py`'s runs (the same settings: tiny, 2 clusters, 320 steps, H = 8, edit at the convergence
grid's point, AdamW), read or run through its machinery, on the 3-of-32-groups-of-8, 2-bit pair
(`topk_9pct_2b_g8*`: 0.96 % of fp32's bytes). A seed-0 screen over the residual's decay β
(`sync.error_feedback_decay`; "keep" and "no error feedback" as rows of their own) and the outer lr
(`algo.outer.lr`), then the best points on seeds 0-2. The uncompressed reference runs at its tuned outer lr 0.7
and, for the same question asked of it, at 1.4 (`none_lr14`). Every cell is val loss / the uncompressed run's of
the same seed.

    python benchmarks/ef_momentum_grid.py --reuse --workdir /work/bench_i51/compression   # ~25 min from scratch

Writes docs/compression_2026_screen.{json,png}: the grid as a heat map, the confirmed points' seeds as dots.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import compression  # noqa: E402

PAIR = "topk_9pct_2b_g8"
REFERENCES = ["none", "none_lr14"]
CONFIRM = ["topk_9pct_2b_g8_keep", "topk_9pct_2b_g8_efm60_lr14", "topk_9pct_2b_g8_efm60_lr17"]
LRS = (0.7, 1.0, 1.4, 1.7, 2.0)


def grid_schemes() -> list[str]:
    """Every scheme of the pair that takes the benchmark's own outer step (not the `_outer` ones)."""
    return [n for n in compression.SCHEMES if n.startswith(PAIR) and not n.endswith("_outer")]


def point(name: str) -> tuple[str, float]:
    """(row, outer lr) of a scheme, read from its overrides: the row is its residual's fate."""
    kv: dict[str, str] = {}
    for o in [*compression.EDIT, *compression.SCHEMES[name]]:  # later overrides win, as on the command line
        k, _, v = o.partition("=")
        kv[k] = v
    lr = float(kv["algo.outer.lr"])
    if kv.get("sync.compression") != "topk":
        return "fp32 (uncompressed)", lr
    if kv.get("sync.error_feedback") == "false":
        return "no error feedback", lr
    if kv.get("sync.unsent") == "keep":
        return "keep", lr
    return f"β = {float(kv.get('sync.error_feedback_decay', 1.0)):g}", lr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--confirm", nargs="+", default=CONFIRM, choices=grid_schemes(),
                    help="the points run on every seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs (compression.py's --reuse)")
    ap.add_argument("--workdir", type=Path, default=C.RUNS_DIR / "compression")
    ap.add_argument("--out", type=Path, default=C.RESULTS_DIR / "compression_2026_screen.json")
    ap.add_argument("--plot", type=Path, default=C.RESULTS_DIR / "compression_2026_screen.png")
    return ap.parse_args(argv)


def runs(a: argparse.Namespace, schemes: list[str], seeds: list[int]) -> dict[str, Any]:
    """compression.py's convergence setting for these schemes and seeds (its run directories, its reuse)."""
    b = compression.parse_args(["--settings", "convergence", "--no-small", "--seeds", *map(str, seeds),
                                "--schemes", *schemes, "--workdir", str(a.workdir), *(["--reuse"] if a.reuse else [])])
    return compression.one_setting(b, "convergence")


def ratios(r: dict[str, Any]) -> dict[str, list[float]]:
    return {name: list(p["loss_ratio"]) for name, p in r["per_seed"].items()}


def plot(screen: dict[str, list[float]], confirmed: dict[str, list[float]], path: Path) -> Path:
    plt = C.pyplot()
    rows = sorted({point(n)[0] for n in screen}, key=lambda r: (r[0] != "β", r.startswith("β") and -float(r[4:]), r))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.3, 1]})
    grid = [[math.nan] * len(LRS) for _ in rows]
    for name, rs in screen.items():
        row, lr = point(name)
        if lr in LRS:
            grid[rows.index(row)][LRS.index(lr)] = rs[0]
    im = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.95, vmax=1.10, aspect="auto")
    for i, line in enumerate(grid):
        for j, v in enumerate(line):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(LRS)), [f"{lr:g}" for lr in LRS])
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("outer lr (algo.outer.lr)")
    ax.set_ylabel("what top-k left out (sync.error_feedback_decay β)")
    ax.set_title("seed 0: val loss ÷ uncompressed (0.96 % of its bytes)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    names = list(confirmed)
    for i, name in enumerate(names):
        rs = confirmed[name]
        bx.bar(i, statistics.fmean(rs), color="#8da0cb", width=0.6)
        bx.plot([i] * len(rs), rs, "ko", ms=4)
    bx.axhline(1.0, color="gray", lw=0.8)
    bx.axhline(1.01, color="gray", ls="--", lw=0.8, label="1.01 (the worst seed's bound)")
    bx.set_xticks(range(len(names)), [n.replace(PAIR, "").lstrip("_") or "plain" for n in names], fontsize=8)
    lo = min(min(v) for v in confirmed.values())
    hi = max(max(v) for v in confirmed.values())
    bx.set_ylim(min(lo, 1.0) - 0.02, max(hi, 1.01) + 0.02)
    bx.set_ylabel("val loss ÷ uncompressed (bar: mean; dots: seeds)")
    bx.set_title(f"{PAIR} on every seed", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    return C.save_fig(fig, path)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    t0 = time.perf_counter()
    screen_run = runs(a, [*REFERENCES, *grid_schemes()], [0])
    confirm_run = runs(a, a.confirm, a.seeds)
    screen = ratios(screen_run)  # with the reference itself (1 at its tuned outer lr)
    confirmed = {n: r for n, r in ratios(confirm_run).items() if n != "none"}
    rows = [{"scheme": n, "residual": point(n)[0], "outer_lr": point(n)[1], "seed0_ratio": r[0]}
            for n, r in screen.items()]
    conf_rows = [{"scheme": n, "ratio_mean": statistics.fmean(r), "ratio_worst": max(r), "ratios": r,
                  "vs_none_bytes": next(x["vs_none"] for x in confirm_run["rows"] if x["scheme"] == n)}
                 for n, r in confirmed.items()]
    print(C.table(rows, [("scheme", "scheme", ""), ("residual", "residual", ""), ("outer_lr", "outer lr", "g"),
                         ("seed0_ratio", "÷ none (seed 0)", ".4f")]))
    print(C.table(conf_rows, [("scheme", "scheme", ""), ("ratio_mean", "÷ none (mean)", ".4f"),
                              ("ratio_worst", "worst seed", ".4f"), ("vs_none_bytes", "÷ none bytes", ".4f")]))
    free = [r for r in conf_rows if r["ratio_mean"] <= 1.0 and r["ratio_worst"] <= 1.01 and r["vs_none_bytes"] <= 0.01]
    tg = {"<= 1/100 bytes at <= 1.00x loss (worst <= 1.01x)": bool(free),
          "best confirmed": min(conf_rows, key=lambda r: r["ratio_mean"])["scheme"] if conf_rows else None}
    plot_path = plot(screen, confirmed, a.plot)
    out = C.write_json(a.out, {"benchmark": "ef_momentum_grid", "pair": PAIR, "screen_seed": 0, "seeds": a.seeds,
                               "command": " ".join(["python", "benchmarks/ef_momentum_grid.py", *sys.argv[1:]]),
                               "edit_overrides": compression.EDIT,
                               "schemes": {n: compression.SCHEMES[n] for n in [*REFERENCES, *screen, *confirmed]},
                               "screen": rows, "confirmed": conf_rows, "targets": tg,
                               "wall_s": time.perf_counter() - t0, "env": C.environment()})
    print()
    C.print_targets(tg, out, plot_path)


if __name__ == "__main__":
    main()
