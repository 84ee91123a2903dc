"""Write docs/benchmarks.md from the benchmark results in docs/*.json, so the measurements page cannot drift.

One section per benchmark (sorted by name): what it measures (the first paragraph of the benchmark script's
module docstring), the commands that regenerate it (the docstring's command lines, and the command a result
file recorded), then one part per result file: when and on what it was measured, its targets (value, pass)
and its top-level figures. A result file of a shape this script does not know still gets its top-level scalar
fields. Prose measurements no JSON holds are hand-written in docs/measurements_notes.md (linked, not copied).
Reads only JSON and the scripts' source text (no benchmark is imported or run); the output is deterministic.

    python benchmarks/benchmarks_md.py                 # rewrites docs/benchmarks.md
    python benchmarks/benchmarks_md.py --check         # exit 1 when docs/benchmarks.md is not what it would write
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BENCH = REPO / "benchmarks"
OUT = DOCS / "benchmarks.md"
SKIP_FIELDS = {"benchmark", "command", "quick", "note"}  # shown elsewhere in the section
COMMAND = re.compile(r"^\s{2,}((?:sudo |PYTHONPATH=\S+ )*(?:python|bash) benchmarks/\S+.*)$")


def fmt(value: Any) -> str:
    """A value for a table cell: floats to 4 significant digits, booleans yes/no, lists joined."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:,.0f}" if 1e3 <= abs(value) < 1e9 else f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value)
    if value is None:
        return "—"
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")


def docstring(script: Path) -> str:
    return ast.get_docstring(ast.parse(script.read_text())) or ""


def first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n", 1)[0].split())


def doc_commands(doc: str) -> list[str]:
    """The indented command lines of a docstring (a trailing backslash joins the next line)."""
    commands: list[str] = []
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        match = COMMAND.match(lines[i])
        if match:
            command = match.group(1).rstrip()
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1].rstrip() + " " + lines[i].strip()
            commands.append(command)
        i += 1
    return commands


def script_for(stem: str, data: dict[str, Any]) -> str | None:
    """The benchmark script a result file came from: its `benchmark` field, else the longest script name its
    file name starts with (`penalty_faults_960_n3` → `penalty_faults`)."""
    named = data.get("benchmark")
    if isinstance(named, str) and (BENCH / f"{named}.py").is_file():
        return named
    parts = stem.split("_")
    for n in range(len(parts), 0, -1):
        name = "_".join(parts[:n])
        if (BENCH / f"{name}.py").is_file() and not name.startswith("_"):
            return name
    return None


def environment(data: dict[str, Any]) -> str:
    """When and on what a result was measured, from whichever of the known fields it has."""
    setup = data.get("setup") if isinstance(data.get("setup"), dict) else {}
    env = data.get("env") or data.get("environment") or setup.get("env") or {}
    host = data.get("host") if isinstance(data.get("host"), dict) else {}
    parts = []
    if isinstance(env, dict):
        parts += [f"{env['time']}" if "time" in env else "date not recorded"]
        parts += [str(env[k]) for k in ("platform",) if k in env]
        if "cpus" in env:
            parts.append(f"{env['cpus']} CPUs")
        parts += [f"{k} {env[k]}" for k in ("python", "torch") if k in env]
    else:
        parts.append("date not recorded")
    for key in ("device", "cpu"):
        if isinstance(data.get(key), str):
            parts.append(data[key])
    if "cpu_count" in data or "cpu_count" in host:
        parts.append(f"{data.get('cpu_count', host.get('cpu_count'))} CPUs")
    if isinstance(data.get("torch"), str) and not any(p.startswith("torch ") for p in parts):
        parts.append(f"torch {data['torch']}")
    load = (data.get("loadavg") or host.get("loadavg") or host.get("loadavg_end")
            or (data.get("load_start") or {}).get("loadavg"))
    if isinstance(load, list) and load:
        parts.append("load average " + " / ".join(f"{x:.1f}" for x in load))
    return " · ".join(parts)


def targets_table(targets: dict[str, Any]) -> list[str]:
    rows = ["| target | value | bound | pass |", "|---|---|---|---|"]
    for name, target in targets.items():
        if isinstance(target, dict) and "value" in target:
            value, bound, ok = target["value"], target.get("bound"), target.get("pass")
        else:
            value, bound, ok = target, None, target if isinstance(target, bool) else None
        rows.append(f"| {fmt(name)} | {fmt(value)} | {fmt(bound)} | {fmt(ok)} |")
    return rows


def scalars(data: dict[str, Any]) -> list[str]:
    """Top-level scalar fields (and short lists of numbers) as a two-column table."""
    rows = []
    for key, value in data.items():
        if key in SKIP_FIELDS:
            continue
        short_list = isinstance(value, list) and 0 < len(value) <= 8 and all(
            isinstance(v, (int, float, str, bool)) for v in value)
        if isinstance(value, (int, float, str, bool)) or short_list:
            rows.append(f"| `{key}` | {fmt(value)} |")
    return ["| field | value |", "|---|---|", *rows] if rows else []


