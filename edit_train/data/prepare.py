"""Corpus preparation: text → token shards on disk, written atomically and cached.

Layout of a prepared dataset directory::

    meta.json            {"version": 2, "tokenizer", "tokenizer_id", "vocab_size", "eos_id", "dtype", ...,
                          "splits": {"train": {"files", "tokens", "documents"}, "val": {...}}}
    train_00000.bin      raw little-endian uint16/uint32 token ids, at most ``shard_tokens`` per file
    val_00000.bin

A *document* is a file (text sources), a line (JSONL) or a row (Parquet). Each document's tokens are followed by
the tokenizer's end-of-document id (when it has one) and documents are concatenated per split. The train/val split
is by document, decided by a hash of the document's key and the seed, so it does not depend on file order, on how
the work is cut, or on the machine (a standard-library family source: each family's documents in hash order until
they hold ``val_fraction`` of its bytes, the same in every source holding the family). A pre-tokenized source
(``token_dtype``) is not copied: its meta.json lists the token files themselves (``{"path", "start", "stop"}``
entries, see :mod:`edit_train.data.tokens`).

Preparing streams: the corpus is cut into pieces (:func:`~edit_train.data.corpus.plan_pieces`), each tokenized by
one process of a pool (all cores by default) into its own files (:mod:`edit_train.data.pieces`), in
``<out>.partial/``; memory per process is bounded by a piece, not by the corpus. A stopped preparation (Ctrl-C,
a kill, a crash) resumes with the pieces that have no record yet; a user error (bad file, bad line) removes the
partial directory. Concurrent preparers of one directory take turns (an exclusive lock in it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .corpus import is_stdlib, stdlib_files
from .families import is_family_source
from .languages import fingerprint as language_fingerprint, is_language_source
from .tokenize import Stats, locked, tokenize_corpus
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
        for entry in info["files"]:
            shard, start, stop = shard_span(data_dir, entry)
            if not shard.is_file():
                raise DataError(f"shard {shard} listed in {path} is missing; {redo}")
            size = shard.stat().st_size
            if size % itemsize:
                raise DataError(
                    f"shard {shard} has {size} bytes, not a multiple of {itemsize} ({meta['dtype']}); {redo}"
                )
            if stop is not None and not 0 <= start <= stop <= size // itemsize:
                raise DataError(f"shard {shard} holds {size // itemsize} tokens, fewer than {path} uses; {redo}")
            total += (size // itemsize if stop is None else stop) - start
        if total != info["tokens"]:
            raise DataError(
                f"shards of split {split!r} in {data_dir} hold {total} tokens but {path} says {info['tokens']}; {redo}"
            )
    return meta


def shard_span(data_dir: Path, entry: Any) -> tuple[Path, int, int | None]:
    """A ``splits.*.files`` entry: a file name in the dataset directory (all its tokens), or ``{"path", "start",
    "stop"}`` (a pre-tokenized source's file, tokens ``[start, stop)``) -> (path, start, stop or None)."""
    if isinstance(entry, dict):
        return Path(str(entry.get("path"))), int(entry.get("start", 0)), int(entry["stop"])
    return data_dir / str(entry), 0, None


def _check_min_tokens(meta: dict[str, Any], min_tokens: int, where: str) -> None:
    train = int(meta["splits"]["train"]["tokens"])
    if train < min_tokens:
        raise DataError(
            f"corpus {where} has only {train} training tokens but at least {min_tokens} are needed "
            "(batch_size × (seq_len+1)); use a larger corpus or reduce train.batch_size / train.seq_len"
        )


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
    text_column: str = "text",
    token_dtype: str | None = None,
    workers: int = 0,
) -> dict[str, Any]:
    """Tokenize ``source`` into train/val token shards under ``out_dir``; return the metadata.

    ``source``: ``None``/``"stdlib"`` (this interpreter's standard library ``*.py`` files), a file, a directory
    (all files below it), a glob (``recursive=True``), ``.jsonl`` files (a line is a document, its text in
    ``text_column``) or ``.parquet`` files (a row is a document, its text in column ``text_column``). With
    ``token_dtype`` (``uint16``/``uint32``) the source is pre-tokenized flat token files instead, used in place.
    ``workers``: processes tokenizing at once (0: every core this process may use). If ``out_dir`` already holds
    a valid dataset it is returned as is (cache hit); a stopped preparation of it resumes.
    """
    return prepare_with_stats(source, out_dir, tokenizer, val_fraction, shard_tokens, seed, min_tokens, progress,
                              text_column, token_dtype, workers)[0]


