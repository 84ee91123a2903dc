"""`edit-train-report PATH [PATH ...] [--out DIR]`: plots + a summary table from run directories.

A PATH is a run directory (holds metrics.jsonl) or a sweep folder (Hydra's `<sweep dir>`: its runs, in job
order); what a glob picks up beside runs (Hydra's multirun.yaml, a report folder, a job that never started)
is skipped with one line each on stderr. One PATH: written to PATH/report; several: ./report. Prints the
summary table (Markdown) to stdout."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from edit_train.cli.common import fail, one_line

SWEEP_MARKER = "multirun.yaml"  # Hydra writes it into every sweep folder


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / "metrics.jsonl").is_file()


def _job_order(p: Path) -> tuple[int, int, str]:
    """Sweep jobs by number (0, 1, …, 10), then anything else by name."""
    return (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name)


def find_run_dirs(paths: Sequence[str | Path]) -> tuple[list[Path], list[str]]:
    """The run directories among `paths`, and one "skipping …" line per path that is not a run.

    A path is a run directory (holds `metrics.jsonl`), a sweep folder (a directory of runs, e.g. Hydra's
    `<sweep dir>` with `multirun.yaml` and `0/`, `1/`, …: its runs in job order), or something a glob picked up
    beside runs: a file (`multirun.yaml`) or, inside a sweep folder, a directory that is not a run (a report, a
    job that never started). Those are skipped. A path that does not exist, or a directory named on its own
    that neither is nor holds a run, is a `ReportError` naming it (a typo, not a glob's by-catch); so is
    finding no run at all. Every run is listed once, in the order given.
    """
    from edit_train.report import ReportError

    runs: list[Path] = []
    skipped: list[str] = []
    seen: set[Path] = set()

    def add(p: Path) -> None:
        if p.resolve() not in seen:
            seen.add(p.resolve())
            runs.append(p)

    for raw in paths:
        p = Path(raw)
        if is_run_dir(p):
            add(p)
        elif not p.exists():
            raise ReportError(f"{raw}: no metrics.jsonl (is it a run.dir?)")
        elif not p.is_dir():
            skipped.append(f"skipping {raw}: not a run directory (a file)")
        else:
            children = sorted((c for c in p.iterdir() if not c.name.startswith(".")), key=_job_order)
            inside = [c for c in children if c.is_dir() and is_run_dir(c)]
            if inside:  # a sweep folder
                for c in children:
                    if c in inside:
                        add(c)
                    else:
                        why = "no metrics.jsonl" if c.is_dir() else "a file"
                        skipped.append(f"skipping {c}: not a run directory ({why})")
            elif (p.parent / SWEEP_MARKER).is_file():  # a glob over a sweep folder matched a non-run
                skipped.append(f"skipping {raw}: not a run directory (no metrics.jsonl)")
            else:
                raise ReportError(f"{raw}: no metrics.jsonl (is it a run.dir?)")
    if not runs:
        raise ReportError(f"no run directory among {', '.join(map(str, paths))} (a run.dir holds metrics.jsonl; "
                          f"a sweep folder holds run.dirs)")
    return runs, skipped


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="edit-train-report",
        description="Plot and tabulate edit-train runs (val loss, train loss with anomaly markers, throughput, "
                    "time blocked on sync, expert load, which cluster feeds which expert, each cluster's weight per "
                    "sync with fault windows) from their run.dir, or from every run of a sweep folder.")
    parser.add_argument("run_dirs", nargs="+", metavar="PATH",
                        help="a run.dir (holds metrics.jsonl) or a sweep folder (holds run.dirs); anything else "
                             "a glob matches (multirun.yaml) is skipped with one line")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="output folder (default: PATH/report for one PATH, ./report for several)")
    parser.add_argument("--expert-intervals", metavar="N", type=int, default=0,
                        help="expert_clusters.png: each cluster's share of every expert's routed tokens over its last "
                             "N intervals (syncs) instead of the whole run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from edit_train.report import ReportError, default_out, make_report

    try:
        runs, skipped = find_run_dirs(args.run_dirs)
        for line in skipped:
            print(line, file=sys.stderr, flush=True)
        report = make_report(runs, args.out if args.out is not None else default_out(args.run_dirs),
                             args.expert_intervals)
    except ReportError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(one_line(exc))
    print(report.table)
    print(f"\nreport: {report.out} ({len(report.plots)} plots + summary.md)")


if __name__ == "__main__":
    main()
