"""The four-language non-IID setting (issue 54): python / C headers / Perl / man pages, one per cluster, a
shared validation from all four, the federation's one tokenizer, and a language this machine lacks."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import pytest

from edit_train.config import ConfigError, cluster_specs, validate
from edit_train.data import DataError, ensure_dataset, read_meta
from edit_train.data import languages as lang
from edit_train.data.corpus import plan_pieces, planned_sides
from edit_train.local_sgd.aggregation.claims import Terms, vet
from edit_train.local_sgd.errors import FederationRefused
from edit_train.local_sgd.protocols import Member, Quorum
from edit_train.train.build import fingerprint, own_tokenizer
from edit_train.train.site_data import check_tokenizers, site_data


def _cfg(*overrides: str):
    from edit_train.cli.common import compose

    return compose(["logger=none", *overrides])


@pytest.fixture
def fake_roots(tmp_path: Path, monkeypatch) -> dict[str, Path]:
    """Four small language roots: 30 documents each, the man pages gzipped."""
    roots = {n: tmp_path / "roots" / n for n in lang.NAMES}
    for i in range(30):
        for name, rel, text in (("python", f"pkg/m{i}.py", f"def f{i}(x):\n    return x + {i}\n" * 40),
                                ("c", f"sys/h{i}.h", f"#define X{i} {i}\nint f{i}(void);\n" * 40),
                                ("perl", f"Mod/P{i}.pm", f"package P{i};\nsub f {{ return {i}; }}\n1;\n" * 40)):
            (roots[name] / rel).parent.mkdir(parents=True, exist_ok=True)
            (roots[name] / rel).write_text(text)
        page = roots["man"] / "man1" / f"t{i}.1.gz"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_bytes(gzip.compress((f".TH T{i} 1\n.SH NAME\nt{i} \\- does a thing\n" * 40).encode()))
    (roots["man"] / "de" / "man1").mkdir(parents=True)  # a translation: not the English pages
    (roots["man"] / "de" / "man1" / "t.1.gz").write_bytes(gzip.compress(b".TH T 1\nDeutsch\n"))
    (roots["c"] / "notes.txt").write_text("not a header")
    monkeypatch.setenv("EDIT_TRAIN_LANG_ROOTS", ",".join(f"{n}={p}" for n, p in roots.items()))
    return roots


def test_each_language_is_its_files_and_all_is_the_four(fake_roots: dict[str, Path]) -> None:
    files = {n: lang.source_files(f"lang:{n}") for n in lang.NAMES}
    assert all(len(fs) == 30 for fs in files.values())
    assert all(p.name.endswith(".gz") and "/de/" not in p.as_posix() for p in files["man"])
    assert lang.source_files("lang:all") == sorted(p for fs in files.values() for p in fs)
    assert [lang.language_of(lang.key_of(fs[0])) for fs in files.values()] == list(lang.NAMES)
    with pytest.raises(DataError, match=r"unknown language 'cobol'"):
        lang.parse_source("lang:cobol")


def test_a_language_keeps_its_budget_in_hash_order(fake_roots: dict[str, Path], monkeypatch) -> None:
    monkeypatch.setattr(lang, "BUDGET", 5000)
    kept = lang.language_files("python")
    sizes = [p.stat().st_size for p in kept]
    assert 0 < len(kept) < 30 and sum(sizes[:-1]) < 5000 <= sum(sizes) + 1  # stops once the budget is held
    assert lang.language_files("python") == kept  # deterministic


def test_a_document_is_on_the_same_side_in_its_language_and_in_all(fake_roots: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    def sides(source: str) -> dict[str, str]:
        pieces, _ = plan_pieces(source)
        return planned_sides(source, [p.__dict__ for p in pieces], 0.1, 0)

    every = sides("lang:all")
    for name in lang.NAMES:
        mine = sides(f"lang:{name}")
        assert mine and "val" in mine.values() and all(every[k] == s for k, s in mine.items())
    man = ensure_dataset("lang:man", cache_dir=tmp_path / "cache", progress=False, val_fraction=0.1)
    meta = read_meta(man)  # the gzipped pages are read unzipped: troff text, not gzip bytes
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 30
    assert meta["splits"]["train"]["tokens"] > 30 * 1000


def test_noniid_lang_gives_each_cluster_a_language_and_everyone_all_four(fake_roots: dict[str, Path]) -> None:
    for clusters, expected in ((4, ["lang:python", "lang:c", "lang:perl", "lang:man"]),
                               (2, ["lang:python", "lang:man"])):
        cfg = _cfg(f"experiment=noniid_lang_{clusters}")
        validate(cfg)
        specs = cluster_specs(cfg)
        sites = [site_data(cfg, specs, s) for s in specs]
        assert [s.source for s in sites] == expected and all((s.part, s.parts) == (0, 1) for s in sites)
        assert {s.val_sources for s in sites} == {tuple(f"lang:{n}" for n in lang.NAMES)}
    iid = _cfg("data.source=lang:all", "cluster=local", "cluster.count=2")  # the IID counterpart
    specs = cluster_specs(iid)
    assert [(s.source, s.part, s.parts) for s in (site_data(iid, specs, x) for x in specs)] == \
        [("lang:all", 0, 2), ("lang:all", 1, 2)]
    with pytest.raises(ConfigError, match="data.split=by_language: defined for 2, 3, 4 clusters"):
        validate(_cfg("experiment=noniid_lang_4", "cluster.count=5"))


def test_a_missing_language_is_one_line(fake_roots: dict[str, Path], monkeypatch, tmp_path: Path, caplog) -> None:
    roots = dict(fake_roots, perl=tmp_path / "no_perl_here")
    monkeypatch.setenv("EDIT_TRAIN_LANG_ROOTS", ",".join(f"{n}={p}" for n, p in roots.items()))
    cfg = _cfg("experiment=noniid_lang_4")
    specs = cluster_specs(cfg)
    with caplog.at_level(logging.WARNING):
        python = site_data(cfg, specs, specs[0])  # trains on python: validates on the three it has
    assert python.val_sources == ("lang:python", "lang:c", "lang:man")
    skipped = [r.getMessage() for r in caplog.records if "validation skips" in r.getMessage()]
    assert skipped == [f"validation skips lang:perl: {roots['perl']} does not exist"]
    with pytest.raises(ConfigError) as err:
        site_data(cfg, specs, specs[2])  # trains on perl
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"cluster c2: data lang:perl: {roots['perl']} does not exist; install")


def test_the_federation_agrees_on_one_tokenizer(fake_roots: dict[str, Path], tmp_path: Path) -> None:
    """The language setting tokenizes bytes (the repo trains no BPE): shared trivially, and still checked — a
    cluster whose tokenizer file differs in content (even the byte tokenizer written as a Hugging Face file) is
    refused by the check a local run makes, and across hosts by the configuration fingerprint."""
    from edit_train.data.tokenizer import ByteTokenizer, tokenizer_id

    ByteTokenizer().save_hf(tmp_path / "bytes.json")
    other = str(tmp_path / "bytes.json")
    cfg = _cfg("experiment=noniid_lang_2", f"cluster.clusters=[{{name: c0}}, {{name: c1, data: {{tokenizer: '{other}'}}}}]")
    with pytest.raises(ConfigError, match=r"^cluster.clusters\[1\].data.tokenizer: cluster c1 tokenizes with hf-"):
        check_tokenizers(cfg, cluster_specs(cfg))
    fps = [fingerprint(cfg, own_tokenizer(cfg, n)) for n in ("c0", "c1")]
    assert fps[0] != fps[1] and f"tokenizer={tokenizer_id(other)}" in fps[1]
    q = [Member(n, 3, 1, "", {"fp": f, "local_steps": 8}) for n, f in zip(("c0", "c0b", "c1"), [fps[0]] * 2 + [fps[1]])]
    with pytest.raises(FederationRefused, match=f"tokenizer: {tokenizer_id(other)} here, byte in the federation"):
        vet(Quorum(1, "q", q, 2), Terms(fps[1]))
