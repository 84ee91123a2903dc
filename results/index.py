"""Write results/README.md, the index of the committed measurement records results/*.json, so it cannot drift.

First a table of every record: what it measures, whether it is current or superseded (and by which), and the
command, commit and box it came from where the record holds them (a record's own `measures`, `superseded_by`,
`command`, `commit` fields win over the table STATUS below). Then one section per benchmark (sorted by name):
what it measures (the first paragraph of the suite member's module docstring, or the `retired` field of a
record whose harness was retired), the commands that regenerate it, then one part per record: when and on
what it was measured, its targets (value, pass) and its top-level figures. A record of a shape this script
does not know still gets its top-level scalar fields. Prose readings are hand-written in
docs/measurements_notes.md (linked, not copied). Reads only JSON and the scripts' source text (no benchmark is
imported or run); the output is deterministic.

    python results/index.py                 # rewrites results/README.md
    python results/index.py --check         # exit 1 when results/README.md is not what it would write
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
RESULTS = REPO / "results"
BENCH = REPO / "benchmarks"
OUT = RESULTS / "README.md"
SKIP_FIELDS = {"benchmark", "command", "quick", "note", "commit", "measures", "superseded_by", "retired"}

# What each record measures and whether a later one replaced it, where the record does not say so itself
# (fields `measures`, `superseded_by`). A record not named here is current and measures what its benchmark's
# docstring says.
STATUS: dict[str, dict[str, str]] = {
    "compression": {"measures": "int8 / fp8 / top-k payloads with plain error feedback (the planner reads its "
                                "loss ratios)"},
    "compression_2026": {"measures": "top-k with error feedback as outer momentum, 3 seeds (the planner reads it)"},
    "compression_2026_4clusters": {"measures": "compression_2026's schemes at 4 clusters"},
    "compression_2026_muon": {"measures": "compression_2026's schemes with Muon inner steps"},
    "compression_2026_screen": {"measures": "the screen of error-feedback decay x outer lr (ef_momentum_grid)"},
    "compression_2026_shipped": {"measures": "compression_2026's schemes with the shipped AdamW inner step"},
    "convergence": {"measures": "val loss vs tokens per algorithm, 3 seeds (the planner's kappa fit)"},
    "convergence_2026": {"measures": "issue 51's outer-loop options on convergence's grid"},
    "convergence_small": {"measures": "the tuned points confirmed on model=small"},
    "convergence_tuned": {"measures": "each algorithm tuned on the same budget (the grid)"},
    "false_positives_cap1": {"measures": "the verified rule at max_token_ratio=1 on own-task sites (the last stop's "
                                         "stand-in for equal weights)", "superseded_by": "false_positives"},
    "heterogeneity_same_box": {"measures": "A-EDiT at equal wall time against an earlier commit's code, on this box "
                                           "(issue 51; its harness retired)"},
    "moe_sync_quick": {"measures": "moe_sync's --quick run", "superseded_by": "moe_sync"},
    "penalty_faults": {"measures": "the verified rule against one faulty cluster, full grid (6 kinds x 2-4 "
                                   "clusters x 3 seeds)"},
    "penalty_faults_960": {"measures": "penalty_faults' sign_flip / garbage_data on a 960-step run"},
    "penalty_faults_960_n3": {"measures": "penalty_faults_960 with 3 clusters"},
    "penalty_faults_long": {"measures": "penalty_faults' sign_flip / garbage_data at 480 steps, seed 0"},
    "plan_validation_before_compile": {"measures": "the first full plan validation, the planner before "
                                                   "compile-aware profiles", "superseded_by": "plan_validation"},
    "plan_validation_first": {"measures": "the planner before issue 42 on plan_validation's runs"},
    "redesign_check": {"measures": "the default test suite's count and time before and after the re-cut"},
}
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


def retired_group(stem: str, data: dict[str, Any]) -> str | None:
    """The retired harness a record came from (its `retired.harness` field)."""
    retired = data.get("retired")
    if isinstance(retired, dict) and isinstance(retired.get("harness"), str):
        return Path(retired["harness"]).stem
    return None


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


def status(stem: str, data: dict[str, Any]) -> dict[str, str]:
    """What a record measures and what superseded it: its own fields, else STATUS, else its harness's line."""
    out = dict(STATUS.get(stem, {}))
    for key in ("measures", "superseded_by"):
        if isinstance(data.get(key), str):
            out[key] = data[key]
    return out


def command_of(data: dict[str, Any]) -> str | None:
    retired = data.get("retired") if isinstance(data.get("retired"), dict) else {}
    command = data.get("command") or retired.get("command")
    return " ".join(command) if isinstance(command, list) else command if isinstance(command, str) else None


def commit_of(data: dict[str, Any]) -> str | None:
    for holder in (data, data.get("env"), data.get("environment"), data.get("retired")):
        if isinstance(holder, dict) and isinstance(holder.get("commit"), str):
            return holder["commit"]
    return None


