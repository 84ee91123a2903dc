"""The shape of the code: no import cycle among the modules of edit_train/, a thin LocalSGD, a core that imports
no model, data, Hydra or W&B code, a codec below the network, the sync sequence written once; sizes are
reported, not limited. Read from the sources (ast), so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "edit_train"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every edit_train module `name` imports: at the top, inside functions and under TYPE_CHECKING alike."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                found.add(t)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["edit_train.train.trainer"], "the import graph is empty: the parser is broken"
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_core_imports_no_model_data_train_cli_hydra_or_wandb() -> None:
    modules = _modules()
    banned = ("edit_train.model", "edit_train.data", "edit_train.train", "edit_train.cli", "edit_train.federation",
              "edit_train.codec")
    for name, path in modules.items():
        if not name.startswith("edit_train.local_sgd"):
            continue
        deps = _imports(name, path, modules)
        assert not [d for d in deps if d.startswith(banned)], (name, deps)
        text = path.read_text()
        assert "import hydra" not in text and "import wandb" not in text and "omegaconf" not in text, name


def test_the_codec_is_tensor_math_below_the_network() -> None:
    """edit_train/codec/ (the compression codec) imports from edit_train only itself and the core's errors (a
    refused payload is a survivable FederationError), and no torch.distributed: moving payloads over process
    groups is federation/compressed_reduce.py's. Its __init__ imports nothing, so the planner's import of the
    torch-free codec/sparse_format.py stays torch-free."""
    modules = _modules()
    codec = {name: path for name, path in modules.items() if name.split(".")[:2] == ["edit_train", "codec"]}
    assert "edit_train.codec.dense" in codec and "edit_train.codec.sparse" in codec, sorted(codec)
    allowed = set(codec) | {"edit_train.local_sgd.errors"}
    for name, path in codec.items():
        deps = _imports(name, path, modules)
        assert deps <= allowed, (name, sorted(deps - allowed))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            assert not [n for n in names if n.startswith("torch.distributed")], (name, names)
            if name in ("edit_train.codec.sparse_format", "edit_train.codec.compiled"):  # the planner reads them
                assert not [n for n in names if n.split(".")[0] in ("torch", "numba")], (name, names)
    init = ast.parse(codec["edit_train.codec"].read_text())
    assert not [n for n in ast.walk(init) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_size_report() -> None:
    """Sizes are a report, not a rule (modules are cut by concept, not by count): the largest modules and
    functions are printed (`pytest -s -k size_report`) for whoever wants to look."""
    modules = sorted(((len(p.read_text().splitlines()), str(p.relative_to(PKG.parent))) for p in PKG.rglob("*.py")),
                     reverse=True)
    functions = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(PKG.parent)}:{node.name}"))  # type: ignore[operator]
    functions.sort(reverse=True)
    print("\nlargest modules:", *(f"  {n:4d} {m}" for n, m in modules[:10]), sep="\n")
    print("largest functions:", *(f"  {n:4d} {f}" for n, f in functions[:10]), sep="\n")
    tree = ast.parse((PKG / "local_sgd" / "sync" / "algorithms.py").read_text())  # the driver's wiring: what the loop calls
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LocalSGD")
    print(f"LocalSGD: {cls.end_lineno - cls.lineno + 1} lines (the sync itself is round.py's)")  # type: ignore[operator]
    assert modules and functions


def test_the_sync_sequence_exists_once() -> None:
    """clip → outer step → re-base is written in one place (round.SyncRound.apply); the re-base in one
    function (round.rebase) that healing uses too."""
    steps = [p for p in (PKG / "local_sgd").rglob("*.py") if ".outer.step(" in p.read_text()]
    assert [p.name for p in steps] == ["round.py"]
    assert "rebase(" in (PKG / "local_sgd" / "sync" / "healing.py").read_text()
    for path in PKG.rglob("*.py"):
        top = [n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]
        assert path.name == "round.py" or "rebase" not in top, path


SYNC_POINT_OWNERS = {"sync_index": "membership.py", "total_steps": "pacer.py", "stopped": "pacer.py",
                     "finishing": "pacer.py"}


def _attribute_writes(tree: ast.AST) -> list[tuple[str, int]]:
    """(attribute, line) of every `x.attr = ...`, `x.attr += ...`, `a = x.attr = ...` and tuple target."""
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store):
                    out.append((leaf.attr, leaf.lineno))
    return out


def test_sync_point_state_has_one_writer() -> None:
    """Only `Membership` writes `sync_index` (the anchor version a cluster holds); only `Pacer` writes
    `total_steps` and the stop flags (`stopped`, `finishing`) — everyone else calls their named methods."""
    assert ("sync_index", 3) in _attribute_writes(ast.parse("x = 1\n\na.b, m.sync_index = 1, 2"))
    writes = []
    for path in PKG.rglob("*.py"):
        for attr, line in _attribute_writes(ast.parse(path.read_text())):
            if attr in SYNC_POINT_OWNERS and path.relative_to(PKG).as_posix() != f"local_sgd/sync/{SYNC_POINT_OWNERS[attr]}":
                writes.append(f"{path.relative_to(PKG.parent)}:{line} writes .{attr}")
    assert not writes, writes


def test_the_loop_knows_one_simulation_seam() -> None:
    """Injected faults and simulated slowness reach the training loop through one seam (sim/hooks.py, `StepHooks`,
    built from the config by sim/build.py): the trainer imports no other sim module and the algorithm's builder
    none, the seam imports no edit_train module, sim imports nothing of train, and `train_step` / `run` call each
    seam point once and name no fault, injector or slowdown."""
    modules = _modules()

    def deps(name: str) -> set[str]:
        return _imports(name, modules[name], modules)

    assert {d for d in deps("edit_train.train.trainer") if d.startswith("edit_train.sim")} == {"edit_train.sim.build"}
    assert not [d for d in deps("edit_train.train.build") if d.startswith("edit_train.sim")]
    assert not deps("edit_train.sim.hooks")
    for name in modules:
        if name.startswith("edit_train.sim"):
            assert not [d for d in deps(name) if d.startswith("edit_train.train")], name
    tree = ast.parse(modules["edit_train.train.trainer"].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    loop = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in ("train_step", "run")]
    assert len(loop) == 2
    banned = {"faults", "faulty", "slowdown", "maybe_kill", "partition_at", "partition", "lr_scale", "corrupt_batch",
              "corrupt_grads", "payload_fault", "claim_fault", "byzantine"}
    calls = []
    for fn in loop:
        for node in ast.walk(fn):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            assert name not in banned, f"Trainer.{fn.name} names {name!r}: a simulation detail outside the seam"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "sim":
                calls.append(node.attr)
    assert sorted(calls) == ["after_step", "batch", "before_step", "grads", "lr"], calls
