"""Pre-tokenized corpora: flat little-endian ``uint16`` / ``uint32`` token files, as nanoGPT and Megatron-style
pipelines write them (``data.token_dtype`` names the dtype, ``data.tokenizer`` the tokenizer that made them).

The files are used where they are, not copied: the dataset's ``meta.json`` lists them as ``{"path", "start",
"stop"}`` token ranges. A source holding ``train.bin`` and ``val.bin`` (nanoGPT's layout) keeps that split; any
other holds out the last ``val_fraction`` of its token stream. Every file is checked once, in bounded memory:
its size is a whole number of tokens, and every id is inside the tokenizer's vocabulary (else one line saying
which file, which position, and what to check).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .corpus import is_stdlib, resolve_files
from .tokenizer import DataError

TOKEN_DTYPES = ("uint16", "uint32")
_CHUNK = 1 << 24  # tokens scanned at a time


def _token_files(source: str | None) -> list[Path]:
    if is_stdlib(source):
        raise DataError("data.token_dtype is set but data.source is the stdlib demo corpus (text); point "
                        "data.source at your token files, or unset data.token_dtype")
    files, _ = resolve_files(source)
    if len(files) > 1:
        files = [f for f in files if f.suffix == ".bin"]  # a directory may hold meta.pkl, *.idx, ...
        if not files:
            raise DataError(f"data.source {source}: no .bin token files there (data.token_dtype is set)")
    return files


def _scan(path: Path, dtype: np.dtype, vocab: int, eos: int | None, spec: str) -> tuple[int, int, int]:
    """(tokens, largest id, end-of-document ids) of one token file, read in chunks."""
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype.name} tokens; is data.token_dtype "
                        f"right?")
    n = size // dtype.itemsize
    if n == 0:
        return 0, -1, 0
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    largest, docs = -1, 0
    for start in range(0, n, _CHUNK):
        chunk = tokens[start : start + _CHUNK]
        top = int(chunk.max())
        if top >= vocab:
            pos = start + int(np.argmax(chunk >= vocab))
            raise DataError(f"{path}: token {pos} is id {int(chunk[pos - start])}, outside the vocabulary of "
                            f"tokenizer {spec} ({vocab} ids); check data.token_dtype and data.tokenizer")
        largest = max(largest, top)
        if eos is not None:
            docs += int(np.count_nonzero(chunk == eos))
    del tokens
    return n, largest, docs


def token_splits(source: str | None, label: str, token_dtype: str, tok: Any, spec: str,
                 val_fraction: float) -> dict[str, Any]:
    """The ``meta.json`` fields of a pre-tokenized source: ``dtype``, ``format``, ``max_token_id``, ``splits``."""
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(f"data.token_dtype={token_dtype!r}: must be uint16 or uint32 (the dtype the token files "
                        f"were written in)")
    if token_dtype == "uint16" and tok.vocab_size > 1 << 16:
        raise DataError(f"data.token_dtype=uint16 cannot hold the ids of tokenizer {spec} ({tok.vocab_size} ids); "
                        f"token files for it are uint32")
    dtype = np.dtype(token_dtype).newbyteorder("<")
    files = _token_files(source)
    scanned = {f: _scan(f, dtype, int(tok.vocab_size), tok.eos_id, spec) for f in files}
    largest = max(s[1] for s in scanned.values())
    by_name = {f.name: f for f in files}

    def entry(f: Path, start: int, stop: int) -> dict[str, Any]:
        return {"path": str(f.resolve()), "start": start, "stop": stop}

    if {"train.bin", "val.bin"} <= set(by_name):
        splits = {s: {"files": [entry(by_name[f"{s}.bin"], 0, scanned[by_name[f"{s}.bin"]][0])],
                      "tokens": scanned[by_name[f"{s}.bin"]][0], "documents": scanned[by_name[f"{s}.bin"]][2]}
                  for s in ("train", "val")}
    else:
        total = sum(s[0] for s in scanned.values())
        n_val = min(total - 1, max(1, round(total * val_fraction))) if val_fraction > 0 and total >= 2 else 0
        cut = total - n_val
        splits = {"train": {"files": [], "tokens": cut, "documents": None},
                  "val": {"files": [], "tokens": n_val, "documents": None}}
        pos = 0
        for f, (n, _, _) in scanned.items():
            if pos < cut and n:
                splits["train"]["files"].append(entry(f, 0, min(n, cut - pos)))
            if pos + n > cut and n:
                splits["val"]["files"].append(entry(f, max(0, cut - pos), n))
            pos += n
    if splits["train"]["tokens"] == 0:
        raise DataError(f"corpus {label} holds no tokens; point data.source at non-empty token files")
    return {"dtype": token_dtype, "format": "tokens", "max_token_id": largest, "splits": splits}
