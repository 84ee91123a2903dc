"""The benchmark suite: one entry point (`python -m benchmarks NAME`, `--list`) over the shared runner; every
member in the table is a file and every file a member; each member's arguments parse through the entry point;
a record written through the runner carries its command, commit and box."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
while not (REPO / "pyproject.toml").is_file() and REPO != REPO.parent:  # wherever tests/ puts this file
    REPO = REPO.parent
BENCH = REPO / "benchmarks"


def _load(name: str, path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


SUITE = _load("benchmarks_suite", BENCH / "__main__.py")


def test_the_table_is_the_folder() -> None:
    assert set(SUITE.SUITE) == SUITE.members_on_disk()
    assert all(0 < len(purpose) <= 110 and "\n" not in purpose for purpose in SUITE.SUITE.values())


def test_list_names_every_member_with_its_purpose() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == sorted(SUITE.SUITE)
    assert all(SUITE.SUITE[line.split()[0]] in line for line in lines)


def test_an_unknown_member_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert SUITE.main(["nope"]) == 2
    assert capsys.readouterr().err.strip() == "benchmarks: no member 'nope' (python -m benchmarks --list names them)"


@pytest.mark.parametrize("name", sorted(SUITE.SUITE))
def test_every_member_parses_its_arguments_through_the_entry_point(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = SUITE.run(name, ["--help"])
    assert rc == 0 and buf.getvalue().startswith("usage:"), buf.getvalue()[:400]


def test_a_record_carries_its_command_commit_and_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("BENCH_MEMBER", "plan_scale")
    monkeypatch.setattr(sys, "argv", ["plan_scale.py", "--quick"])
    common = importlib.import_module("_common")
    path = common.write_json(tmp_path / "r.json", {"x": 1.5, "command": "kept"})
    record = json.loads(path.read_text())
    assert record["x"] == 1.5 and record["command"] == "kept"  # what a record says is kept
    assert record["box"].endswith(" CPUs") and (record["commit"] is None or len(record["commit"]) >= 7)
    record = json.loads(common.write_json(tmp_path / "s.json", {"x": 2}).read_text())
    assert record["command"] == "python -m benchmarks plan_scale --quick"




def _logging_state() -> dict[str, tuple[int, bool, bool, list[logging.Handler]]]:
    """Every logger's level, propagation, disabled flag and handlers (the root as "")."""
    names = ["", *logging.root.manager.loggerDict]
    return {n: (lg.level, lg.propagate, lg.disabled, list(lg.handlers))
            for n in names if isinstance(lg := logging.getLogger(n), logging.Logger)}


def _restore_logging(state: dict[str, tuple[int, bool, bool, list[logging.Handler]]]) -> None:
    logging.disable(logging.NOTSET)
    for n in ["", *logging.root.manager.loggerDict]:
        lg = logging.getLogger(n)
        if not isinstance(lg, logging.Logger):
            continue
        level, propagate, disabled, handlers = state.get(n, (logging.NOTSET, True, False, []))
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled
        for h in list(lg.handlers):
            if h not in handlers:
                lg.removeHandler(h)
        for h in handlers:
            if h not in lg.handlers:
                lg.addHandler(h)


def test_every_member_runs_with_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m benchmarks NAME --smoke` for every member, in this process (one interpreter start-up, one torch
    import): each exits 0 and writes only under its smoke folder (results/ untouched); the time each took is
    printed."""
    import time

    import torch

    records = {p.name: p.stat().st_mtime_ns for p in (REPO / "results").iterdir()}
    logs = _logging_state()  # a member's in-process edit-train job configures logging: later tests read caplog
    monkeypatch.setenv("RUST_LOG", "warn")  # torchft's Lighthouse (loop_overhead's bare side) logs every quorum
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    failed, times = [], {}
    t0 = time.perf_counter()
    try:
        for name in sorted(SUITE.SUITE):
            monkeypatch.setenv("BENCH_SMOKE_DIR", str(tmp_path / name))
            monkeypatch.setattr(sys, "path", list(sys.path))
            monkeypatch.setattr(sys, "argv", list(sys.argv))
            buf = io.StringIO()
            t = time.perf_counter()
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                rc = SUITE.run(name, ["--smoke"])
            times[name] = round(time.perf_counter() - t, 2)
            if rc != 0:
                failed.append(f"{name} (exit {rc}): {buf.getvalue()[-600:]}")
    finally:
        torch.set_num_threads(threads)
        _restore_logging(logs)
    total = time.perf_counter() - t0
    assert not failed, failed
    assert all(any((tmp_path / name).iterdir()) for name in SUITE.SUITE), "a member's smoke wrote nothing"
    assert {p.name: p.stat().st_mtime_ns for p in (REPO / "results").iterdir()} == records  # results/ untouched
    print(f"suite smoke: {total:.1f} s, slowest {sorted(times.items(), key=lambda kv: -kv[1])[:5]}")
    # timings are measured, not asserted (ground rules): 26.9 s for the 27 members on 2 busy cores (issue 70)