def cell(value: Any) -> Any:
    """A record's field as a cell value: a scalar, or the mean of a statistics dict; None when neither."""
    if isinstance(value, dict) and "mean" in value:
        value = value["mean"]
    return value if isinstance(value, (int, float, str, bool)) and not isinstance(value, str) or (
        isinstance(value, str) and len(value) <= 40) else None


def records_table(records: Any, max_columns: int = 12, max_rows: int = 40) -> list[str]:
    """A dict of records or a list of records (dicts) as a table of their scalar fields (statistics as their mean)."""
    if isinstance(records, dict) and records and all(isinstance(v, dict) for v in records.values()):
        items = [(str(k), v) for k, v in records.items()]
    elif isinstance(records, list) and records and all(isinstance(v, dict) for v in records):
        items = [("", v) for v in records]
    else:
        return []
    columns: list[str] = []
    for _, record in items:
        for key, value in record.items():
            if key not in columns and cell(value) is not None:
                columns.append(key)
    columns = columns[:max_columns]
    if not columns:
        return []
    named = any(name for name, _ in items)
    header = (["name"] if named else []) + columns
    rows = ["| " + " | ".join(f"`{c}`" if c != "name" else c for c in header) + " |",
            "|" + "---|" * len(header)]
    for name, record in items[:max_rows]:
        cells = [fmt(cell(record.get(c))) for c in columns]
        rows.append("| " + " | ".join(([fmt(name)] if named else []) + cells) + " |")
    if len(items) > max_rows:
        rows.append(f"\n({len(items) - max_rows} more in the file)")
    return rows


HEADLINE_FIELDS = ("summary", "results", "rows")  # record collections shown as a table (first columns only)


def result_part(path: Path, data: dict[str, Any]) -> list[str]:
    lines = [f"### `docs/{path.name}`", "", f"Measured: {environment(data)}."]
    if "quick" in data:
        lines[-1] += f" `--quick`: {fmt(data['quick'])}."
    if isinstance(data.get("command"), str):
        lines += ["", "Recorded command:", "", "```bash", data["command"], "```"]
    if isinstance(data.get("note"), str):
        lines += ["", f"Note: {fmt(data['note'])}"]
    for plot in sorted(DOCS.glob(f"{path.stem}.png")):
        lines += ["", f"Plot: [`docs/{plot.name}`]({plot.name})"]
    if isinstance(data.get("targets"), dict) and data["targets"]:
        lines += ["", "Targets:", "", *targets_table(data["targets"])]
    table = scalars(data)
    if table:
        lines += ["", "Figures:" if data.get("targets") else "Top-level fields:", "", *table]
    for key in HEADLINE_FIELDS:
        table_rows = records_table(data.get(key))
        if table_rows:
            lines += ["", f"`{key}` (its records' scalar fields, up to 12; a statistic as its mean):", "", *table_rows]
    shown = {"targets", *(k for k in HEADLINE_FIELDS if records_table(data.get(k)))}
    others = [k for k, v in data.items() if isinstance(v, (dict, list)) and k not in shown and
              not any(row.startswith(f"| `{k}` ") for row in table)]
    if others:
        lines += ["", "Also in the file: " + ", ".join(f"`{k}`" for k in others) + "."]
    return lines + [""]


def render() -> str:
    groups: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path in sorted(DOCS.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {"entries": len(data)} if isinstance(data, list) else {"value": data}
        groups.setdefault(script_for(path.stem, data) or path.stem, []).append((path, data))
    lines = [
        "# Benchmarks: what was measured",
        "",
        "<!-- generated by `python benchmarks/benchmarks_md.py` from docs/*.json; do not edit by hand -->",
        "",
        "Every benchmark prints a table and writes JSON (`--out`) and usually a plot; `--quick` finishes in",
        "minutes on 2 cores. Speed figures were taken on a shared 2-core box whose speed drifts between runs;",
        "each result says when and on what it was measured. The prose readings of these results (tables with",
        "their provenance, what was measured when, and what it means) are in",
        "[measurements_notes.md](measurements_notes.md). Every benchmark that writes into docs/ regenerates",
        "this page (`python benchmarks/benchmarks_md.py` does it alone); `tests/test_benchmarks_md.py` fails",
        "when it is stale.",
        "",
        "Contents: " + ", ".join(f"[{name}](#{name})" for name in sorted(groups)) + ".",
        "",
    ]
    for name in sorted(groups):
        lines += [f"## {name}", ""]
        script = BENCH / f"{name}.py"
        if script.is_file():
            doc = docstring(script)
            lines += [first_paragraph(doc) or "(the script has no docstring)", "",
                      f"Script: [`benchmarks/{name}.py`](../benchmarks/{name}.py)."]
            commands = doc_commands(doc)
            if commands:
                lines += ["", "```bash", *commands, "```"]
        else:
            lines.append("Not written by a benchmark script (a record kept by hand).")
        lines.append("")
        for path, data in groups[name]:
            lines += result_part(path, data)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is stale")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is stale: run python benchmarks/benchmarks_md.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
