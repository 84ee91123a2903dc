"""Corpus preparation: text → token shards on disk, written atomically and cached.

Layout of a prepared dataset directory::

    meta.json            {"version": 1, "tokenizer", "tokenizer_id", "vocab_size", "eos_id", "dtype", ...,
                          "splits": {"train": {"files", "tokens", "documents"}, "val": {...}}}
    train_00000.bin      raw little-endian uint16/uint32 token ids, at most ``shard_tokens`` per file
    val_00000.bin

A *document* is a file (text sources) or a line (JSONL sources). Each document's tokens are followed by the
tokenizer's end-of-document id (when it has one) and documents are concatenated per split. The train/val split
is by document, decided by a hash of the document's key and the seed, so it does not depend on file order or
on the machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tqdm import tqdm

from .corpus import Doc, DocReader, is_stdlib, list_documents, split_source, stdlib_files
from .families import is_family_source
from .tokenizer import DataError, load_tokenizer, tokenizer_id

__all__ = [
    "DEFAULT_VAL_FRACTION",
    "META_VERSION",
    "SPLITS",
    "prepare_corpus",
    "ensure_dataset",
    "default_cache_dir",
    "dataset_key",
    "dtype_for_vocab",
    "read_meta",
    "stdlib_files",
]

log = logging.getLogger(__name__)

META_VERSION = 2  # 2: glob and file documents keyed relative to the glob's directory
SPLITS = ("train", "val")
# The validation split `edit-train` uses (DataConfig.val_fraction) and `edit-train-prepare`'s default, so the
# prepare command warms exactly the cache entry the trainer reads (the split is part of the cache key).
DEFAULT_VAL_FRACTION = 0.02


# --------------------------------------------------------------------------------------------------- helpers


def dtype_for_vocab(vocab_size: int) -> str:
    """The on-disk token dtype: ``"uint16"`` when every id fits (vocab ≤ 65536), else ``"uint32"``."""
    return "uint16" if vocab_size <= 65536 else "uint32"


def default_cache_dir() -> Path:
    """``$EDIT_TRAIN_CACHE`` if set, else ``~/.cache/edit-train``."""
    env = os.environ.get("EDIT_TRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edit-train"


def _source_label(source: str | None) -> str:
    return "stdlib" if is_stdlib(source) and not is_family_source(source) else str(source)


def read_meta(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate ``data_dir/meta.json`` (and that every shard exists with the right size).

    Raises :class:`DataError` naming the file when anything is missing or inconsistent.
    """
    data_dir = Path(data_dir)
    path = data_dir / "meta.json"
    redo = f"delete {data_dir} and prepare the dataset again (edit-train-prepare)"
    if not path.is_file():
        raise DataError(f"{path} not found: {data_dir} is not a prepared dataset; prepare it with edit-train-prepare")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} is corrupt ({exc}); {redo}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path} is corrupt (not a JSON object); {redo}")
    if meta.get("version") != META_VERSION:
        raise DataError(f"{path} has version {meta.get('version')!r}, expected {META_VERSION}; {redo}")
    for key in ("tokenizer", "tokenizer_id", "vocab_size", "dtype", "splits"):
        if key not in meta:
            raise DataError(f"{path} is corrupt (missing field {key!r}); {redo}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{path} has unknown dtype {meta['dtype']!r}; {redo}")
    itemsize = np.dtype(meta["dtype"]).itemsize
    splits = meta["splits"]
    if not isinstance(splits, dict):
        raise DataError(f"{path} is corrupt (field 'splits' is not an object); {redo}")
    for split in SPLITS:
        info = splits.get(split)
        if not isinstance(info, dict) or not isinstance(info.get("files"), list) or not isinstance(
            info.get("tokens"), int
        ):
            raise DataError(f"{path} is corrupt (missing or malformed splits.{split}); {redo}")
        total = 0
        for name in info["files"]:
            shard = data_dir / str(name)
            if not shard.is_file():
                raise DataError(f"shard {shard} listed in {path} is missing; {redo}")
            size = shard.stat().st_size
            if size % itemsize:
                raise DataError(
                    f"shard {shard} has {size} bytes, not a multiple of {itemsize} ({meta['dtype']}); {redo}"
                )
            total += size // itemsize
        if total != info["tokens"]:
            raise DataError(
                f"shards of split {split!r} in {data_dir} hold {total} tokens but {path} says {info['tokens']}; {redo}"
            )
    return meta


def _check_min_tokens(meta: dict[str, Any], min_tokens: int, where: str) -> None:
    train = int(meta["splits"]["train"]["tokens"])
    if train < min_tokens:
        raise DataError(
            f"corpus {where} has only {train} training tokens but at least {min_tokens} are needed "
            "(batch_size × (seq_len+1)); use a larger corpus or reduce train.batch_size / train.seq_len"
        )


