"""The configuration reference (docs/configuration.md, linked from the README) is checked against the structured
configs, so it cannot drift; the README's own commands and snippet are run as written."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from edit_train.config import CheckpointConfig, Config, RunConfig, SyncConfig, TrainConfig

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
CONFIGURATION = (REPO / "docs" / "configuration.md").read_text()  # the full key reference, moved out of the README


def _table_keys(page: str = CONFIGURATION, heading: str = "Reference") -> list[str]:
    section = page.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    keys = []
    for line in section.splitlines():
        if line.startswith("| `"):
            keys += re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)*)`", line.split("|")[1])
    return keys


def _exists(key: str) -> bool:
    cls: object = Config
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return False
        default = fields[part].default_factory() if callable(fields[part].default_factory) else None
        cls = type(default) if dataclasses.is_dataclass(default) else None
    return True


def test_every_documented_key_exists() -> None:
    keys = _table_keys()
    assert len(keys) > 30
    for key in keys:
        assert _exists(key), f"docs/configuration.md documents {key}, which is not in edit_train/config.py"
    assert not _exists("train.no_such_key")


def test_every_user_facing_field_is_documented() -> None:
    documented = set(_table_keys())
    for prefix, cls in (("train", TrainConfig), ("checkpoint", CheckpointConfig), ("run", RunConfig),
                        ("sync", SyncConfig)):
        for f in dataclasses.fields(cls):
            assert f"{prefix}.{f.name}" in documented, f"{prefix}.{f.name} missing from docs/configuration.md's table"
    for top in ("resume", "faults", "seed", "logger"):
        assert top in documented


def test_readme_links_to_the_reference() -> None:
    """The README is a guide (at most 300 lines): its short table of the most used keys names real keys, and it
    links to the full reference."""
    assert "](docs/configuration.md)" in README and len(README.splitlines()) <= 300
    keys = _table_keys(README, "Configure")
    assert len(keys) >= 8
    for key in keys:
        assert _exists(key), f"the README's Configure table names {key}, which is not in edit_train/config.py"


def test_quick_start_and_test_command() -> None:
    assert "pip install -e '.[dev]'" in README and "\nedit-train " in README
    ci = (REPO / ".ci" / "run").read_text()
    cmd = re.search(r"Tests \(the exact command CI runs.*?```bash\n(.+?)\n```", README, re.S).group(1).strip()
    assert cmd in ci.splitlines()


# ------------------------------------------------------------------ the README's export and report commands
def _readme_commands(*programs: str) -> list[str]:
    """Every line of the README's ```bash blocks that runs one of `programs` (a trailing `# comment` cut)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line.split(" ", 1)[0] in programs:
                lines.append(line)
    return lines


def _stage(cwd: Path, commands: list[str], sweep: Path) -> dict[str, Path]:
    """Make every `runs/...` path the commands name exist under `cwd`: a `runs/multirun-*` folder is a sweep
    folder (Hydra's multirun.yaml, its jobs linked to the real sweep's), any other `runs/NAME` a run directory
    (linked to the sweep's jobs in turn). Returns {README path: what it stands for}."""
    import shlex

    runs = [sweep / "0", sweep / "1"]
    staged: dict[str, Path] = {}
    literal_sweeps = [a for c in commands for a in shlex.split(c)
                      if re.fullmatch(r"runs/multirun-[^*?/\[]+/?", a)]
    for name in {a.rstrip("/") for a in literal_sweeps} or {"runs/multirun-20261123-200000"}:
        folder = cwd / name
        folder.mkdir(parents=True)
        (folder / "multirun.yaml").write_text((sweep / "multirun.yaml").read_text())
        for job in runs:
            (folder / job.name).symlink_to(job)
        staged[name] = sweep
    for c in commands:
        for a in shlex.split(c):
            if a.startswith("runs/") and not any(ch in a for ch in "*?[") and a.rstrip("/") not in staged:
                target = runs[len([p for p in staged.values() if p in runs]) % len(runs)]
                (cwd / a).parent.mkdir(parents=True, exist_ok=True)
                (cwd / a.rstrip("/")).symlink_to(target)
                staged[a.rstrip("/")] = target
    return staged


