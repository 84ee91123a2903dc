"""Corpus discovery and reading: which files hold documents, how they are cut into *pieces* (units of work that
``edit-train-prepare`` hands to its processes), each document's text and key, and the train/val split.

Sources: the running interpreter's standard library (the demo corpus) or some of its package families
(``stdlib:<family>[+...]``, :mod:`edit_train.data.families`), a file, a directory, or a glob of text
files (a file is a document), ``.jsonl`` files (a line is a document: a JSON object with a string text field)
and ``.parquet`` files (a row is a document: a string column, ``text`` by default). Every user error is a
one-line :class:`DataError` naming the file (and line or row).

A document's *key* is its file's path relative to the source's fixed directory, plus ``:LINE`` (JSONL, 1-based)
or ``#ROW`` (Parquet, 0-based); the split hashes it, so it does not depend on where the corpus lives, on the
order files are read in, or on how the work is cut into pieces. A family source's split is planned per family
by size before tokenizing (`planned_sides`), so a document is on the same side in every source that holds it.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .families import family_files, family_of, is_family_source, stdlib_root
from .languages import is_language_source, language_of, source_files
from .tokenizer import DataError

log = logging.getLogger(__name__)

_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                                   "__pycache__"})
PIECE_BYTES = 64 << 20  # work per piece: files are grouped, a JSONL file cut at line ends, Parquet by row group


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


def kind_of(path: Path) -> str:
    """``jsonl`` | ``parquet`` | ``text``, from the file name."""
    suffix = path.suffix.lower()
    return "jsonl" if suffix == ".jsonl" else "parquet" if suffix == ".parquet" else "text"


def resolve_files(source: str | None) -> tuple[list[Path], Path]:
    """The corpus files in a deterministic order, and the directory their keys are relative to."""
    if is_family_source(source):
        assert source is not None
        return family_files(source), _stdlib_root()
    if is_language_source(source):
        assert source is not None
        files = [Path(os.path.abspath(p)) for p in source_files(source)]
        if not files:
            raise DataError(f"data {source}: none of its files are on this machine (edit_train/data/languages.py)")
        return files, Path("/")
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
            if path.endswith(".gz"):  # a gzipped manual page (lang:man)
                try:
                    raw = gzip.decompress(raw)
                except (OSError, EOFError) as exc:
                    if skip_bad_utf8:
                        log.info("skipping %s: not a readable gzip file (%s)", path, exc)
                        continue
                    raise DataError(f"{path}: not a readable gzip file ({exc})") from None
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if skip_bad_utf8:
                    log.info("skipping %s: not valid UTF-8", path)  # the stdlib's deliberately mis-encoded tests
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


# ------------------------------------------------------------------------------------------------- the split
def split_score(key: str, seed: int) -> float:
    """A document's place in [0, 1): it goes to val when below ``val_fraction`` (unless `planned_sides` says)."""
    h = hashlib.sha1(f"{seed}\0{key}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


# Below this many expected validation documents (documents x val_fraction) a split by each document's hash is
# mostly luck (a 40-file corpus at 0.02 expects 0.8: one forced document, maybe 0.4 % of the tokens), so a corpus
# of whole-file documents this small is split by size instead: its validation holds val_fraction of the bytes.
SMALL_CORPUS_VAL_DOCS = 20.0


def planned_sides(source: str | None, pieces: list[dict], val_fraction: float, seed: int) -> dict[str, str]:
    """``{key: "train" | "val"}`` for the documents whose side is decided over their whole source before any is
    tokenized: a standard-library family source (``pieces``: its text pieces, as dicts) splits each family on its
    own by size (`split_by_size`), so every source holding a document puts it on the same side (``stdlib:net+
    systems``'s val is exactly ``stdlib:net``'s and ``stdlib:systems``'s); a small corpus of text files (fewer
    than ``SMALL_CORPUS_VAL_DOCS / val_fraction`` of them) is split by size as a whole, said in one line. Empty
    for any other source: each document's `split_score` decides as it is read."""
    if not is_family_source(source) and not is_language_source(source):
        return small_corpus_sides(source, pieces, val_fraction, seed)
    group_of = language_of if is_language_source(source) else family_of
    by_family: dict[str, list[tuple[str, int]]] = {}
    for piece in pieces:
        for path, key in zip(piece["paths"], piece["keys"]):
            by_family.setdefault(group_of(key), []).append((key, os.path.getsize(path)))
    sides: dict[str, str] = {}
    for docs in by_family.values():
        sides.update(split_by_size(docs, val_fraction, seed))
    return sides


def small_corpus_sides(source: str | None, pieces: list[dict], val_fraction: float, seed: int) -> dict[str, str]:
    """A small corpus of text files: split by size (validation = val_fraction of its bytes, at least one
    document), with one line saying so; empty for a larger one or one of JSONL / Parquet rows."""
    if val_fraction <= 0 or not pieces or any(p.get("kind") != "text" for p in pieces):
        return {}
    docs = [(key, os.path.getsize(path)) for p in pieces for path, key in zip(p["paths"], p["keys"])]
    if len(docs) < 2 or len(docs) * val_fraction >= SMALL_CORPUS_VAL_DOCS:
        return {}
    sides = split_by_size(docs, val_fraction, seed)
    val = [size for key, size in docs if sides[key] == "val"]
    log.info("corpus %s: %d documents are too few to split by hash at val_fraction=%g: validation is the %d "
             "document(s) holding %.1f%% of its bytes", source, len(docs), val_fraction, len(val),
             100 * sum(val) / max(sum(size for _, size in docs), 1))
    return sides


def split_by_size(docs: list[tuple[str, int]], val_fraction: float, seed: int) -> dict[str, str]:
    """The side of each ``(key, bytes)`` document: in the order of their `split_score` documents go to val until
    they hold val_fraction of the bytes (a family of a few hundred files split by count alone can end up with one
    small file of val); ≥1 each side when ≥2 docs."""
    sides = {key: "train" for key, _ in docs}
    if not docs or val_fraction <= 0:
        return sides
    ranked = sorted(docs, key=lambda d: split_score(d[0], seed))
    target, held = val_fraction * sum(size for _, size in docs), 0
    for key, size in ranked:
        if held >= target:
            break
        sides[key], held = "val", held + size
    if len(docs) >= 2 and "train" not in sides.values():
        sides[ranked[-1][0]] = "train"
    return sides
