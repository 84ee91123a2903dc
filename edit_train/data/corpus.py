"""Corpus discovery and reading: which files/lines are documents, their UTF-8 text, the train/val split.

Sources: the running interpreter's standard library (the demo corpus), a glob of text files, a directory,
or JSONL with a ``text`` field. Every user error is a one-line :class:`DataError` naming the file.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .families import family_files, family_of, is_family_source, stdlib_root
from .tokenizer import DataError

log = logging.getLogger(__name__)

_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                                   "__pycache__"})


def is_stdlib(source: str | None) -> bool:
    """The whole standard library (the default source) or some of its families (``stdlib:<family>``)."""
    return source is None or source == "stdlib" or is_family_source(source)


def _stdlib_root() -> Path:
    return stdlib_root()


def stdlib_files() -> list[Path]:
    """Every ``*.py`` file of this interpreter's standard library, minus tests, site-packages, idlelib, lib2to3."""
    root = _stdlib_root()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found)


# ------------------------------------------------------------------------------------------------- documents


@dataclass(frozen=True)
class Doc:
    key: str  # stable, machine-independent name used for the split hash
    path: Path
    line: int | None = None  # 1-based line number for JSONL documents


def _utf8_error(path: Path, raw: bytes, exc: UnicodeDecodeError, base: int = 0, line: int | None = None) -> DataError:
    where = f"{path}:{line}" if line is not None else str(path)
    bad = raw[exc.start : exc.start + 1].hex()
    return DataError(
        f"{where}: not valid UTF-8 (byte 0x{bad} at byte offset {base + exc.start}); convert the file to UTF-8 "
        "(e.g. iconv -f latin1 -t utf-8) or remove it from the corpus"
    )


def _jsonl_text(path: Path, line_no: int, raw: bytes, base: int) -> str:
    """Parse one JSONL line into its ``text`` (raises DataError naming file:line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _utf8_error(path, raw, exc, base=base, line=line_no) from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno}); "
            'each line must be a JSON object with a string "text" field'
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        what = "not a JSON object" if not isinstance(obj, dict) else (
            'no "text" field' if "text" not in obj else f'"text" is a {type(obj["text"]).__name__}, not a string'
        )
        raise DataError(f'{path}:{line_no}: {what}; each line must be a JSON object with a string "text" field')
    return obj["text"]


def _iter_jsonl(path: Path) -> Iterator[tuple[int, str]]:
    """Yield (line number, text) for every non-blank line of a JSONL file."""
    base = 0
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if raw.strip():
                yield line_no, _jsonl_text(path, line_no, raw, base)
            base += len(raw)


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


def _resolve_files(source: str | None) -> tuple[list[Path], Path]:
    """The corpus files in a deterministic order, and the directory their keys are relative to."""
    if is_family_source(source):
        assert source is not None
        return family_files(source), _stdlib_root()
    if is_stdlib(source):
        return stdlib_files(), _stdlib_root()
    assert source is not None
    expanded = os.path.expanduser(source)
    if os.path.isdir(expanded):
        files = sorted(Path(p) for p in glob.glob(os.path.join(glob.escape(expanded), "**", "*"), recursive=True)
                       if os.path.isfile(p))
        if not files:
            raise DataError(f"corpus directory {source} contains no files; point the source at your text files")
        return files, Path(expanded)
    if os.path.isfile(expanded):
        return [Path(expanded)], Path(expanded).parent
    matches = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
    if not matches:
        if glob.has_magic(expanded):
            raise DataError(f"corpus glob {source!r} matched no files; check the pattern (quote it so the shell "
                            "does not expand it)")
        raise DataError(f"corpus path {source} does not exist; pass a file, directory, glob or 'stdlib'")
    return matches, _glob_root(expanded)


def _glob_root(pattern: str) -> Path:
    """The directory a glob's matches are named relative to: its leading components without wildcards
    ("/data/py/**/*.py" -> "/data/py"). Document keys (and so the train/val split) then do not depend on
    where the corpus lives: the same files copied elsewhere split the same way."""
    fixed: list[str] = []
    for part in Path(pattern).parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def list_documents(source: str | None) -> tuple[list[Doc], int]:
    """All non-empty documents of the source (and how many files were looked at)."""
    files, root = _resolve_files(source)
    docs: list[Doc] = []
    for path in files:
        key = path.relative_to(root).as_posix()
        if _is_jsonl(path):
            for line_no, text in _iter_jsonl(path):
                if text:
                    docs.append(Doc(f"{key}:{line_no}", path, line_no))
        elif path.stat().st_size > 0:
            docs.append(Doc(key, path))
    return docs, len(files)


class DocReader:
    """Reads documents' texts in listing order, opening each JSONL file once."""

    def __init__(self, skip_bad_utf8: bool = False) -> None:
        self.skip_bad_utf8 = skip_bad_utf8
        self._jsonl_path: Path | None = None
        self._jsonl_iter: Iterator[tuple[int, str]] | None = None

    def read(self, doc: Doc) -> str | None:
        if doc.line is None:
            raw = doc.path.read_bytes()
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if self.skip_bad_utf8:
                    log.info("skipping %s: not valid UTF-8", doc.path)  # the stdlib's deliberately mis-encoded tests
                    return None
                raise _utf8_error(doc.path, raw, exc) from None
        if self._jsonl_path != doc.path:
            self._jsonl_path, self._jsonl_iter = doc.path, _iter_jsonl(doc.path)
        assert self._jsonl_iter is not None
        for line_no, text in self._jsonl_iter:
            if line_no == doc.line:
                return text
        raise DataError(f"{doc.path}: changed while being read (line {doc.line} vanished); prepare again")


