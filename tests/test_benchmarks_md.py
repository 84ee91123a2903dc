"""docs/benchmarks.md is generated from docs/*.json by benchmarks/benchmarks_md.py: regenerating it must give
exactly the committed page, so the measurements page cannot drift from the results."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("benchmarks_md", REPO / "benchmarks" / "benchmarks_md.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_benchmarks_page_is_what_the_generator_writes():
    gen = _generator()
    assert gen.render() == (REPO / "docs" / "benchmarks.md").read_text(), \
        "docs/benchmarks.md is stale: run python benchmarks/benchmarks_md.py"


def test_every_result_file_has_its_section():
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for path in sorted((REPO / "docs").glob("*.json")):
        assert f"### `docs/{path.name}`" in page, path.name


def test_targets_and_unknown_shapes():
    gen = _generator()
    rows = gen.targets_table({"a <= 1": {"value": 0.5, "bound": 1, "pass": True}, "flag": False, "name": "x|y"})
    assert rows[2:] == ["| a <= 1 | 0.5 | 1 | yes |", "| flag | no | — | no |", "| name | x\\|y | — | — |"]
    table = gen.scalars({"benchmark": "b", "wall_s": 12.5, "n": 3, "nested": {"x": 1}, "tags": ["a", "b"]})
    assert table[2:] == ["| `wall_s` | 12.5 |", "| `n` | 3 |", "| `tags` | a, b |"]
    assert gen.doc_commands("Text.\n\n    python benchmarks/x.py --a \\\n        --b    # note\n") == [
        "python benchmarks/x.py --a --b    # note"]
