"""Parquet corpora (what ``datasets`` writes and the Hub serves): a row is a document, its text one string column.

Read with ``pyarrow`` (the optional ``parquet`` extra: ``pip install 'edit-train[parquet]'``), one row group at a
time in batches, so a file of any size streams through a bounded amount of memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .tokenizer import DataError

BATCH_ROWS = 1024


def _pq() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading Parquet needs pyarrow: pip install 'edit-train[parquet]' (or pip install pyarrow)") \
            from None
    return pq


def _open(path: Path) -> Any:
    try:
        return _pq().ParquetFile(str(path))
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{path}: not a readable Parquet file ({why})") from None


def row_groups(path: Path) -> list[tuple[int, int, int]]:
    """``(row group, its first row, its compressed bytes)`` of a Parquet file (metadata only)."""
    meta = _open(path).metadata
    out, row = [], 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        out.append((g, row, int(rg.total_byte_size)))
        row += rg.num_rows
    return out


def check_column(path: Path, column: str) -> None:
    """DataError in one line unless ``column`` is a string column of ``path``."""
    import pyarrow as pa

    schema = _open(path).schema_arrow
    if column not in schema.names:
        raise DataError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)}); set data.text_column "
                        f"(edit-train-prepare --text-column) to the one that holds the text")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {column!r} holds {kind}, not strings; set data.text_column to the text column")


def iter_texts(path: Path, group: int, first_row: int, column: str) -> Iterator[tuple[int, str]]:
    """``(row number in the file, text)`` of one row group; null texts are skipped."""
    check_column(path, column)
    pf = _open(path)
    row = first_row
    for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=[column]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield row, text
            row += 1
