"""One piece of a corpus -> its train/val token files and a record of what it wrote (the worker's whole job).

A piece's documents are tokenized in order, each followed by the tokenizer's end-of-document id, and go to train
or val by the hash of their key (:func:`~edit_train.data.corpus.split_score`) unless the job's ``force`` names
their side (a family source's planned split, or the split's corner cases). Its token files are written under
temporary names and renamed, then its record ``pNNNNN.json``: a piece with a record is done, so a preparation that
was stopped resumes with the pieces that have none. Runs in the preparing process or in a worker process.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .corpus import Piece, read_piece, split_score
from .tokenizer import load_tokenizer

SPLITS = ("train", "val")
_TOKENIZERS: dict[str, Any] = {}


class ShardWriter:
    """Appends tokens to ``{prefix}{i:03d}.bin`` files of at most ``shard_tokens`` tokens each (``.tmp`` names
    until :meth:`close`)."""

    def __init__(self, out_dir: Path, prefix: str, dtype: str, shard_tokens: int) -> None:
        self.out_dir, self.prefix, self.shard_tokens = out_dir, prefix, shard_tokens
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
        name = f"{self.prefix}{len(self.files):03d}.bin"
        self._fh = open(self.out_dir / (name + ".tmp"), "wb")
        self.files.append(name)
        self._in_shard = 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for name in self.files:
            os.replace(self.out_dir / (name + ".tmp"), self.out_dir / name)

    def abandon(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for name in self.files:
            (self.out_dir / (name + ".tmp")).unlink(missing_ok=True)


def record_path(work: Path, index: int) -> Path:
    return work / f"p{index:05d}.json"


def _tokenizer(spec: str) -> Any:
    if spec not in _TOKENIZERS:
        _TOKENIZERS[spec] = load_tokenizer(spec)
    return _TOKENIZERS[spec]


def tokenize_piece(job: dict[str, Any]) -> dict[str, Any]:
    """Tokenize ``job["piece"]`` (a :class:`Piece` as a dict) into ``job["work"]``; returns and writes its record.

    ``job["force"]``: {document key: "train" | "val"} overriding the hash (a family source's planned sides, the
    split's at-least-one-each-side rule); ``job["single"]``: the corpus's only document, split by tokens instead
    (the last val_fraction)."""
    piece, index, work = Piece(**{**job["piece"], "paths": tuple(job["piece"]["paths"]),
                                  "keys": tuple(job["piece"]["keys"])}), int(job["index"]), Path(job["work"])
    tok = _tokenizer(job["tokenizer"])
    val_fraction, seed, force = float(job["val_fraction"]), int(job["seed"]), dict(job.get("force") or {})
    writers = {s: ShardWriter(work, f"p{index:05d}-{s}-", job["dtype"], int(job["shard_tokens"])) for s in SPLITS}
    eos = None if tok.eos_id is None else np.array([tok.eos_id], dtype=np.int64)
    content = docs = 0
    extremes: dict[str, list[Any] | None] = {"min_train": None, "max_val": None}
    try:
        for key, text in read_piece(piece, job["text_column"], bool(job["skip_bad_utf8"])):
            ids = tok.encode_array(text)
            if not len(ids):
                continue
            content += len(ids)
            docs += 1
            if job.get("single"):
                if eos is not None:
                    ids = np.concatenate([ids.astype(np.int64), eos])
                n_val = min(len(ids) - 1, max(1, int(round(len(ids) * val_fraction)))) if val_fraction > 0 and \
                    len(ids) >= 2 else 0
                writers["train"].write(ids[: len(ids) - n_val])
                writers["val"].write(ids[len(ids) - n_val :])
                writers["train"].documents, writers["val"].documents = 1, int(n_val > 0)
                continue
            score = split_score(key, seed)
            side = force.get(key, "val" if score < val_fraction else "train")
            which = "min_train" if side == "train" else "max_val"
            best = extremes[which]
            if best is None or (score < best[0] if side == "train" else score > best[0]):
                extremes[which] = [score, key]
            w = writers[side]
            w.write(ids)
            if eos is not None:
                w.write(eos)
            w.documents += 1
    except BaseException:
        for w in writers.values():
            w.abandon()
        raise
    for w in writers.values():
        w.close()
    record = {"piece": asdict(piece), "index": index, "bytes": piece.nbytes, "content": content, "documents": docs,
              "splits": {s: {"files": w.files, "tokens": w.tokens, "documents": w.documents} for s, w in writers.items()},
              **extremes}
    tmp = record_path(work, index).with_suffix(f".json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, record_path(work, index))
    return record