def prepare_with_stats(source: str | None, out_dir: str | os.PathLike[str], tokenizer: str = "byte",
                       val_fraction: float = DEFAULT_VAL_FRACTION, shard_tokens: int = 16_000_000, seed: int = 0,
                       min_tokens: int = 0, progress: bool = True, text_column: str = "text",
                       token_dtype: str | None = None, workers: int = 0) -> tuple[dict[str, Any], Stats | None]:
    """:func:`prepare_corpus`, and how the tokenizing went (None on a cache hit or a pre-tokenized source)."""
    _validate_args(val_fraction, shard_tokens, min_tokens)
    out_dir = Path(out_dir).expanduser()
    label = _source_label(source)

    if (out_dir / "meta.json").is_file():
        meta = read_meta(out_dir)
        _warn_if_different(meta, out_dir, label, tokenizer, val_fraction, seed)
        _check_min_tokens(meta, min_tokens, f"{label} ({out_dir})")
        return meta, None
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(f"output {out_dir} exists but is not a prepared dataset (no meta.json); "
                        "remove it or choose another output directory")

    tok = load_tokenizer(tokenizer)
    meta = {
        "version": META_VERSION,
        "tokenizer": str(tokenizer),
        "tokenizer_id": tokenizer_id(tokenizer),
        "vocab_size": int(tok.vocab_size),
        "eos_id": tok.eos_id,
        "dtype": dtype_for_vocab(tok.vocab_size),
        "source": label,
        "seed": int(seed),
        "val_fraction": float(val_fraction),
        "shard_tokens": int(shard_tokens),
        "python": sys.version.split()[0],
    }
    if token_dtype is not None:
        from .tokens import token_splits

        meta.update(token_splits(source, label, token_dtype, tok, tokenizer, val_fraction))
        _check_min_tokens(meta, min_tokens, label)
        _publish_meta(meta, out_dir)
        return meta, None
    if text_column != "text":
        meta["text_column"] = text_column
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = out_dir.parent / f"{out_dir.name}.partial"
    with locked(work):
        if (out_dir / "meta.json").is_file():  # another process finished it while we waited
            return read_meta(out_dir), None
        try:
            job = {"tokenizer": str(tokenizer), "dtype": meta["dtype"], "shard_tokens": int(shard_tokens),
                   "val_fraction": float(val_fraction), "seed": int(seed), "text_column": text_column,
                   "skip_bad_utf8": is_stdlib(source) or is_language_source(source)}
            splits, stats = tokenize_corpus(source, label, work, job, workers, progress=progress)
            splits.pop("_content_tokens")
            meta["splits"] = splits
            _check_min_tokens(meta, min_tokens, label)
        except DataError:  # the corpus or the settings are wrong: nothing worth resuming
            shutil.rmtree(work, ignore_errors=True)
            raise
        (work / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        (work / ".lock").unlink(missing_ok=True)
        if out_dir.is_dir():  # an empty directory we are allowed to replace
            out_dir.rmdir()
        os.replace(work, out_dir)
    log.info("prepared %s → %s: train %d tokens, val %d tokens", label, out_dir,
             meta["splits"]["train"]["tokens"], meta["splits"]["val"]["tokens"])
    return meta, stats


def _publish_meta(meta: dict[str, Any], out_dir: Path) -> None:
    """A dataset directory holding only ``meta.json`` (a pre-tokenized source's files stay where they are)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f"{out_dir.name}.tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    try:
        if out_dir.is_dir():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "meta.json").is_file():  # not someone else's finished copy of the same dataset
            raise


def _warn_if_different(meta: dict[str, Any], out_dir: Path, label: str, tokenizer: str, val_fraction: float,
                       seed: int) -> None:
    wanted = {"source": label, "tokenizer": str(tokenizer), "val_fraction": float(val_fraction), "seed": int(seed)}
    diff = {k: (meta.get(k), v) for k, v in wanted.items() if meta.get(k) != v}
    if diff:
        log.warning("%s already holds a prepared dataset with different settings %s; using it as is "
                    "(delete it to prepare again)", out_dir, {k: f"{a!r} != {b!r}" for k, (a, b) in diff.items()})


def dataset_key(source: str | None, tokenizer: str = "byte", val_fraction: float = DEFAULT_VAL_FRACTION,
                seed: int = 0, text_column: str = "text", token_dtype: str | None = None) -> str:
    """The cache directory name for a dataset: readable prefix + hash of (source, tokenizer content, split)."""
    if is_family_source(source):
        assert source is not None
        src = f"{source}-py{sys.version.split()[0]}"
        prefix = src.replace(":", "-")
    elif is_language_source(source):  # the files this machine holds, sampled (edit_train/data/languages.py)
        assert source is not None
        src = f"{source}-{language_fingerprint(source)}"
        prefix = source.replace(":", "-")
    elif is_stdlib(source):
        src = f"stdlib-py{sys.version.split()[0]}"
        prefix = src
    else:
        assert source is not None
        src = os.path.abspath(os.path.expanduser(source))
        stem = Path(src.split("*")[0].rstrip("/\\") or "corpus").name or "corpus"
        prefix = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:40] or "corpus"
    key: dict[str, Any] = {"source": src, "tokenizer": tokenizer_id(tokenizer), "val_fraction": float(val_fraction),
                           "seed": int(seed), "version": META_VERSION}
    if text_column != "text":  # the defaults leave the keys of existing caches as they were
        key["text_column"] = text_column
    if token_dtype is not None:
        key["token_dtype"] = token_dtype
    payload = json.dumps(key, sort_keys=True)
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
    text_column: str = "text",
    token_dtype: str | None = None,
    workers: int = 0,
) -> Path:
    """Return ``cache_dir/data/<key>``, preparing the dataset there first if it is not cached yet.

    The key covers the source (for the stdlib: the Python version), the tokenizer's content, val_fraction
    and seed — not the corpus files' contents: delete the directory after editing a corpus in place.
    """
    _validate_args(val_fraction, shard_tokens, min_tokens)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = root / "data" / dataset_key(source, tokenizer, val_fraction, seed, text_column, token_dtype)
    prepare_corpus(source, out, tokenizer=tokenizer, val_fraction=val_fraction, shard_tokens=shard_tokens,
                   seed=seed, min_tokens=min_tokens, progress=progress, text_column=text_column,
                   token_dtype=token_dtype, workers=workers)
    return out
