"""Per-site data (issue 41): a cluster's own corpus, the standard library split by family (the non-IID
setting), the shared validation every cluster evaluates on, and the tokenizer every cluster must share."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from edit_train.config import ConfigError, cluster_specs, validate
from edit_train.data import DataError, ensure_dataset, eval_batches, tokenizer_id
from edit_train.data import families as fam
from edit_train.data.corpus import plan_pieces, planned_sides
from edit_train.local_sgd.errors import FederationError, FederationRefused
from edit_train.local_sgd.aggregation.claims import Terms, vet
from edit_train.local_sgd.protocols import Member, Quorum
from edit_train.train.build import fingerprint
from edit_train.train.site_data import check_tokenizers, site_data


def _cfg(*overrides: str):
    from edit_train.cli.common import compose

    return compose(["logger=none", *overrides])


def _wordlevel(path: Path, words: int) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return str(path)


# --------------------------------------------------------------------------------------- the family split
def _universe() -> list[str]:
    """Every *.py of the standard library but site-packages / __pycache__, relative to its root."""
    root = fam.stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        out += [(Path(dirpath) / f).relative_to(root).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(out)


def test_families_are_disjoint_and_cover_the_standard_library() -> None:
    root = fam.stdlib_root()
    keys = {name: [p.relative_to(root).as_posix() for p in fam.family_files(f"stdlib:{name}")] for name in fam.NAMES}
    seen = [k for ks in keys.values() for k in ks]
    assert len(seen) == len(set(seen)) and sorted(seen) == _universe()
    assert all(keys.values()), {n: len(k) for n, k in keys.items()}
    assert [p.relative_to(root).as_posix() for p in fam.family_files("stdlib:all")] == _universe()
    for name, ks in keys.items():  # each file is in the family its top-level package says
        listed = set(fam.FAMILIES[name])
        for k in ks:
            top = k.split("/", 1)[0] if "/" in k else k.removesuffix(".py")
            assert (top in listed) if listed else all(top not in v for v in fam.FAMILIES.values()), (name, k)
    assert "email/parser.py" in keys["net"] and "asyncio/tasks.py" in keys["systems"]
    assert "unittest/case.py" in keys["dev"] and "collections/__init__.py" in keys["core"]


@pytest.mark.parametrize("clusters", sorted(fam.GROUPS))
def test_each_cluster_count_splits_the_families_once(clusters: int) -> None:
    groups = fam.GROUPS[clusters]
    assert len(groups) == clusters and sorted(f for g in groups for f in g) == sorted(fam.NAMES)
    assert fam.group_sources(clusters) == [fam.source_of(g) for g in groups]


def test_every_family_holds_the_convergence_benchmarks_longest_run() -> None:
    """Tokens of the byte tokenizer = bytes: every family (so every group) holds more than a cluster reads in the
    convergence benchmark's longest setting (tuned: 1000 steps x 8 sequences x 128 tokens, tiny and small alike)
    after 2 % of it goes to validation, so no cluster sees its data twice."""
    need = 1000 * 8 * 128
    for name in fam.NAMES:
        size = sum(p.stat().st_size for p in fam.family_files(f"stdlib:{name}"))
        assert size * 0.97 > need, (name, size)


def test_a_document_is_on_the_same_side_in_every_source_that_holds_it() -> None:
    def val_keys(source: str) -> set[str]:
        pieces = [dataclasses.asdict(p) for p in plan_pieces(source)[0]]  # what edit-train-prepare splits by
        return {key for key, side in planned_sides(source, pieces, 0.02, 0).items() if side == "val"}

    per_family = {name: val_keys(f"stdlib:{name}") for name in fam.NAMES}
    assert all(per_family.values())
    assert val_keys("stdlib:net+systems") == per_family["net"] | per_family["systems"]
    assert val_keys("stdlib:all") == set().union(*per_family.values())


def test_preparing_a_family_source_writes_its_planned_val_documents(tmp_path: Path) -> None:
    """The pool's pieces follow the planned split: with the byte tokenizer the val split holds exactly the planned
    val files' bytes, one end-of-document id after each (the per-document hash alone would pick other files)."""
    source = "stdlib:net"
    pieces = [dataclasses.asdict(p) for p in plan_pieces(source)[0]]
    sides = planned_sides(source, pieces, 0.02, 0)
    paths = {k: p for piece in pieces for p, k in zip(piece["paths"], piece["keys"])}
    val = [k for k, side in sides.items() if side == "val"]
    meta = json.loads((ensure_dataset(source, cache_dir=tmp_path, progress=False, workers=1) / "meta.json").read_text())
    assert meta["splits"]["val"]["documents"] == len(val)
    assert meta["splits"]["val"]["tokens"] == sum(os.path.getsize(paths[k]) + 1 for k in val)


def test_an_unknown_family_is_one_line() -> None:
    with pytest.raises(DataError, match=r"unknown standard-library family \['web'\].*net, systems, dev, core"):
        fam.parse_source("stdlib:net+web")
    with pytest.raises(ConfigError, match="defined for 2, 3, 4 clusters, this run has 5"):
        validate(_cfg("data.split=by_family", "cluster=local", "cluster.count=5"))
    with pytest.raises(ConfigError, match="data.source"):
        validate(_cfg("data.split=by_family", "data.source=/x/*.txt"))