def _bin_dir(tmp: Path) -> Path:
    """edit-train-export / edit-train-report as the console scripts (or `python -m` where not installed)."""
    import shlex

    from conftest import script_cmd

    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for prog, module in (("edit-train-export", "edit_train.cli.export"), ("edit-train-report", "edit_train.cli.report")):
        script = bin_dir / prog
        script.write_text(f"#!/bin/sh\nexec {shlex.join(script_cmd(prog, module))} \"$@\"\n")
        script.chmod(0o755)
    return bin_dir


def test_readme_export_and_sweep_report_commands_run(tmp_path, tmp_path_factory, small_corpus):
    """The README's `edit-train-export` and `edit-train-report` lines, run verbatim by the shell in a
    directory whose `runs/…` are a real two-cluster sweep (tests/report/test_export_report.py::tiny_sweep): the
    export of a run directory and the sweep reports (a sweep folder, and the `runs/multirun-*/*` glob that
    also matches multirun.yaml) must work as written."""
    import os
    import shlex
    import subprocess

    from conftest import cli_env
    from test_export_report import tiny_sweep

    exports = _readme_commands("edit-train-export")
    reports = _readme_commands("edit-train-report")
    assert any(re.fullmatch(r"runs/\d{8}-\d{6}", shlex.split(c)[1]) for c in exports), \
        f"the README shows no export of a run directory: {exports}"
    assert any("runs/multirun-*/*" in c for c in reports), f"no sweep report in the README: {reports}"
    sweep = tiny_sweep(tmp_path_factory, small_corpus)
    cwd = tmp_path / "work"
    cwd.mkdir()
    _stage(cwd, exports + reports, sweep)
    env = cli_env(PATH=f"{_bin_dir(tmp_path)}{os.pathsep}{os.environ.get('PATH', '')}")
    for command in exports + reports:
        proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"README command failed: {command}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        args = shlex.split(command)
        if args[0] == "edit-train-export":
            out = cwd / (args[args.index("--out") + 1] if "--out" in args else Path(args[1]) / "hf")
            assert proc.stdout.startswith("exported ") and len(proc.stdout.splitlines()) == 1, proc.stdout
            assert "clusters c0, c1" in proc.stdout, proc.stdout
            for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
                assert (out / name).is_file(), (command, name)
        else:
            report_line = proc.stdout.strip().splitlines()[-1]
            out = Path(re.match(r"report: (.+?) \(", report_line).group(1))
            assert (cwd / out / "summary.md").is_file(), (command, proc.stdout)
            if "*" in command:
                assert "multirun.yaml: not a run directory" in proc.stderr, proc.stderr
                assert proc.stdout.count("| edit |") == 2, proc.stdout


def test_readme_transformers_snippet_runs(tmp_path, tmp_path_factory, small_corpus):
    """The README's "load it in transformers" block, run verbatim by a fresh Python in a directory whose `hf/demo`
    is the export of a real two-cluster run, exactly as the README's export command writes it."""
    import os
    import shlex
    import subprocess
    import sys

    import pytest

    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")
    from conftest import cli_env
    from edit_train.cli.export import main
    from test_export_report import tiny_sweep

    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "trust_remote_code=True" in b]
    assert len(blocks) == 1, "the README shows one transformers loading snippet"
    assert "`trust_remote_code=True` lets `transformers` run Python files shipped in the model folder" in README
    (export,) = [c for c in _readme_commands("edit-train-export") if "--out hf/demo" in c]
    cwd = tmp_path / "work"
    cwd.mkdir()
    args = shlex.split(export)[2:]
    args[args.index("--out") + 1] = str(cwd / args[args.index("--out") + 1])  # relative to where the snippet runs
    main([str(tiny_sweep(tmp_path_factory, small_corpus) / "0"), *args])
    proc = subprocess.run([sys.executable, "-c", blocks[0]], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=cli_env(HF_HUB_OFFLINE="1", PYTHONPATH=os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("def main():") and "[y/N]" not in proc.stdout, proc.stdout


# ------------------------------------------------------------------ links
LINKED_PAGES = ("README.md", "launchers/README.md", "docs/configuration.md", "docs/across_sites.md",
                "docs/outputs.md", "docs/algorithms.md", "docs/measurements_notes.md", "results/README.md")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_relative_links_resolve():
    """Every relative link of the README and the pages split out of it names a file that exists, and an
    anchor that one of its headings makes."""
    for name in LINKED_PAGES:
        page = REPO / name
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{name} links to {target}, which does not exist"
            assert REPO in linked.parents or linked == REPO, f"{name} links outside the repository: {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in _anchors(linked), f"{name} links to {target}: no such heading"
