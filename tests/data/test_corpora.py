"""Issue 39 (3, 4): Parquet and pre-tokenized corpora as `data.source` (files the tests write), each user error one
line; `edit-train-prepare` streams in pieces on a process pool, resumes where a stopped run left off, and gives
the same dataset either way; Hub names get the offline line."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_train
from edit_train.data import ByteTokenizer, DataError, TokenDataset, prepare_corpus
from test_data import DOCS, build_wordlevel, split_docs

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install -e '.[dev]')")
pq = pytest.importorskip("pyarrow.parquet")


def tokens_of(data_dir: Path, split: str) -> np.ndarray:
    ds = TokenDataset(data_dir, split)
    return ds.get(0, ds.tokens)


def write_parquet(root: Path, docs: list[str], column: str = "text", row_group_size: int = 3) -> Path:
    """Two Parquet files (datasets' layout: several row groups, other columns beside the text)."""
    root.mkdir(parents=True, exist_ok=True)
    half = len(docs) // 2
    for i, part in enumerate((docs[:half], docs[half:])):
        table = pa.table({"id": list(range(len(part))), column: part})
        pq.write_table(table, root / f"train-{i:05d}-of-00002.parquet", row_group_size=row_group_size)
    return root


# ------------------------------------------------------------------------------------------------- Parquet
def test_parquet_source_holds_every_row_once(tmp_path):
    src = write_parquet(tmp_path / "pq", DOCS * 3, column="body")
    meta = prepare_corpus(str(src), tmp_path / "ds", val_fraction=0.25, text_column="body", progress=False)
    got = []
    for split in ("train", "val"):
        got += [ByteTokenizer().decode(d) for d in split_docs(tokens_of(tmp_path / "ds", split), 256)]
        assert meta["splits"][split]["documents"] >= 1
    assert sorted(got) == sorted(DOCS * 3) and meta["text_column"] == "body"
    # the same rows through a glob, and cut into smaller pieces: the same dataset
    again = prepare_corpus(str(src / "*.parquet"), tmp_path / "ds2", val_fraction=0.25, text_column="body",
                           progress=False)
    assert again["splits"] == meta["splits"]


@pytest.mark.parametrize("case", ["no_column", "not_strings", "not_parquet", "no_pyarrow"])
def test_parquet_errors_are_one_line(tmp_path, monkeypatch, case):
    src = write_parquet(tmp_path / "pq", DOCS)
    column, want = "text", []
    if case == "no_column":
        column, want = "content", ["train-00000-of-00002.parquet", "no column 'content'", "columns: id, text",
                                   "data.text_column"]
    elif case == "not_strings":
        column, want = "id", ["column 'id' holds int64", "data.text_column"]
    elif case == "not_parquet":
        (src / "train-00001-of-00002.parquet").write_bytes(b"not parquet at all")
        want = ["train-00001-of-00002.parquet", "not a readable Parquet file"]
    else:
        monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
        want = ["pip install 'edit-train[parquet]'"]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError) as info:
        prepare_corpus(str(src), out / "ds", text_column=column, progress=False)
    assert "\n" not in str(info.value) and all(w in str(info.value) for w in want), str(info.value)
    assert list(out.iterdir()) == []  # nothing half-written