# ------------------------------------------------------------------------------------ which data a cluster reads
def test_by_family_gives_each_cluster_its_families_and_everyone_the_same_validation() -> None:
    for clusters in (2, 4):
        cfg = _cfg(f"experiment=noniid_{clusters}")
        validate(cfg)
        specs = cluster_specs(cfg)
        sites = [site_data(cfg, specs, s) for s in specs]
        assert [s.source for s in sites] == fam.group_sources(clusters)
        assert all((s.part, s.parts) == (0, 1) for s in sites)
        assert {s.val_sources for s in sites} == {tuple(f"stdlib:{f}" for f in fam.NAMES)}


def test_the_default_splits_one_corpus_across_the_clusters() -> None:
    cfg = _cfg("cluster=local", "cluster.count=3")
    specs = cluster_specs(cfg)
    sites = [site_data(cfg, specs, s) for s in specs]
    assert [(s.source, s.part, s.parts) for s in sites] == [("stdlib", i, 3) for i in range(3)]
    assert {s.val_sources for s in sites} == {("stdlib",)}


def test_a_cluster_may_train_on_its_own_data() -> None:
    cfg = _cfg("cluster=local", "cluster.clusters=[{name: a, data: {source: 'stdlib:net'}}, {name: b}, {name: c}]")
    validate(cfg)
    specs = cluster_specs(cfg)
    sites = {s.name: site_data(cfg, specs, s) for s in specs}
    assert (sites["a"].source, sites["a"].part, sites["a"].parts) == ("stdlib:net", 0, 1)
    assert [(sites[n].source, sites[n].part, sites[n].parts) for n in "bc"] == [("stdlib", 0, 2), ("stdlib", 1, 2)]
    assert sites["a"].val_sources == sites["b"].val_sources == ("stdlib",)  # the federation's data
    with pytest.raises(ConfigError, match=r"cluster.clusters\[0\].data: must be a mapping of source, tokenizer"):
        cluster_specs(_cfg("cluster.clusters=[{name: a, data: {path: x}}]"))


def test_the_shared_validation_is_every_source_window_by_window(tmp_path: Path) -> None:
    dirs = []
    for i, letter in enumerate("ab"):  # two corpora of one repeated byte each: a row's content says its corpus
        (tmp_path / letter).mkdir()
        (tmp_path / letter / "doc.txt").write_text(letter * (3000 + 1000 * i))
        dirs.append(ensure_dataset(str(tmp_path / letter / "doc.txt"), cache_dir=tmp_path / "cache", progress=False,
                                   val_fraction=0.5))
    one = eval_batches(dirs[0], 4, 32, 3)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(one, eval_batches([dirs[0]], 4, 32, 3)))
    rows = torch.cat([x for x, _ in eval_batches(dirs, 4, 32, 30)])
    firsts = [chr(int(r[0])) for r in rows]
    assert len(rows) == 46 + 62  # a holds 46 windows of val, b 62: in turn while both last, then b's
    assert firsts == ["a", "b"] * 46 + ["b"] * 16


# ----------------------------------------------------------------------------------------- one tokenizer
def test_a_cluster_with_another_tokenizer_is_refused_in_one_line(tmp_path: Path) -> None:
    tok = _wordlevel(tmp_path / "tok.json", 40)
    copy = tmp_path / "elsewhere.json"
    copy.write_bytes(Path(tok).read_bytes())
    cfg = _cfg(f"data.tokenizer={tok}", f"cluster.clusters=[{{name: a}}, {{name: b, data: {{tokenizer: '{copy}'}}}}]")
    check_tokenizers(cfg, cluster_specs(cfg))  # another path, the same content: agrees
    cfg = _cfg(f"cluster.clusters=[{{name: a}}, {{name: b, data: {{tokenizer: '{tok}'}}}}]")
    with pytest.raises(ConfigError) as err:
        check_tokenizers(cfg, cluster_specs(cfg))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("cluster.clusters[1].data.tokenizer: cluster b tokenizes with hf-")
    assert tokenizer_id(tok) in msg and "the federation with byte" in msg


def test_edit_train_refuses_a_local_run_whose_tokenizers_differ(tmp_path: Path, monkeypatch, capsys) -> None:
    from edit_train.cli.train import main

    tok = _wordlevel(tmp_path / "tok.json", 40)
    monkeypatch.setattr(sys, "argv", ["edit-train", *tiny_overrides(tmp_path / "run"),
                                      f"cluster.clusters=[{{name: a}}, {{name: b, data: {{tokenizer: '{tok}'}}}}]"])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "cluster b tokenizes with hf-" in err, err
    assert not (tmp_path / "run").exists()


def test_across_hosts_the_cluster_with_another_tokenizer_refuses_itself(tmp_path: Path) -> None:
    """Three clusters meet; one tokenizes differently (its fingerprint carries its tokenizer): it stops with a
    line naming both tokenizers, the two others are admitted."""
    cfg = _cfg()
    tok = _wordlevel(tmp_path / "tok.json", 40)
    fps = [fingerprint(cfg), fingerprint(cfg), fingerprint(cfg, tok)]
    assert fps[0] == fingerprint(cfg, "byte") != fps[2]
    q = [Member(f"c{i}", 3, 1, "", {"fp": f, "local_steps": 8}) for i, f in enumerate(fps)]
    for me in (0, 1):
        kept, why = vet(Quorum(1, "q", q, me), Terms(fps[me]))
        assert kept.names == ["c0", "c1"] and "tokenizer: hf-" in why["c2"], why
    with pytest.raises(FederationRefused) as err:
        vet(Quorum(1, "q", q, 2), Terms(fps[2]))
    assert isinstance(err.value, FederationError)
    assert f"tokenizer: {tokenizer_id(tok)} here, byte in the federation" in str(err.value), str(err.value)
    assert f"tokenizer: {tokenizer_id(tok)} here, byte in the federation" in str(err.value), str(err.value)
