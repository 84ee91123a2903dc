"""Tests of edit_train.data: tokenizers, corpus preparation, the memory-mapped resumable loader, the CLI."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from edit_train.cli.prepare import main as prepare_main
from edit_train.data.prepare import META_VERSION
from edit_train.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    TokenDataset,
    TokenLoader,
    default_cache_dir,
    dtype_for_vocab,
    ensure_dataset,
    eval_batches,
    load_tokenizer,
    prepare_corpus,
    read_meta,
    stdlib_files,
    tokenizer_id,
)

DOCS = [
    "def f(x):\n    return x + 1\n",
    "héllo wörld — ünïcode ✓ 日本語\n",
    "The quick brown fox jumps over the lazy dog.\n" * 3,
    "import os\nprint(os.getcwd())\n",
    "line one\nline two\nline three\n",
    "a",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit.\n" * 2,
    "x = [i * i for i in range(10)]\n",
]


def write_corpus(root: Path, docs: list[str], ext: str = ".txt") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (root / f"doc{i:02d}{ext}").write_text(d, encoding="utf-8")
    return root


def all_tokens(data_dir: Path, split: str) -> np.ndarray:
    ds = TokenDataset(data_dir, split)
    return ds.get(0, ds.tokens)


def split_docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    docs, cur = [], []
    for t in tokens.tolist():
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    assert not cur, "every document must end with eos"
    return docs


def lines_corpus(tmp_path: Path, n_docs: int = 40, words: int = 30) -> Path:
    """A corpus whose documents are deterministic and distinct."""
    rng = np.random.default_rng(0)
    docs = [" ".join(f"w{int(x)}" for x in rng.integers(0, 50, size=words)) + f" doc{i}\n" for i in range(n_docs)]
    return write_corpus(tmp_path / "corpus", docs)


def build_wordlevel(path: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "</s>": 1}
    vocab.update({f"w{i}": i + 2 for i in range(vocab_size - 2)})
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


def build_bpe(path: Path) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from tokenizers.decoders import ByteLevel as ByteLevelDecoder
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE(unk_token=None))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = ByteLevelDecoder()
    trainer = BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=ByteLevel.alphabet(),
                         show_progress=False)
    tok.train_from_iterator(DOCS * 4, trainer=trainer)
    tok.save(str(path))
    return path


# ------------------------------------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eos_id == 256
    text = "héllo ✓\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids + [256]) == text
    assert tok.decode([0xFF]) == "\ufffd"
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert tokenizer_id("byte") == "byte"


def test_hf_tokenizer_wraps_file(tmp_path):
    path = build_bpe(tmp_path / "tokenizer.json")
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
    assert tok.vocab_size == tok._tok.get_vocab_size()
    assert tok.decode(tok.encode(DOCS[0]) + [tok.eos_id]) == DOCS[0]
    tid = tokenizer_id(str(path))
    assert tid.startswith("hf-") and len(tid) == 15 and tid == tokenizer_id(str(path))
    assert isinstance(load_tokenizer(str(tmp_path)), HFTokenizer)  # directory holding tokenizer.json


def test_dtype_selection():
    assert dtype_for_vocab(257) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"


# ------------------------------------------------------------------------------------------------ preparation


def test_prepare_roundtrips_text_byte_tokenizer(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", DOCS)
    meta = prepare_corpus(str(corpus), tmp_path / "ds", val_fraction=0.3, shard_tokens=50, progress=False)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257 and meta["eos_id"] == 256
    assert meta["version"] == META_VERSION and meta["tokenizer"] == "byte" and meta["tokenizer_id"] == "byte"
    assert read_meta(tmp_path / "ds") == meta
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    assert tr["documents"] >= 1 and va["documents"] >= 1 and tr["documents"] + va["documents"] == len(DOCS)
    assert len(tr["files"]) > 1 and tr["files"][0] == "train_00000.bin" and va["files"][0] == "val_00000.bin"
    assert all(os.path.getsize(tmp_path / "ds" / f) <= 50 * 2 for f in tr["files"] + va["files"])
    # raw little-endian uint16 on disk
    raw = np.concatenate([np.fromfile(tmp_path / "ds" / f, dtype="<u2") for f in tr["files"]])
    assert raw.tolist() == all_tokens(tmp_path / "ds", "train").tolist()
    assert tr["tokens"] == len(raw)

    tok = ByteTokenizer()
    decoded = {}
    for split in ("train", "val"):
        docs = [tok.decode(d) for d in split_docs(all_tokens(tmp_path / "ds", split), 256)]
        assert docs == [d for d in DOCS if d in docs]  # each split keeps the corpus order
        decoded[split] = docs
    assert sorted(decoded["train"] + decoded["val"]) == sorted(DOCS)
    assert not set(decoded["train"]) & set(decoded["val"])


def test_split_is_deterministic_and_seeded(tmp_path):
    corpus = lines_corpus(tmp_path, n_docs=60)
    a = prepare_corpus(str(corpus), tmp_path / "a", val_fraction=0.2, seed=1, progress=False)
    b = prepare_corpus(str(corpus), tmp_path / "b", val_fraction=0.2, seed=1, progress=False)
    prepare_corpus(str(corpus), tmp_path / "c", val_fraction=0.2, seed=2, progress=False)
    assert a["splits"] == b["splits"]
    assert (all_tokens(tmp_path / "a", "val") == all_tokens(tmp_path / "b", "val")).all()
    assert all_tokens(tmp_path / "a", "val").tolist() != all_tokens(tmp_path / "c", "val").tolist()
    assert 3 <= a["splits"]["val"]["documents"] <= 25


def test_single_document_is_split_by_tokens(tmp_path):
    text = "0123456789" * 20
    (tmp_path / "one.txt").write_text(text)
    meta = prepare_corpus(str(tmp_path / "one.txt"), tmp_path / "ds", val_fraction=0.1, progress=False)
    train, val = all_tokens(tmp_path / "ds", "train"), all_tokens(tmp_path / "ds", "val")
    assert len(val) == round(201 * 0.1) and meta["splits"]["val"]["tokens"] == len(val)
    assert np.concatenate([train, val]).tolist() == list(text.encode()) + [256]


def test_jsonl_source(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)]
    lines.insert(3, "")  # blank lines are skipped
    lines.append(json.dumps({"text": ""}))  # empty documents too
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    meta = prepare_corpus(str(path), tmp_path / "ds", val_fraction=0.25, progress=False)
    got = []
    for split in ("train", "val"):
        got += [ByteTokenizer().decode(d) for d in split_docs(all_tokens(tmp_path / "ds", split), 256)]
    assert sorted(got) == sorted(DOCS)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == len(DOCS)
    # a glob of jsonl files works the same
    meta2 = prepare_corpus(str(tmp_path / "*.jsonl"), tmp_path / "ds2", val_fraction=0.25, progress=False)
    assert meta2["splits"]["train"]["tokens"] + meta2["splits"]["val"]["tokens"] == sum(
        meta["splits"][s]["tokens"] for s in ("train", "val"))


def test_hf_tokenizer_end_to_end(tmp_path):
    tok_path = build_bpe(tmp_path / "tokenizer.json")
    corpus = write_corpus(tmp_path / "corpus", DOCS * 3)
    meta = prepare_corpus(str(corpus), tmp_path / "ds", tokenizer=str(tok_path), val_fraction=0.2, progress=False)
    tok = load_tokenizer(str(tok_path))
    assert meta["tokenizer_id"] == tokenizer_id(str(tok_path)) and meta["eos_id"] == tok.eos_id
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.vocab_size
    decoded = []
    for split in ("train", "val"):
        decoded += [tok.decode(d) for d in split_docs(all_tokens(tmp_path / "ds", split), tok.eos_id)]
    assert sorted(decoded) == sorted(DOCS * 3)
    loader = TokenLoader(tmp_path / "ds", "train", batch_size=2, seq_len=8)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (2, 8) and x.dtype == torch.long and int(x.max()) < tok.vocab_size


def test_uint32_for_large_vocab(tmp_path):
    tok_path = build_wordlevel(tmp_path / "big.json", vocab_size=70_000)
    words = [f"w{i}" for i in (69_990, 3, 65_535, 65_536, 12, 69_997, 40_000)]
    docs = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    corpus = write_corpus(tmp_path / "corpus", docs)
    meta = prepare_corpus(str(corpus), tmp_path / "ds", tokenizer=str(tok_path), val_fraction=0.2, progress=False)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000 and meta["eos_id"] == 1
    tok = load_tokenizer(str(tok_path))
    expected = sorted(tok.encode(d) for d in docs)
    got = []
    for split in ("train", "val"):
        got += split_docs(all_tokens(tmp_path / "ds", split), 1)
    assert sorted(got) == expected and max(max(d) for d in got) == 69_999
    shard = tmp_path / "ds" / meta["splits"]["train"]["files"][0]
    assert shard.stat().st_size == 4 * meta["splits"]["train"]["tokens"]
    x, _ = TokenLoader(tmp_path / "ds", "train", batch_size=1, seq_len=4, shuffle=False).next_batch()
    assert x.dtype == torch.long and int(x.max()) > 65_535


def test_forced_uint32_roundtrip(tmp_path, monkeypatch):
    import edit_train.data.prepare as prep

    monkeypatch.setattr(prep, "dtype_for_vocab", lambda v: "uint32")
    corpus = write_corpus(tmp_path / "corpus", DOCS)
    meta = prepare_corpus(str(corpus), tmp_path / "ds", val_fraction=0.2, progress=False)
    assert meta["dtype"] == "uint32"
    got = [ByteTokenizer().decode(d) for s in ("train", "val") for d in split_docs(all_tokens(tmp_path / "ds", s), 256)]
    assert sorted(got) == sorted(DOCS)


def test_stdlib_listing_and_subset(tmp_path):
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    parts = {p for f in files for p in f.relative_to(root).parts[:-1]}
    assert not parts & {"test", "tests", "idlelib", "lib2to3", "site-packages"}
    assert root / "os.py" in files
    # a small subset of the stdlib, end to end
    meta = prepare_corpus(str(root / "json" / "*.py"), tmp_path / "ds", val_fraction=0.2, progress=False)
    n = len(list((root / "json").glob("*.py")))
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == n
    x, y = TokenLoader(tmp_path / "ds", "train", batch_size=4, seq_len=64).next_batch()
    assert (x[:, 1:] == y[:, :-1]).all()


# ------------------------------------------------------------------------------------------------------ cache


def test_cache_hit_does_not_rewrite(tmp_path, monkeypatch):
    corpus = lines_corpus(tmp_path, n_docs=10)
    out = tmp_path / "ds"
    meta = prepare_corpus(str(corpus), out, progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare_corpus(str(corpus), out, progress=False) == meta
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps

    monkeypatch.setenv("EDIT_TRAIN_CACHE", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    path = ensure_dataset(str(corpus), "byte", progress=False)
    assert path.parent == tmp_path / "cache" / "data" and read_meta(path)["source"] == str(corpus)
    stamp = (path / "meta.json").stat().st_mtime_ns
    assert ensure_dataset(str(corpus), "byte", progress=False) == path
    assert (path / "meta.json").stat().st_mtime_ns == stamp
    other = ensure_dataset(str(corpus), "byte", seed=3, progress=False)
    assert other != path and sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, other.name])
    with pytest.raises(DataError, match="training tokens"):  # min_tokens is checked on cache hits too
        ensure_dataset(str(corpus), "byte", min_tokens=10**9, progress=False)
    assert path.is_dir()
    monkeypatch.delenv("EDIT_TRAIN_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "edit-train"


# ------------------------------------------------------------------------------------------------- bad input


def _jsonl(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "in" / "data.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"\n".join(l.encode() if isinstance(l, str) else l for l in lines) + b"\n")
    return str(path)


def _text_files(tmp_path: Path, files: dict[str, bytes]) -> str:
    root = tmp_path / "in"
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    return str(root)


GOOD = json.dumps({"text": "hello world"})
BAD_CASES = {
    "missing_path": (lambda t: str(t / "in" / "nope.txt"), {}, ["nope.txt", "does not exist"]),
    "glob_no_match": (lambda t: str(t / "in" / "*.md"), {}, ["*.md", "matched no files"]),
    "empty_files": (lambda t: _text_files(t, {"a.txt": b"", "b.txt": b""}), {}, ["contains no text", "in"]),
    "min_tokens": (lambda t: _text_files(t, {"a.txt": b"abc" * 10, "b.txt": b"xyz"}), {"min_tokens": 1000},
                   ["training tokens", "1000", "seq_len"]),
    "non_utf8": (lambda t: _text_files(t, {"a.txt": b"fine\n" * 5, "b.txt": b"ok", "z.txt": b"abc\xffdef"}), {},
                 ["z.txt", "byte offset 3", "UTF-8"]),
    "jsonl_bad_json": (lambda t: _jsonl(t, [GOOD, "{not json", GOOD]), {}, ["data.jsonl:2", "not valid JSON"]),
    "jsonl_no_text": (lambda t: _jsonl(t, [GOOD, GOOD, json.dumps({"body": "x"})]), {}, ["data.jsonl:3", '"text"']),
    "jsonl_text_not_str": (lambda t: _jsonl(t, [json.dumps({"text": 5})]), {}, ["data.jsonl:1", "text"]),
    "jsonl_not_object": (lambda t: _jsonl(t, [GOOD, "[1, 2]"]), {}, ["data.jsonl:2", "JSON object"]),
    "jsonl_non_utf8": (lambda t: _jsonl(t, [GOOD, b'{"text": "\xff"}']), {}, ["data.jsonl:2", "UTF-8"]),
    "missing_tokenizer": (lambda t: _text_files(t, {"a.txt": b"abc"}), {"tokenizer": "TMP/tok_missing.json"},
                          ["tok_missing.json", "does not exist"]),
    "garbage_tokenizer": (lambda t: _text_files(t, {"a.txt": b"abc"}), {"tokenizer": "TMP/garbage.json"},
                          ["garbage.json", "could not be loaded"]),
    "bad_val_fraction": (lambda t: _text_files(t, {"a.txt": b"abc"}), {"val_fraction": 1.5}, ["val_fraction"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_gives_clear_error_and_leaves_nothing(tmp_path, case):
    make_source, kwargs, needles = BAD_CASES[case]
    (tmp_path / "garbage.json").write_bytes(b"\x00this is not a tokenizer{")
    source = make_source(tmp_path)
    kwargs = {k: (v.replace("TMP", str(tmp_path)) if isinstance(v, str) else v) for k, v in kwargs.items()}
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(DataError) as info:
        prepare_corpus(source, out_parent / "ds", progress=False, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert list(out_parent.iterdir()) == []  # no temp dir, no partial dataset


def test_out_dir_that_is_not_a_dataset_is_refused(tmp_path):
    corpus = lines_corpus(tmp_path, n_docs=3)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a prepared dataset"):
        prepare_corpus(str(corpus), tmp_path / "ds", progress=False)
    assert (tmp_path / "ds" / "precious.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()  # an empty directory is fine
    prepare_corpus(str(corpus), tmp_path / "empty", progress=False)
    assert (tmp_path / "empty" / "meta.json").is_file()


def test_corrupt_or_missing_dataset(tmp_path):
    with pytest.raises(DataError, match="meta.json"):
        TokenDataset(tmp_path / "nothing", "train")
    corpus = lines_corpus(tmp_path, n_docs=4)
    prepare_corpus(str(corpus), tmp_path / "ds", progress=False)
    (tmp_path / "ds" / "meta.json").write_text("{broken")
    with pytest.raises(DataError, match=r"ds/meta.json is corrupt"):
        TokenDataset(tmp_path / "ds", "train")
    prepare_corpus(str(corpus), tmp_path / "ds2", progress=False)
    with open(tmp_path / "ds2" / "train_00000.bin", "ab") as fh:
        fh.write(b"\x00\x00")
    with pytest.raises(DataError, match="train_00000.bin|tokens"):
        TokenDataset(tmp_path / "ds2", "train")
    with pytest.raises(DataError, match="unknown split"):
        TokenDataset(tmp_path / "ds", "test")


# ----------------------------------------------------------------------------------------------------- loader


@pytest.fixture
def small_ds(tmp_path) -> Path:
    corpus = lines_corpus(tmp_path, n_docs=30, words=20)
    # tiny shards so that many windows cross shard boundaries
    prepare_corpus(str(corpus), tmp_path / "ds", val_fraction=0.1, shard_tokens=37, progress=False)
    return tmp_path / "ds"


def test_windows_cross_shards_and_labels_shift(small_ds):
    stream = np.concatenate([np.fromfile(small_ds / f, dtype="<u2")
                             for f in read_meta(small_ds)["splits"]["train"]["files"]]).astype(np.int64)
    T = 16
    loader = TokenLoader(small_ds, "train", batch_size=3, seq_len=T, shuffle=False)
    assert loader.num_windows == (len(stream) - 1) // T
    for b in range(loader.batches_per_epoch):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (3, T) and x.dtype == y.dtype == torch.long
        for i in range(3):
            w = b * 3 + i
            assert x[i].tolist() == stream[w * T : w * T + T].tolist()
            assert y[i].tolist() == stream[w * T + 1 : w * T + T + 1].tolist()


def test_parts_are_disjoint_and_cover_all_windows(small_ds):
    B, T = 2, 8
    groups, shard_size = 2, 2
    world = groups * shard_size
    loaders = [TokenLoader(small_ds, "train", B, T, part=g * shard_size + r, num_parts=world, seed=7)
               for g in range(groups) for r in range(shard_size)]
    nw = loaders[0].num_windows
    bpe = loaders[0].batches_per_epoch
    assert all(l.batches_per_epoch == bpe for l in loaders) and bpe == (nw // world) // B
    ds = loaders[0].dataset
    for epoch in range(2):
        seen = []
        for l in loaders:
            windows = l.epoch_windows(epoch)
            assert len(windows) == bpe * B
            for b in range(bpe):  # the batches really are these windows
                x, _ = l.next_batch()
                for i, w in enumerate(windows[b * B : (b + 1) * B]):
                    assert x[i].tolist() == ds.get(int(w) * T, int(w) * T + T).tolist()
            seen.append(set(windows.tolist()))
        for i in range(world):
            for j in range(i + 1, world):
                assert not seen[i] & seen[j]
        union = set().union(*seen)
        assert len(union) == world * bpe * B and union <= set(range(nw))
        assert nw - len(union) < world * B  # only the remainder is left out
    # the full permutation (before dropping the remainder) covers every window exactly once
    full = sorted(w for p in range(world) for w in np.random.default_rng([7, 0]).permutation(nw)[p::world])
    assert full == list(range(nw))
    # epochs are reshuffled
    assert loaders[0].epoch_windows(0).tolist() != loaders[0].epoch_windows(1).tolist()


def test_state_restore_resumes_identically(small_ds):
    def make():
        return TokenLoader(small_ds, "train", batch_size=2, seq_len=8, part=1, num_parts=2, seed=3)

    ref = make()
    bpe = ref.batches_per_epoch
    assert bpe >= 3
    stream = [ref.next_batch() for _ in range(3 * bpe + 2)]
    for k in (0, 1, bpe - 1, bpe, bpe + 1, 2 * bpe):  # includes exactly at and just past an epoch boundary
        a = make()
        for _ in range(k):
            a.next_batch()
        state = json.loads(json.dumps(a.state_dict()))
        b = make()
        b.load_state_dict(state)
        for i in range(k, k + bpe + 1):  # crosses the next epoch boundary
            xb, yb = b.next_batch()
            xa, ya = a.next_batch()
            assert torch.equal(xb, stream[i][0]) and torch.equal(yb, stream[i][1])
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert b.state_dict() == a.state_dict()


def test_state_fingerprint_mismatch(small_ds):
    state = TokenLoader(small_ds, "train", batch_size=2, seq_len=8, num_parts=2).state_dict()
    for kwargs in ({"batch_size": 3, "seq_len": 8, "num_parts": 2}, {"batch_size": 2, "seq_len": 4, "num_parts": 2},
                   {"batch_size": 2, "seq_len": 8, "num_parts": 1}):
        with pytest.raises(DataError, match="does not match"):
            TokenLoader(small_ds, "train", **kwargs).load_state_dict(state)
    with pytest.raises(DataError, match="malformed"):
        TokenLoader(small_ds, "train", 2, 8, num_parts=2).load_state_dict({"epoch": 0})


def test_iter_and_unshuffled_order(small_ds):
    loader = TokenLoader(small_ds, "train", batch_size=2, seq_len=8, shuffle=False)
    it = iter(loader)
    first = [next(it) for _ in range(loader.batches_per_epoch + 1)]
    assert torch.equal(first[0][0], first[-1][0])  # epoch 1 restarts at window 0 when not shuffled
    assert loader.epoch == 1 and loader.cursor == 1


def test_corpus_too_small_for_batch(small_ds):
    with pytest.raises(DataError, match="corpus too small for batch_size × seq_len × world"):
        TokenLoader(small_ds, "train", batch_size=64, seq_len=256, num_parts=4)


def test_eval_batches(small_ds):
    val = TokenDataset(small_ds, "val")
    T = 8
    nw = (val.tokens - 1) // T
    batches = eval_batches(small_ds, batch_size=2, seq_len=T, max_batches=3)
    assert batches and len(batches) <= 3
    for i, (x, y) in enumerate(batches):  # the first windows, in order
        for j in range(x.shape[0]):
            w = i * 2 + j
            assert x[j].tolist() == val.get(w * T, w * T + T).tolist()
            assert (x[j, 1:] == y[j, :-1]).all()
    again = eval_batches(small_ds, batch_size=2, seq_len=T, max_batches=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    p0 = eval_batches(small_ds, 1, T, max_batches=100, part=0, num_parts=2)
    p1 = eval_batches(small_ds, 1, T, max_batches=100, part=1, num_parts=2)
    assert len(p0) == len(p1) == nw // 2
    assert {tuple(x[0].tolist()) for x, _ in p0}.isdisjoint({tuple(x[0].tolist()) for x, _ in p1})
    with pytest.raises(DataError, match="val split"):
        eval_batches(small_ds, 1, val.tokens, max_batches=1)


# -------------------------------------------------------------------------------------------------------- CLI


def test_cli_prepares_and_summarises(tmp_path, capsys):
    corpus = lines_corpus(tmp_path, n_docs=5)
    out = tmp_path / "ds"
    assert prepare_main([str(corpus), "--out", str(out), "--quiet", "--val-fraction", "0.2", "--seed", "4",
                         "--shard-tokens", "100"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "train" in lines[0] and "val" in lines[0]
    meta = read_meta(out)
    assert meta["seed"] == 4 and meta["val_fraction"] == 0.2 and len(meta["splits"]["train"]["files"]) > 1


def test_cli_default_out_is_the_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EDIT_TRAIN_CACHE", str(tmp_path / "cache"))
    corpus = lines_corpus(tmp_path, n_docs=5)
    assert prepare_main([str(corpus), "--quiet"]) == 0
    expected = ensure_dataset(str(corpus), "byte", progress=False)
    assert str(expected) in capsys.readouterr().out


def test_cli_error_exits_2_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        prepare_main([str(tmp_path / "missing_dir"), "--out", str(tmp_path / "ds"), "--quiet"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "missing_dir" in err and len(err.splitlines()) == 1
    assert "Traceback" not in err and not (tmp_path / "ds").exists()


@pytest.mark.parametrize("pattern", ["*.txt", "**/*.txt"])
def test_split_does_not_depend_on_where_the_corpus_lives(tmp_path, pattern):
    """The same files under two directories split into the same val documents: the split hash keys
    documents relative to the glob's fixed directory, not by absolute path."""
    many = [f"document number {i}\n" * 3 for i in range(40)]
    val_sets = []
    for where in ("a", "deeper/b"):
        corpus = write_corpus(tmp_path / where / "corpus", many)
        prepare_corpus(str(corpus / pattern), tmp_path / where / "ds", val_fraction=0.25, progress=False)
        val = split_docs(all_tokens(tmp_path / where / "ds", "val"), 256)
        val_sets.append(sorted(ByteTokenizer().decode(d) for d in val))
    assert val_sets[0] and val_sets[0] == val_sets[1]