# ---------------------------------------------------------------------------------------------- pre-tokenized
def test_token_files_are_used_in_place(tmp_path):
    tok = build_wordlevel(tmp_path / "tok.json", 1000)
    rng = np.random.default_rng(0)
    nano = tmp_path / "nano"
    nano.mkdir()
    train, val = rng.integers(0, 1000, 5000).astype("<u2"), rng.integers(0, 1000, 700).astype("<u2")
    train.tofile(nano / "train.bin")
    val.tofile(nano / "val.bin")
    (nano / "meta.pkl").write_bytes(b"never read")  # nanoGPT keeps its vocabulary here; we do not unpickle
    meta = prepare_corpus(str(nano), tmp_path / "ds", tokenizer=str(tok), token_dtype="uint16", progress=False)
    assert meta["format"] == "tokens" and meta["dtype"] == "uint16" and meta["max_token_id"] == int(train.max())
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["meta.json"]  # nothing copied
    assert tokens_of(tmp_path / "ds", "train").tolist() == train.tolist()
    assert tokens_of(tmp_path / "ds", "val").tolist() == val.tolist()

    # one stream (uint32, two files): the last val_fraction of it is held out, across the file boundary
    stream = rng.integers(0, 1000, 3000).astype("<u4")
    one = tmp_path / "one"
    one.mkdir()
    stream[:2900].tofile(one / "a.bin")
    stream[2900:].tofile(one / "b.bin")
    meta = prepare_corpus(str(one), tmp_path / "ds2", tokenizer=str(tok), token_dtype="uint32", val_fraction=0.05,
                          progress=False)
    assert meta["splits"]["val"]["tokens"] == 150 and len(meta["splits"]["val"]["files"]) == 2
    assert np.concatenate([tokens_of(tmp_path / "ds2", s) for s in ("train", "val")]).tolist() == stream.tolist()


@pytest.mark.parametrize("case", ["bad_dtype", "uint16_too_small", "ragged", "id_outside_vocab"])
def test_token_file_errors_are_one_line(tmp_path, case):
    tok = build_wordlevel(tmp_path / "tok.json", 1000)
    path = tmp_path / "tokens.bin"
    np.arange(100, dtype="<u2").tofile(path)
    dtype = "uint16"
    if case == "bad_dtype":
        dtype, want = "int8", ["data.token_dtype='int8'", "uint16 or uint32"]
    elif case == "uint16_too_small":
        tok = build_wordlevel(tmp_path / "big.json", 70_000)
        want = ["uint16 cannot hold", "70000 ids"]
    elif case == "ragged":
        dtype, want = "uint32", ["tokens.bin: 202 bytes is not a whole number of uint32", "data.token_dtype"]
        path.write_bytes(b"\0" * 202)
    else:
        arr = np.arange(100, dtype="<u2")
        arr[42] = 1000
        arr.tofile(path)
        want = ["tokens.bin: token 42 is id 1000, outside the vocabulary", "(1000 ids)", "data.token_dtype"]
    with pytest.raises(DataError) as info:
        prepare_corpus(str(path), tmp_path / "ds", tokenizer=str(tok), token_dtype=dtype, progress=False)
    assert "\n" not in str(info.value) and all(w in str(info.value) for w in want), str(info.value)
    assert not (tmp_path / "ds").exists()


