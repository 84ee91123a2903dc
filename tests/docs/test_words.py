"""One word per concept (issue 38, docs/glossary.md): no retired synonym for a cluster in a config key (the
schema and every shipped config file), an event field, `summary.json` or the README; retired keys are read as
their successor with one warning line on the command line and refused with a hint in a config file."""

from __future__ import annotations

import ast
import dataclasses
import io
import logging
import re
import tokenize
import typing
from pathlib import Path

import pytest
import yaml

from edit_train.cli.common import compose, one_line
from edit_train.config import Config
from edit_train.config_tree import CONF_DIR
from edit_train.retired import RENAMED, renamed_overrides, retired_hint
from edit_train.sim.faults import parse_faults
from edit_train.sim.hetero import parse_schedule
from words import RETIRED, retired_keys

ROOT = Path(__file__).resolve().parents[2]


def _keys(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        out += _keys(t, f"{prefix}{f.name}.") if dataclasses.is_dataclass(t) else [prefix + f.name]
    return out


def test_no_config_key_uses_a_retired_word() -> None:
    keys = _keys(Config)
    assert "cluster.count" in keys and "cluster.ranks" in keys and len(keys) > 100
    bad = [k for k in keys if any(RETIRED.match(part) for part in k.split("."))]
    assert bad == ["data.workers"], bad  # tokenizer processes, not clusters (docs/glossary.md, kept on purpose)


def test_no_shipped_config_file_uses_a_retired_word() -> None:
    files = sorted(Path(CONF_DIR).rglob("*.yaml"))
    assert len(files) > 20
    found = {str(f.relative_to(CONF_DIR)): retired_keys(yaml.safe_load(f.read_text()) or {}) for f in files}
    assert {f: k for f, k in found.items() if k} == {}


def test_the_readme_uses_no_retired_key_or_field() -> None:
    text = (ROOT / "README.md").read_text()
    names = set(re.findall(r"`([A-Za-z_][\w.]*)(?:=[^`]*)?`", text))  # `cluster.count=2`, `per_cluster`, …
    assert {"cluster.count", "quorum"} & names or "cluster.count" in text
    bad = sorted(n for n in names if any(RETIRED.match(part) for part in n.split(".")) and n != "data.workers")
    assert bad == []
    for word in ("cluster.groups", "cluster.shard_size", "per_group", "cross_group_bytes", "participants"):
        assert word not in text, word


def test_a_retired_key_on_the_command_line_is_read_as_its_successor_with_one_line(capsys) -> None:
    assert renamed_overrides(["cluster.groups=3", "+cluster.shard_size=2", "train.steps=5"]) == \
        ["cluster.count=3", "+cluster.ranks=2", "train.steps=5"]
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: cluster.groups is deprecated: read as cluster.count (docs/glossary.md); use cluster.count=3",
                   "warning: cluster.shard_size is deprecated: read as cluster.ranks (docs/glossary.md); "
                   "use cluster.ranks=2"]
    cfg = compose(["cluster.groups=3", "cluster.slowdown=[]"])
    assert cfg.cluster.count == 3 and cfg.cluster.ranks == 1
    assert set(RENAMED) == {"cluster.groups", "cluster.shard_size"}


def test_a_retired_key_in_a_config_file_is_refused_with_a_hint() -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    from edit_train.config import ClusterConfig

    schema = OmegaConf.structured(ClusterConfig)
    with pytest.raises(ConfigKeyError) as exc:
        OmegaConf.merge(OmegaConf.create({"cluster": schema}), OmegaConf.create({"cluster": {"groups": 2}}))
    assert one_line(exc.value) == retired_hint("cluster.groups") == \
        "cluster.groups was retired: use cluster.count"


def test_a_fault_or_slowdown_entry_with_group_is_read_as_cluster_with_one_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        faults = parse_faults([{"kind": "kill", "group": 1, "start": 6}, {"kind": "nan_grad", "group": 0, "start": 2}])
        changes = parse_schedule([{"group": 1, "step": 10, "factor": 2.0}], 2)
    assert [f.group for f in faults] == [1, 0] and changes[0].group == 1
    said = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(said) <= 2 and all("`group` is deprecated: read as `cluster`" in m for m in said)


