"""`edit-train-report RUN_DIR [RUN_DIR ...] [--out DIR]`: plots + a summary table from run directories.

One run: written to RUN_DIR/report; several: ./report. Prints the summary table (Markdown) to stdout."""

from __future__ import annotations

import argparse
import sys

from edit_train.cli.common import fail, one_line


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="edit-train-report",
        description="Plot and tabulate edit-train runs (val loss, train loss with anomaly markers, throughput, "
                    "time blocked on sync, expert load, each cluster's weight per sync with fault windows) from their run.dir.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run.dir (holds metrics.jsonl)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="output folder (default: RUN_DIR/report for one run, ./report for several)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from edit_train.report import ReportError, make_report

    try:
        report = make_report(args.run_dirs, args.out)
    except ReportError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(one_line(exc))
    print(report.table)
    print(f"\nreport: {report.out} ({len(report.plots)} plots + summary.md)")


if __name__ == "__main__":
    main()
