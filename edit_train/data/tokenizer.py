"""Tokenizers: a dependency-free byte tokenizer and a wrapper around HuggingFace ``tokenizers`` files.

A tokenizer *spec* is the string a user writes in a config: ``"byte"`` or a path to a ``tokenizer.json``
(a directory containing one is accepted too). :func:`tokenizer_id` turns a spec into a short stable string
that changes when the tokenizer's content changes; dataset caches are keyed on it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from edit_train.offline import looks_like_hub_name, offline_hint

__all__ = [
    "DataError",
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "tokenizer_id",
    "EOS_CANDIDATES",
]

#: The byte tokenizer's end-of-document token, as its Hugging Face file names it.
BYTE_EOS = "<|endoftext|>"

#: Token strings recognised as end-of-document markers in HuggingFace tokenizers, in order of preference.
EOS_CANDIDATES: tuple[str, ...] = ("</s>", "<|endoftext|>", "<eos>", "[SEP]")


class DataError(ValueError):
    """A data problem the user can fix (bad path, bad corpus, bad tokenizer, mismatched state).

    The message is one line naming the file/field and what to do; CLIs print it without a traceback.
    """


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_array(self, text: str) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is end-of-document."""

    vocab_size: int = 257
    eos_id: int | None = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode`, as a numpy array (fast path for corpus preparation)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def save_hf(self, path: str | os.PathLike[str]) -> None:
        """Write this tokenizer as a Hugging Face ``tokenizers`` file: byte-level BPE without merges over GPT-2's
        byte-to-unicode alphabet, in byte order (ids 0..255 = bytes), and :data:`BYTE_EOS` = 256."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _HFTok

        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        extra = iter(range(256, 512))
        char = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
        tok = _HFTok(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(BYTE_EOS, special=True, normalized=False)])
        tok.save(str(path))

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _resolve_tokenizer_file(spec: str | os.PathLike[str]) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        if looks_like_hub_name(str(spec)):
            raise DataError(offline_hint(str(spec), "data.tokenizer", "tokenizer.json"))
        raise DataError(
            f"tokenizer file {path} does not exist; pass 'byte' or the path to a HuggingFace tokenizer.json"
        )
    return path


class HFTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = _resolve_tokenizer_file(path)
        try:
            from tokenizers import Tokenizer as _HFTok

            self._tok = _HFTok.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises plain Exception for unparseable files
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(
                f"tokenizer file {self.path} could not be loaded ({reason}); "
                "it must be a HuggingFace tokenizers JSON file (tokenizer.json), or use 'byte'"
            ) from None
        self.vocab_size: int = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id: int | None = None
        for name in EOS_CANDIDATES:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                self.eos_id = int(tid)
                break

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        kept = [int(i) for i in ids if self.eos_id is None or int(i) != self.eos_id]
        return self._tok.decode(kept)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def load_tokenizer(spec: str | os.PathLike[str]) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` → :class:`ByteTokenizer`; anything else is a path to a ``tokenizer.json``."""
    if str(spec) == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def tokenizer_id(spec: str | os.PathLike[str]) -> str:
    """A stable identifier of the tokenizer's *content*: ``"byte"`` or ``"hf-<sha256[:12]>"``."""
    if str(spec) == "byte":
        return "byte"
    path = _resolve_tokenizer_file(spec)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return "hf-" + digest.hexdigest()[:12]