def split_source(docs: list[Doc], val_fraction: float, seed: int, source: str | None) -> list[bool]:
    """Per document: True when it goes to val. A standard-library family source splits each family on its own
    (`split_by_size`), so every source holding a document agrees on its side; any other source is split whole
    (`split_fractions`)."""
    if not is_family_source(source):
        return split_fractions(docs, val_fraction, seed)
    by_family: dict[str, list[int]] = {}
    for i, doc in enumerate(docs):
        by_family.setdefault(family_of(doc.key), []).append(i)
    is_val = [False] * len(docs)
    for members in by_family.values():
        for i, v in zip(members, split_by_size([docs[i] for i in members], val_fraction, seed)):
            is_val[i] = v
    return is_val


def _score(seed: int, doc: Doc) -> float:
    """A document's place in [0, 1) for the split: a hash of the seed and its key (machine-independent)."""
    h = hashlib.sha1(f"{seed}\0{doc.key}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def split_by_size(docs: list[Doc], val_fraction: float, seed: int) -> list[bool]:
    """Per document: True when it goes to val. Documents in the order of their hash go to val until they hold
    val_fraction of the bytes (a family of a few hundred files split by count alone can end up with one small
    file of val); ≥1 each side when ≥2 docs."""
    if not docs or val_fraction <= 0:
        return [False] * len(docs)
    sizes = [doc.path.stat().st_size for doc in docs]
    target, held = val_fraction * sum(sizes), 0
    is_val = [False] * len(docs)
    for i in sorted(range(len(docs)), key=lambda i: _score(seed, docs[i])):
        if held >= target:
            break
        is_val[i], held = True, held + sizes[i]
    if len(docs) >= 2 and all(is_val):
        is_val[max(range(len(docs)), key=lambda i: _score(seed, docs[i]))] = False
    return is_val


def split_fractions(docs: list[Doc], val_fraction: float, seed: int) -> list[bool]:
    """Per document: True when it goes to val. ~val_fraction of docs, ≥1 each side when ≥2 docs."""
    if not docs or val_fraction <= 0:
        return [False] * len(docs)
    scores = [_score(seed, doc) for doc in docs]
    is_val = [s < val_fraction for s in scores]
    if len(docs) >= 2:
        if not any(is_val):
            is_val[min(range(len(docs)), key=scores.__getitem__)] = True
        if all(is_val):
            is_val[max(range(len(docs)), key=scores.__getitem__)] = False
    return is_val