def records_index(records: list[tuple[Path, dict[str, Any], str]]) -> list[str]:
    """The table of every record: measures, current or superseded by which, command, commit, box."""
    rows = ["| record | measures | status | command | commit | box |", "|---|---|---|---|---|---|"]
    for path, data, group in records:
        st = status(path.stem, data)
        measures = st.get("measures") or summary_line(group, data)
        later = st.get("superseded_by")
        state = f"superseded by [`{later}.json`](#{anchor(later + '.json')})" if later else "current"
        command = command_of(data)
        rows.append(f"| [`{path.name}`](#{anchor(path.name)}) | {fmt(measures)} | {state} | "
                    f"{'`' + fmt(command) + '`' if command else '—'} | {fmt(commit_of(data))} | "
                    f"{fmt(environment(data))} |")
    return rows


def anchor(name: str) -> str:
    """The GitHub anchor of a record's heading (`### name`)."""
    return re.sub(r"[^\w\- ]", "", name.lower()).replace(" ", "-")


def suite_purposes() -> dict[str, str]:
    """The suite's one-line purposes (`SUITE` in benchmarks/__main__.py), read from the source, not imported."""
    entry = BENCH / "__main__.py"
    if not entry.is_file():
        return {}
    for node in ast.parse(entry.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "SUITE" and node.value is not None:
            return ast.literal_eval(node.value)
    return {}


def summary_line(group: str, data: dict[str, Any] | None = None) -> str:
    """What a benchmark measures in one line: the suite's purpose, a retired harness's, or its docstring's."""
    purpose = suite_purposes().get(group)
    retired = (data or {}).get("retired")
    if purpose:
        return purpose
    if isinstance(retired, dict) and isinstance(retired.get("purpose"), str):
        return retired["purpose"]
    script = BENCH / f"{group}.py"
    if not script.is_file():
        return "a record kept by hand"
    line = first_paragraph(docstring(script))
    return line.split(". ")[0].rstrip(".") if line else group


def result_part(path: Path, data: dict[str, Any]) -> list[str]:
    lines = [f"### {path.name}", "", f"Measured: {environment(data)}."]
    st = status(path.stem, data)
    if st.get("superseded_by"):
        lines[-1] += f" Superseded by [`{st['superseded_by']}.json`](#{anchor(st['superseded_by'] + '.json')})."
    if commit_of(data):
        lines[-1] += f" Commit {commit_of(data)}."
    if "quick" in data:
        lines[-1] += f" `--quick`: {fmt(data['quick'])}."
    if command_of(data):
        lines += ["", "Recorded command:", "", "```bash", command_of(data) or "", "```"]
    retired = data.get("retired") if isinstance(data.get("retired"), dict) else None
    if retired:
        lines += ["", f"Its harness `{retired.get('harness')}` was retired ({retired.get('when', '')}); its "
                  f"source: `git show {retired.get('last_commit')}:{retired.get('harness')}`."]
    if isinstance(data.get("note"), str):
        lines += ["", f"Note: {fmt(data['note'])}"]
    for plot in sorted(RESULTS.glob(f"{path.stem}.png")):
        lines += ["", f"Plot: [`{plot.name}`]({plot.name})"]
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
    records: list[tuple[Path, dict[str, Any], str]] = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {"entries": len(data)} if isinstance(data, list) else {"value": data}
        group = script_for(path.stem, data) or retired_group(path.stem, data) or path.stem
        groups.setdefault(group, []).append((path, data))
        records.append((path, data, group))
    lines = [
        "# Results: the committed measurement records",
        "",
        "<!-- generated by `python results/index.py` from results/*.json; do not edit by hand -->",
        "",
        "Every record here was written by a member of the benchmark suite (`python -m benchmarks --list`), with",
        "its plot beside it. Speed figures were taken on a shared 2-core box whose speed drifts between runs;",
        "each record says when and on what it was measured. The prose readings of these results (tables with",
        "their provenance, what was measured when, and what it means) are in",
        "[measurements_notes.md](../docs/measurements_notes.md). A benchmark that writes into results/",
        "regenerates this page (`python results/index.py` does it alone); a test fails when it is stale.",
        "",
        "## Records",
        "",
        *records_index(records),
        "",
        "Benchmarks: " + ", ".join(f"[{name}](#{name})" for name in sorted(groups)) + ".",
        "",
    ]
    for name in sorted(groups):
        lines += [f"## {name}", ""]
        script = BENCH / f"{name}.py"
        retired = next((d["retired"] for _, d in groups[name] if isinstance(d.get("retired"), dict)), None)
        if retired and not script.is_file():
            lines.append(f"{retired.get('purpose', '')} Retired from the suite ({retired.get('when', '')}); "
                         f"the record keeps the command that made it.")
        elif script.is_file():
            doc = docstring(script)
            lines += [first_paragraph(doc) or "(the script has no docstring)", "",
                      f"Suite member: `python -m benchmarks {name}` ([`benchmarks/{name}.py`](../benchmarks/{name}.py))."]
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
    parser.add_argument("--check", action="store_true", help="exit 1 if results/README.md is stale")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is stale: run python results/index.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