class _ShardWriter:
    """Appends tokens to ``{split}_{i:05d}.bin`` files of at most ``shard_tokens`` tokens each."""

    def __init__(self, out_dir: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.files: list[str] = []
        self.tokens = 0
        self.documents = 0
        self._fh: BinaryIO | None = None
        self._in_shard = 0

    def write(self, tokens: np.ndarray) -> None:
        arr = np.ascontiguousarray(tokens, dtype=self.dtype)
        pos = 0
        while pos < len(arr):
            if self._fh is None or self._in_shard >= self.shard_tokens:
                self._roll()
            assert self._fh is not None
            take = min(len(arr) - pos, self.shard_tokens - self._in_shard)
            self._fh.write(arr[pos : pos + take].tobytes())
            pos += take
            self._in_shard += take
            self.tokens += take

    def _roll(self) -> None:
        if self._fh is not None:
            self._fh.close()
        name = f"{self.split}_{len(self.files):05d}.bin"
        self._fh = open(self.out_dir / name, "wb")
        self.files.append(name)
        self._in_shard = 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def info(self) -> dict[str, Any]:
        return {"files": list(self.files), "tokens": self.tokens, "documents": self.documents}


# ---------------------------------------------------------------------------------------------------- public


def _validate_args(val_fraction: float, shard_tokens: int, min_tokens: int) -> None:
    if not 0.0 <= float(val_fraction) < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if int(shard_tokens) < 1:
        raise DataError(f"shard_tokens must be ≥ 1, got {shard_tokens}")
    if int(min_tokens) < 0:
        raise DataError(f"min_tokens must be ≥ 0, got {min_tokens}")


def prepare_corpus(
    source: str | None,
    out_dir: str | os.PathLike[str],
    tokenizer: str = "byte",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shard_tokens: int = 16_000_000,
    seed: int = 0,
    min_tokens: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``source`` into train/val token shards under ``out_dir``; return the metadata.

    ``source``: ``None``/``"stdlib"`` (this interpreter's standard library ``*.py`` files), a file, a directory
    (all files below it), a glob (``recursive=True``), or ``.jsonl`` files whose lines are ``{"text": ...}``.
    If ``out_dir`` already holds a valid dataset it is returned as is (cache hit). Otherwise everything is
    written to ``<out_dir>.tmp-<pid>`` and renamed into place at the end; on error the temp dir is removed.
    """
    _validate_args(val_fraction, shard_tokens, min_tokens)
    out_dir = Path(out_dir).expanduser()
    label = _source_label(source)

    if (out_dir / "meta.json").is_file():
        meta = read_meta(out_dir)
        _warn_if_different(meta, out_dir, label, tokenizer, val_fraction, seed)
        _check_min_tokens(meta, min_tokens, f"{label} ({out_dir})")
        return meta
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(f"output {out_dir} exists but is not a prepared dataset (no meta.json); "
                        "remove it or choose another output directory")

    tok = load_tokenizer(tokenizer)
    tok_id = tokenizer_id(tokenizer)
    dtype = dtype_for_vocab(tok.vocab_size)
    docs, n_files = list_documents(source)
    if not docs:
        raise DataError(f"corpus {label} contains no text ({n_files} file(s), all empty); "
                        "point the source at non-empty text files")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f"{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        splits = _write_splits(tmp, docs, tok, dtype, val_fraction, shard_tokens, seed, progress,
                               skip_bad_utf8=is_stdlib(source), source=source)
        content = splits.pop("_content_tokens")
        if content == 0:
            raise DataError(f"corpus {label} contains no text ({len(docs)} document(s) produced no tokens); "
                            "point the source at non-empty text files")
        meta = {
            "version": META_VERSION,
            "tokenizer": str(tokenizer),
            "tokenizer_id": tok_id,
            "vocab_size": int(tok.vocab_size),
            "eos_id": tok.eos_id,
            "dtype": dtype,
            "source": label,
            "seed": int(seed),
            "val_fraction": float(val_fraction),
            "shard_tokens": int(shard_tokens),
            "python": sys.version.split()[0],
            "splits": splits,
        }
        _check_min_tokens(meta, min_tokens, label)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        try:
            if out_dir.is_dir():  # an empty directory we are allowed to replace
                out_dir.rmdir()
            os.replace(tmp, out_dir)
        except OSError:
            # Someone else (another rank/process) finished the same dataset first: use theirs.
            if (out_dir / "meta.json").is_file():
                shutil.rmtree(tmp, ignore_errors=True)
                return read_meta(out_dir)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("prepared %s → %s: train %d tokens, val %d tokens", label, out_dir,
             meta["splits"]["train"]["tokens"], meta["splits"]["val"]["tokens"])
    return meta


def _write_splits(
    tmp: Path,
    docs: list[Doc],
    tok: Any,
    dtype: str,
    val_fraction: float,
    shard_tokens: int,
    seed: int,
    progress: bool,
    skip_bad_utf8: bool,
    source: str | None = None,
) -> dict[str, Any]:
    writers = {s: _ShardWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}
    eos = None if tok.eos_id is None else np.array([tok.eos_id], dtype=np.int64)
    reader = DocReader(skip_bad_utf8=skip_bad_utf8)
    content = 0
    try:
        with tqdm(total=len(docs), disable=not progress, unit="doc", desc="prepare", dynamic_ncols=True) as bar:
            if len(docs) == 1:
                text = reader.read(docs[0]) or ""
                ids = tok.encode_array(text)
                content = len(ids)
                if eos is not None and content:
                    ids = np.concatenate([ids.astype(np.int64), eos])
                n_val = 0
                if val_fraction > 0 and len(ids) >= 2:
                    n_val = min(len(ids) - 1, max(1, int(round(len(ids) * val_fraction))))
                writers["train"].write(ids[: len(ids) - n_val])
                writers["val"].write(ids[len(ids) - n_val :])
                writers["train"].documents = 1 if content else 0
                writers["val"].documents = 1 if n_val else 0
                bar.update(1)
            else:
                for doc, is_val in zip(docs, split_source(docs, val_fraction, seed, source)):
                    text = reader.read(doc)
                    bar.update(1)
                    if not text:
                        continue
                    ids = tok.encode_array(text)
                    if not len(ids):
                        continue
                    content += len(ids)
                    w = writers["val" if is_val else "train"]
                    w.write(ids)
                    if eos is not None:
                        w.write(eos)
                    w.documents += 1
    finally:
        for w in writers.values():
            w.close()
    result: dict[str, Any] = {s: w.info() for s, w in writers.items()}
    result["_content_tokens"] = content
    return result


def _warn_if_different(meta: dict[str, Any], out_dir: Path, label: str, tokenizer: str, val_fraction: float,
                       seed: int) -> None:
    wanted = {"source": label, "tokenizer": str(tokenizer), "val_fraction": float(val_fraction), "seed": int(seed)}
    diff = {k: (meta.get(k), v) for k, v in wanted.items() if meta.get(k) != v}
    if diff:
        log.warning("%s already holds a prepared dataset with different settings %s; using it as is "
                    "(delete it to prepare again)", out_dir, {k: f"{a!r} != {b!r}" for k, (a, b) in diff.items()})


def dataset_key(source: str | None, tokenizer: str = "byte", val_fraction: float = DEFAULT_VAL_FRACTION,
                seed: int = 0) -> str:
    """The cache directory name for a dataset: readable prefix + hash of (source, tokenizer content, split)."""
    if is_family_source(source):
        assert source is not None
        src = f"{source}-py{sys.version.split()[0]}"
        prefix = src.replace(":", "-")
    elif is_stdlib(source):
        src = f"stdlib-py{sys.version.split()[0]}"
        prefix = src
    else:
        assert source is not None
        src = os.path.abspath(os.path.expanduser(source))
        stem = Path(src.split("*")[0].rstrip("/\\") or "corpus").name or "corpus"
        prefix = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:40] or "corpus"
    payload = json.dumps({"source": src, "tokenizer": tokenizer_id(tokenizer), "val_fraction": float(val_fraction),
                          "seed": int(seed), "version": META_VERSION}, sort_keys=True)
    return f"{prefix}-{hashlib.sha256(payload.encode('utf-8')).hexdigest()[:16]}"


def ensure_dataset(
    source: str | None,
    tokenizer: str = "byte",
    cache_dir: str | os.PathLike[str] | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = 0,
    min_tokens: int = 0,
    shard_tokens: int = 16_000_000,
    progress: bool = True,
) -> Path:
    """Return ``cache_dir/data/<key>``, preparing the dataset there first if it is not cached yet.

    The key covers the source (for the stdlib: the Python version), the tokenizer's content, val_fraction
    and seed — not the corpus files' contents: delete the directory after editing a corpus in place.
    """
    _validate_args(val_fraction, shard_tokens, min_tokens)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = root / "data" / dataset_key(source, tokenizer, val_fraction, seed)
    prepare_corpus(source, out, tokenizer=tokenizer, val_fraction=val_fraction, shard_tokens=shard_tokens,
                   seed=seed, min_tokens=min_tokens, progress=progress)
    return out
