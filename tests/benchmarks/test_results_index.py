"""results/README.md is generated from results/*.json by results/index.py: regenerating it must give exactly
the committed page, so the index cannot drift from the records; every record has its row and its section."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
while not (REPO / "pyproject.toml").is_file() and REPO != REPO.parent:  # wherever tests/ puts this file
    REPO = REPO.parent


def _generator():
    spec = importlib.util.spec_from_file_location("results_index", REPO / "results" / "index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_index_is_what_the_generator_writes():
    gen = _generator()
    assert gen.render() == (REPO / "results" / "README.md").read_text(), \
        "results/README.md is stale: run python results/index.py"


def test_every_record_has_its_row_and_section_and_docs_holds_none():
    page = (REPO / "results" / "README.md").read_text()
    records = sorted((REPO / "results").glob("*.json"))
    assert records, "no record in results/"
    for path in records:
        assert f"\n### {path.name}\n" in page, path.name
        assert f"| [`{path.name}`](#" in page, path.name
    assert not list((REPO / "docs").glob("*.json")), "a record in docs/: records live in results/"


def test_status_superseded_and_retired(tmp_path, monkeypatch):
    gen = _generator()
    monkeypatch.setattr(gen, "RESULTS", tmp_path)
    (tmp_path / "old.json").write_text(json.dumps({"superseded_by": "new", "measures": "the old way", "x": 1}))
    (tmp_path / "new.json").write_text(json.dumps({"commit": "abc1234", "command": "python -m benchmarks new"}))
    (tmp_path / "gone.json").write_text(json.dumps({"retired": {
        "harness": "benchmarks/gone.py", "purpose": "What gone measured.", "when": "issue 70",
        "last_commit": "b95b879", "command": "python benchmarks/gone.py --reuse"}}))
    page = gen.render()
    assert "| [`old.json`](#oldjson) | the old way | superseded by [`new.json`](#newjson) |" in page
    assert "| `python -m benchmarks new` | abc1234 |" in page
    assert "`git show b95b879:benchmarks/gone.py`" in page and "python benchmarks/gone.py --reuse" in page
    assert "\n## gone\n\nWhat gone measured. Retired from the suite (issue 70)" in page


def test_targets_and_unknown_shapes():
    gen = _generator()
    rows = gen.targets_table({"a <= 1": {"value": 0.5, "bound": 1, "pass": True}, "flag": False, "name": "x|y"})
    assert rows[2:] == ["| a <= 1 | 0.5 | 1 | yes |", "| flag | no | — | no |", "| name | x\\|y | — | — |"]
    table = gen.scalars({"benchmark": "b", "wall_s": 12.5, "n": 3, "nested": {"x": 1}, "tags": ["a", "b"]})
    assert table[2:] == ["| `wall_s` | 12.5 |", "| `n` | 3 |", "| `tags` | a, b |"]
    assert gen.doc_commands("Text.\n\n    python benchmarks/x.py --a \\\n        --b    # note\n") == [
        "python benchmarks/x.py --a --b    # note"]
