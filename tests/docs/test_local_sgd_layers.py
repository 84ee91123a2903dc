"""edit_train/local_sgd/ in layers by concern, imports pointing down only: the root modules (the seams and
shared measurements) < moe/ (experts) < aggregation/ (the rules and their evidence) < sync/ (the sync sequence)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "edit_train" / "local_sgd"
ORDER = ["", "moe", "aggregation", "sync"]  # "" = edit_train/local_sgd/*.py


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["edit_train", "local_sgd"]:
        return None
    return parts[2] if len(parts) > 3 and parts[2] in ORDER else ""


def test_local_sgd_imports_point_down_only() -> None:
    upward = []
    for path in sorted(PKG.rglob("*.py")):
        here = "" if path.parent == PKG else path.parent.name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] if _layer(node.module) != "" or node.module.count(".") > 1 else [
                    f"{node.module}.{a.name}" for a in node.names]
                for name in names:
                    there = _layer(name)
                    if there is not None and ORDER.index(there) > ORDER.index(here):
                        upward.append(f"{path.relative_to(PKG)} imports {name}")
    assert upward == [], upward


def test_every_local_sgd_module_is_in_a_layer() -> None:
    assert {p.parent.name for p in PKG.rglob("*.py") if p.parent != PKG} <= set(ORDER)