# -------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("kind", ["parquet", "tokens"])
def test_parquet_and_token_sources_train(tmp_path, small_corpus, torch_one_thread, kind):
    texts = [Path(p).read_text() for p in sorted(glob.glob(small_corpus))]
    extra = []
    if kind == "parquet":
        source = write_parquet(tmp_path / "pq", texts, column="content", row_group_size=4)
        extra = ["data.text_column=content"]
    else:
        source = tmp_path / "tokens.bin"
        ids = np.concatenate([np.frombuffer((t + "\0").encode(), np.uint8) for t in texts]).astype("<u2")
        ids.tofile(source)  # the byte tokenizer's ids, as an external pipeline would have written them
        extra = ["data.token_dtype=uint16"]
    summary = run_train(["algo=ddp", "cluster=local", "model=tiny", "train.steps=2", "logger=none",
                         "train.progress=false", "train.eval_every=0", "train.eval_batches=1", "train.seq_len=32",
                         "train.batch_size=2", "checkpoint.at_end=false", f"data.source={source}",
                         f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}", *extra])
    assert summary["completed"] and summary["steps"] == 2 and np.isfinite(summary["final_val_loss"])


# ---------------------------------------------------------------------------------------- streaming, resuming
def _corpus(tmp_path: Path) -> Path:
    rng = np.random.default_rng(1)
    lines = [json.dumps({"text": " ".join(f"w{int(x)}" for x in rng.integers(0, 99, 40)) + f" doc{i}"})
             for i in range(400)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _dataset_bytes(d: Path) -> dict[str, bytes]:
    meta = json.loads((d / "meta.json").read_text())
    return {s: b"".join((d / f).read_bytes() for f in meta["splits"][s]["files"]) for s in ("train", "val")}


def test_a_stopped_preparation_resumes(tmp_path, monkeypatch):
    """Stopped after two pieces (Ctrl-C), the next run does only the rest, and the dataset is the one an
    uninterrupted run writes."""
    import edit_train.data.corpus as corpus
    import edit_train.data.tokenize as tokenize

    src = _corpus(tmp_path)
    monkeypatch.setattr(corpus, "PIECE_BYTES", 16_000)
    whole = prepare_corpus(str(src), tmp_path / "whole", val_fraction=0.1, workers=1, progress=False)
    real, done = tokenize.tokenize_piece, []

    def stop_after_two(job):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(job["index"])
        return real(job)

    monkeypatch.setattr(tokenize, "tokenize_piece", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(str(src), tmp_path / "ds", val_fraction=0.1, workers=1, progress=False)
    assert not (tmp_path / "ds").exists() and len(list((tmp_path / "ds.partial").glob("p0*.json"))) == 2
    monkeypatch.setattr(tokenize, "tokenize_piece", real)
    from edit_train.data import prepare_with_stats

    meta, stats = prepare_with_stats(str(src), tmp_path / "ds", val_fraction=0.1, workers=1, progress=False)
    assert stats.resumed == 2 and stats.pieces > 4 and not (tmp_path / "ds.partial").exists()
    assert meta["splits"] == whole["splits"] and _dataset_bytes(tmp_path / "ds") == _dataset_bytes(tmp_path / "whole")
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())


def test_a_process_pool_writes_the_same_dataset(tmp_path, monkeypatch, capsys):
    """Two worker processes (spawned) and one process give byte-identical datasets; the CLI reports tokens/s."""
    import edit_train.data.corpus as corpus
    import edit_train.data.tokenize as tokenize
    from edit_train.cli.prepare import main

    src = _corpus(tmp_path)
    monkeypatch.setattr(corpus, "PIECE_BYTES", 40_000)
    monkeypatch.setattr(tokenize, "POOL_MIN_BYTES", 0)
    prepare_corpus(str(src), tmp_path / "one", workers=1, progress=False)
    assert main([str(src), "--out", str(tmp_path / "two"), "--workers", "2", "--quiet"]) == 0
    line = capsys.readouterr().out
    assert "tokens/s on 2 processes" in line, line
    assert _dataset_bytes(tmp_path / "one") == _dataset_bytes(tmp_path / "two")


# ------------------------------------------------------------------------------------------------ Hub names
def test_hub_names_get_the_offline_line(tmp_path, monkeypatch):
    from edit_train.cli.checks import check_init_from
    from edit_train.config import ConfigError
    from edit_train.model import CausalLM, load_preset
    from edit_train.model.hf_io import load_hf_into

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"data.tokenizer=inclusionAI/Ling-lite looks like a Hugging Face Hub name, "
                                        r"but edit-train works offline.*data.tokenizer=DIR/tokenizer.json$"):
        prepare_corpus(str(_corpus(tmp_path)), tmp_path / "ds", tokenizer="inclusionAI/Ling-lite", progress=False)
    with pytest.raises(ValueError, match=r"model.init_from=inclusionAI/Ling-lite .*works offline.*--local-dir DIR"):
        load_hf_into(CausalLM(load_preset("tiny")), "inclusionAI/Ling-lite")
    with pytest.raises(ConfigError, match="works offline"):
        check_init_from("inclusionAI/Ling-lite")
    with pytest.raises(ConfigError, match="not a directory"):
        check_init_from("no/such/dir.d")
