"""Corpus discovery and reading: which files hold documents, how they are cut into *pieces* (units of work that
``edit-train-prepare`` hands to its processes), each document's text and key, and the train/val split.

Sources: the running interpreter's standard library (the demo corpus), a file, a directory, or a glob of text
files (a file is a document), ``.jsonl`` files (a line is a document: a JSON object with a string text field)
and ``.parquet`` files (a row is a document: a string column, ``text`` by default). Every user error is a
one-line :class:`DataError` naming the file (and line or row).

A document's *key* is its file's path relative to the source's fixed directory, plus ``:LINE`` (JSONL, 1-based)
or ``#ROW`` (Parquet, 0-based); the split hashes it, so it does not depend on where the corpus lives, on the
order files are read in, or on how the work is cut into pieces.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .tokenizer import DataError

log = logging.getLogger(__name__)

_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                                   "__pycache__"})
PIECE_BYTES = 64 << 20  # work per piece: files are grouped, a JSONL file cut at line ends, Parquet by row group


def is_stdlib(source: str | None) -> bool:
    return source is None or source == "stdlib"


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Every ``*.py`` file of this interpreter's standard library, minus tests, site-packages, idlelib, lib2to3."""
    root = _stdlib_root()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found)


def kind_of(path: Path) -> str:
    """``jsonl`` | ``parquet`` | ``text``, from the file name."""
    suffix = path.suffix.lower()
    return "jsonl" if suffix == ".jsonl" else "parquet" if suffix == ".parquet" else "text"


def resolve_files(source: str | None) -> tuple[list[Path], Path]:
    """The corpus files in a deterministic order, and the directory their keys are relative to."""
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


# --------------------------------------------------------------------------------------------------- pieces
@dataclass(frozen=True)
class Piece:
    """A unit of work: ``text`` — whole files (``paths``/``keys``), each a document; ``jsonl`` — the lines of
    ``paths[0]`` in bytes ``[start, stop)`` (cut at line ends), the first of them line ``first_line``;
    ``parquet`` — row group ``start`` of ``paths[0]``, whose first row is row ``first_line`` of the file."""
    kind: str
    paths: tuple[str, ...]
    keys: tuple[str, ...]
    start: int = 0
    stop: int = 0
    first_line: int = 1
    nbytes: int = 0


def _jsonl_cuts(path: Path, piece_bytes: int) -> list[tuple[int, int, int]]:
    """``(start, stop, first line)`` byte ranges of about ``piece_bytes``, each ending after a newline (or at EOF).
    Counting the lines before each cut reads the file once (fast, in 1 MiB blocks, nothing kept)."""
    size = path.stat().st_size
    cuts, start, line = [], 0, 1
    with open(path, "rb") as fh:
        while start < size:
            stop = min(size, start + piece_bytes)
            if stop < size:
                fh.seek(stop)
                rest = fh.readline()
                stop += len(rest)
            fh.seek(start)
            newlines, left = 0, stop - start
            while left:
                block = fh.read(min(left, 1 << 20))
                newlines += block.count(b"\n")
                left -= len(block)
            cuts.append((start, stop, line))
            start, line = stop, line + newlines
    return cuts


def plan_pieces(source: str | None, piece_bytes: int = PIECE_BYTES) -> tuple[list[Piece], int]:
    """The corpus cut into pieces in document order, and how many files it has."""
    from .parquet import row_groups

    files, root = resolve_files(source)
    pieces: list[Piece] = []
    batch: list[tuple[str, str]] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            pieces.append(Piece("text", tuple(p for p, _ in batch), tuple(k for _, k in batch), nbytes=batch_bytes))
            batch, batch_bytes = [], 0

    for path in files:
        key, kind, size = path.relative_to(root).as_posix(), kind_of(path), path.stat().st_size
        if kind == "text":
            if size:
                batch.append((str(path), key))
                batch_bytes += size
                if batch_bytes >= piece_bytes:
                    flush()
            continue
        flush()
        if kind == "jsonl":
            for start, stop, line in _jsonl_cuts(path, piece_bytes):
                pieces.append(Piece("jsonl", (str(path),), (key,), start, stop, line, stop - start))
        else:
            for group, first_row, nbytes in row_groups(path):
                pieces.append(Piece("parquet", (str(path),), (key,), group, group + 1, first_row, nbytes))
    flush()
    return pieces, len(files)


# ----------------------------------------------------------------------------------------------- documents
def _utf8_error(where: str, raw: bytes, exc: UnicodeDecodeError, base: int = 0) -> DataError:
    bad = raw[exc.start : exc.start + 1].hex()
    return DataError(
        f"{where}: not valid UTF-8 (byte 0x{bad} at byte offset {base + exc.start}); convert the file to UTF-8 "
        "(e.g. iconv -f latin1 -t utf-8) or remove it from the corpus"
    )


def _jsonl_text(path: str, line_no: int, raw: bytes, base: int, column: str) -> str:
    """Parse one JSONL line into its text field (raises DataError naming file:line)."""
    want = f'each line must be a JSON object with a string "{column}" field (data.text_column)'
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _utf8_error(f"{path}:{line_no}", raw, exc, base=base) from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno}); {want}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get(column), str):
        what = "not a JSON object" if not isinstance(obj, dict) else (
            f'no "{column}" field' if column not in obj else f'"{column}" is a {type(obj[column]).__name__}, not a string'
        )
        raise DataError(f"{path}:{line_no}: {what}; {want}")
    return obj[column]


def read_piece(piece: Piece, text_column: str = "text", skip_bad_utf8: bool = False) -> Iterator[tuple[str, str]]:
    """``(key, text)`` of every non-empty document of a piece, in order."""
    if piece.kind == "text":
        for path, key in zip(piece.paths, piece.keys):
            raw = Path(path).read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if skip_bad_utf8:
                    log.warning("skipping %s: not valid UTF-8", path)
                    continue
                raise _utf8_error(path, raw, exc) from None
            if text:
                yield key, text
    elif piece.kind == "jsonl":
        path, line_no, base = piece.paths[0], piece.first_line, piece.start
        with open(path, "rb") as fh:
            fh.seek(piece.start)
            while base < piece.stop:
                raw = fh.readline()
                if not raw:
                    break
                if raw.strip():
                    text = _jsonl_text(path, line_no, raw, base, text_column)
                    if text:
                        yield f"{piece.keys[0]}:{line_no}", text
                base += len(raw)
                line_no += 1
    else:
        from .parquet import iter_texts

        for row, text in iter_texts(Path(piece.paths[0]), piece.start, piece.first_line, text_column):
            if text:
                yield f"{piece.keys[0]}#{row}", text


def split_score(key: str, seed: int) -> float:
    """A document's place in [0, 1): it goes to val when below ``val_fraction``."""
    h = hashlib.sha1(f"{seed}\0{key}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64