#: inside the core and the federation a cluster is a cluster: not a participant or a worker (docs/glossary.md)
CODE_RETIRED = re.compile(r"(?i)(?<![A-Za-z])(participants?|workers?)(?![A-Za-z])")


def _words_in_code(text: str) -> list[tuple[int, str]]:
    """(line, text) of every name this source defines (functions, classes, arguments, assigned names and
    attributes), every docstring and every comment."""
    found: list[tuple[int, str]] = []
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.lineno, node.name))
        if isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.append((node.lineno, node.id))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.append((node.lineno, node.attr))
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((getattr(node, "lineno", 1), doc))
    found += [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
              if tok.type == tokenize.COMMENT]
    return found


def _unquoted(text: str) -> str:
    """Without "quoted" names: another program's (torchft's wire fields, `"participants"`)."""
    return re.sub(r'"[^"\n]*"', "", text)


def test_the_core_and_the_federation_say_cluster() -> None:
    """The identifiers, docstrings and comments of local_sgd/ and federation/ use no retired word for a cluster
    (torchft's own field names, read as strings, are theirs)."""
    probe = _words_in_code("def f(worker_id: int) -> None:\n    \"\"\"A participant.\"\"\"\n    x = 1  # a worker\n")
    assert {t for _, t in probe if CODE_RETIRED.search(t)} == {"worker_id", "A participant.", "# a worker"}
    bad = []
    for package in ("local_sgd", "federation"):
        for path in sorted((ROOT / "edit_train" / package).glob("*.py")):
            bad += [f"{path.relative_to(ROOT)}:{line}: {CODE_RETIRED.search(_unquoted(t)).group(0)}"  # type: ignore[union-attr]
                    for line, t in _words_in_code(path.read_text()) if CODE_RETIRED.search(_unquoted(t))]
    assert bad == [], bad


def test_algo_penalty_is_read_as_algo_rule_on_the_command_line_and_refused_in_a_file(capsys) -> None:
    """Issue 50: the rule's config is `algo.rule` and the rule it picks `algo.rule.name`; the old keys are read
    as those with one warning line each on the command line, refused with a hint in a config file, and an old
    key retired outright (issue 36) keeps its own hint."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    from edit_train.config import AlgoConfig

    assert renamed_overrides(["algo.penalty.rule=uniform", "+algo.penalty.options.x=1", "algo.penalty.anomaly=true"]) \
        == ["algo.rule.name=uniform", "+algo.rule.options.x=1", "algo.penalty.anomaly=true"]
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: algo.penalty.rule is deprecated: read as algo.rule.name (docs/glossary.md); "
                   "use algo.rule.name=uniform",
                   "warning: algo.penalty.options.x is deprecated: read as algo.rule.options.x (docs/glossary.md); "
                   "use algo.rule.options.x=1"]
    cfg = compose(["algo=edit", "algo.penalty.rule=uniform", "algo.penalty.clip=false"])
    assert cfg.algo.rule.name == "uniform" and cfg.algo.rule.clip is False
    assert \
        "algo.rule.verified.anomaly" in str(retired_hint("algo.penalty.anomaly"))
    schema = OmegaConf.structured(AlgoConfig)
    with pytest.raises(ConfigKeyError) as exc:
        OmegaConf.merge(OmegaConf.create({"algo": schema}), OmegaConf.create({"algo": {"penalty": {"rule": "uniform"}}}))
    assert one_line(exc.value) == retired_hint("algo.penalty") == "algo.penalty was retired: use algo.rule"


def test_a_run_dir_written_before_algo_rule_reads_its_rule() -> None:
    from edit_train.retired import current_rule_name

    assert current_rule_name({"algo": {"penalty": {"rule": "uniform"}}}) == "uniform"
    assert current_rule_name({"algo": {"rule": {"name": "edit_norm"}}}) == "edit_norm"
    assert current_rule_name({}) == "verified"
