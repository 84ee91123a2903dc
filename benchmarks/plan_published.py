"""The planner against three published results (issue 23, acceptance 2), each also a test in
tests/plan/test_plan_published.py; the settings and the paper numbers live in `edit_train/plan/published.py`.

* Streaming DiLoCo (arXiv 2501.18512) Table 4: Gbit/s needed for 50-99 % compute utilisation, Data-Parallel
  and vanilla DiLoCo, 1B/10B/100B — every cell within one point of the paper's log grid (±21 %)?
* Ling (arXiv 2503.05139) Figure 8: synchronous baseline and EDiT step/s at 256-4,096 accelerators,
  calibrated at 256 only — within 5 %?
* HALoS (arXiv 2506.04531) 4 regions × 4 workers: our round times and hours against the authors' simulator.

    python benchmarks/plan_published.py            # prints the three tables, results/plan_published.{json,png}
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from edit_train.plan import published as pub  # noqa: E402


def main() -> None:
    a = C.parse(C.parser(__doc__, out="plan_published.json"))
    t0 = time.perf_counter()

    cells = pub.streaming_diloco_table()
    print("Streaming DiLoCo, Table 4: Gbit/s to reach a compute utilisation (paper | ours, grid points off)")
    print(f"{'size':>5} {'method':<15}" + "".join(f"{int(c * 100):>16}%" for c in pub.SD_CU))
    for size in pub.SD_PAPER:
        for method in pub.SD_PAPER[size][2]:
            row = [c for c in cells if c.size == size and c.method == method]
            print(f"{size:>5} {method:<15}" + "".join(
                f"{c.paper_gbps:>7.1f} |{c.predicted_gbps:>6.1f} {c.grid_steps:+d}" for c in row))
    worst = max(abs(c.grid_steps) for c in cells)
    print(f"worst cell: {worst} grid point(s) off; exact: {sum(c.grid_steps == 0 for c in cells)}/{len(cells)}\n")

    fit, ling = pub.ling_fig8()
    print(f"Ling Figure 8 (calibrated at 256: fast step {fit.fast_s:.2f} s, slow step ×{fit.slow_factor} with "
          f"p = {fit.p_slow:.5f} per accelerator and step)")
    print(f"{'accel':>6} {'baseline paper':>15} {'ours':>8} {'err':>7} {'EDiT paper':>11} {'ours':>8} {'err':>7}")
    for r in ling:
        print(f"{r['accelerators']:>6} {r['baseline_paper']:>15.4f} {r['baseline_pred']:>8.4f} "
              f"{r['baseline_err']:>+7.1%} {r['edit_paper']:>11.4f} {r['edit_pred']:>8.4f} {r['edit_err']:>+7.1%}")
    print()

    halos = pub.halos_table()
    print(f"HALoS environment (4x4, best ring {pub.halos_ring_gbps()} Gbit/s, Pythia-70M fp32): seconds per round "
          "and hours for 12.9 B tokens")
    print(f"{'method':<44} {'theirs s':>9} {'ours s':>8} {'err':>7} {'theirs h':>9} {'ours h':>8} {'blocked':>8}")
    def cell(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "-"

    for r in halos:
        print(f"{r['method']:<44} {cell(r, 'theirs_round_s', '.2f'):>9} {r['ours_round_s']:>8.2f} "
              f"{cell(r, 'round_err', '+.1%'):>7} {cell(r, 'theirs_hours', '.3f'):>9} {r['ours_hours']:>8.3f} "
              f"{r['ours_blocked']:>8.3f}")

    out = {"benchmark": "plan_published", "seconds": round(time.perf_counter() - t0, 2),
           "streaming_diloco": {"grid_gbps": "numpy.logspace(-1, 3, 50)", "worst_grid_steps": worst,
                                "cells": [c.to_json() for c in cells]},
           "ling_fig8": {"fit": {"fast_s": fit.fast_s, "p_slow": fit.p_slow, "slow_factor": fit.slow_factor},
                         "rows": ling},
           "halos": {"ring_gbps": pub.halos_ring_gbps(), "rows": halos}}
    C.write_json(a.out, out)
    plot(cells, ling, a.out.with_suffix(".png"))
    print(f"\nwrote {a.out} and {a.out.with_suffix('.png')} ({out['seconds']} s)")


def plot(cells: list[pub.SDCell], ling: list[dict], path: Path) -> None:
    fig, (ax1, ax2) = C.pyplot().subplots(1, 2, figsize=(11, 4.2))
    for method, marker in (("Data-Parallel", "o"), ("Vanilla DiLoCo", "s")):
        pts = [c for c in cells if c.method == method]
        ax1.scatter([c.paper_gbps for c in pts], [c.predicted_gbps for c in pts], marker=marker, label=method)
    lo, hi = 1.0, 1000.0
    ax1.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    step = float(pub.SD_GRID_GBPS[1] / pub.SD_GRID_GBPS[0])
    ax1.fill_between([lo, hi], [lo / step, hi / step], [lo * step, hi * step], color="0.85", label="±1 grid point")
    ax1.set(xscale="log", yscale="log", xlabel="paper: Gbit/s for the utilisation", ylabel="planner: Gbit/s",
            title="Streaming DiLoCo Table 4 (30 cells)")
    ax1.legend(fontsize=8)
    ns = [r["accelerators"] for r in ling]
    ax2.plot(ns, [r["baseline_paper"] for r in ling], "o", color="C0", label="baseline (paper)")
    ax2.plot(ns, [r["baseline_pred"] for r in ling], "-", color="C0", label="baseline (planner)")
    ax2.plot(ns, [r["edit_paper"] for r in ling], "s", color="C1", label="EDiT (paper)")
    ax2.plot(ns, [r["edit_pred"] for r in ling], "-", color="C1", label="EDiT (planner)")
    ax2.axvline(256, color="0.6", ls=":", lw=1)
    ax2.set_xscale("log")
    ax2.set_xticks(ns, [str(n) for n in ns])
    ax2.minorticks_off()
    ax2.set(xlabel="accelerators (calibrated at 256)", ylabel="step/s", ylim=(0, 0.1),
            title="Ling Figure 8")
    ax2.legend(fontsize=8)
    C.save_fig(fig, path)


if __name__ == "__main__":
    main()
