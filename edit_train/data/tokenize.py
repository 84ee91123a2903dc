"""Tokenizing a text corpus into a dataset directory: streaming, on all cores, resumable.

``<out>.partial/`` holds the work: ``plan.json`` (the pieces, :func:`~edit_train.data.corpus.plan_pieces`), the
token files of every piece done and its record (:mod:`edit_train.data.pieces`), and a lock. A run does the pieces
without a record (a process pool when there is more than one piece of real size, else in this process; a
standard-library family source's split is planned first, :func:`~edit_train.data.corpus.planned_sides`), applies
the split's corner cases, renames the files into ``train_00000.bin …`` order and returns the splits; the caller
writes ``meta.json`` and renames the directory into place. A stopped run (Ctrl-C, a kill, a crash) leaves the
directory for the next one; a user error (a bad file or line) removes it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

import edit_train.data.corpus as corpus
from .corpus import plan_pieces
from .pieces import SPLITS, record_path, tokenize_piece
from .tokenizer import DataError

log = logging.getLogger(__name__)
POOL_MIN_BYTES = 8 << 20  # below this much text, starting worker processes costs more than it saves


@dataclass
class Stats:
    """How a preparation went (for the progress line and benchmarks; not part of the dataset)."""
    seconds: float = 0.0
    tokens: int = 0  # tokens written by this run (resumed pieces excluded)
    bytes: int = 0  # corpus bytes read by this run
    pieces: int = 0
    resumed: int = 0  # pieces a previous run had finished
    workers: int = 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@contextmanager
def locked(work: Path) -> Iterator[None]:
    """Hold ``work/.lock`` (exclusive); while another process holds it, wait for it, saying so every 30 s.
    The lock goes with its holder: a killed preparer blocks nobody, and the next one resumes its work."""
    work.mkdir(parents=True, exist_ok=True)
    with open(work / ".lock", "a+") as fh:
        waited = time.monotonic()
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - waited >= 30:
                    log.warning("waiting for another process preparing %s (it holds %s)", work, work / ".lock")
                    waited = time.monotonic()
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _plan(work: Path, source: str | None, piece_bytes: int, fingerprint: dict[str, Any]) -> tuple[list[dict], int]:
    """The plan of an earlier run with the same settings, else a new one (an old directory's work is dropped)."""
    path = work / "plan.json"
    if path.is_file():
        try:
            plan = json.loads(path.read_text(encoding="utf-8"))
            if plan.get("fingerprint") == fingerprint:
                return plan["pieces"], int(plan["files"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        log.warning("%s: left by a preparation with other settings; starting over", work)
        for f in work.iterdir():
            if f.name != ".lock":
                f.unlink()
    pieces, n_files = plan_pieces(source, piece_bytes)
    plan = {"fingerprint": fingerprint, "files": n_files, "pieces": [asdict(p) for p in pieces]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan), encoding="utf-8")
    os.replace(tmp, path)
    return plan["pieces"], n_files


def _done(work: Path, index: int) -> dict[str, Any] | None:
    try:
        return json.loads(record_path(work, index).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _run(jobs: list[dict[str, Any]], workers: int, bar: tqdm, stats: Stats) -> dict[int, dict[str, Any]]:
    """Every job's record; a pool of ``workers`` spawned processes when that pays, else this process."""
    records: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()

    def landed(rec: dict[str, Any]) -> None:
        records[rec["index"]] = rec
        stats.tokens += sum(rec["splits"][s]["tokens"] for s in SPLITS)
        stats.bytes += rec["bytes"]
        bar.update(rec["bytes"])
        bar.set_postfix_str(f"{stats.tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tokens/s")

    size = sum(j["piece"]["nbytes"] for j in jobs)
    stats.workers = min(workers, len(jobs)) if len(jobs) > 1 and size >= POOL_MIN_BYTES else 1
    if stats.workers == 1:
        for job in jobs:
            landed(tokenize_piece(job))
        return records
    # spawn, not fork: a trainer may hold torch threads, and the lock must not leak into the workers
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(stats.workers, initializer=_quiet_worker) as pool:
        for rec in pool.imap_unordered(tokenize_piece, jobs):
            landed(rec)
    return records


def _quiet_worker() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops the pool


def tokenize_corpus(source: str | None, label: str, work: Path, job: dict[str, Any], workers: int = 0,
                    piece_bytes: int | None = None, progress: bool = True) -> tuple[dict[str, Any], Stats]:
    """Tokenize ``source`` into ``work`` (resuming what is there); returns ``(splits, stats)`` where splits is
    ``{"train": {"files", "tokens", "documents"}, "val": …, "_content_tokens": n}`` with the files renamed to
    ``{split}_{i:05d}.bin``. ``job`` holds the settings every piece shares (tokenizer, dtype, shard_tokens,
    val_fraction, seed, text_column, skip_bad_utf8). Caller holds :func:`locked`."""
    t0 = time.perf_counter()
    piece_bytes = piece_bytes or corpus.PIECE_BYTES
    fingerprint = {k: job[k] for k in sorted(job)} | {"source": label, "piece_bytes": piece_bytes}
    pieces, n_files = _plan(work, source, piece_bytes, fingerprint)
    # the side of a family source's documents is planned per family by size; any other's is decided by its hash
    sides = corpus.planned_sides(source, pieces, float(job["val_fraction"]), int(job["seed"]))
    jobs = [{**job, "piece": p, "index": i, "work": str(work), "force": {k: sides[k] for k in p["keys"] if k in sides}}
            for i, p in enumerate(pieces)]
    records = {i: r for i in range(len(jobs)) if (r := _done(work, i)) is not None}
    stats = Stats(pieces=len(jobs), resumed=len(records))
    total = sum(p["nbytes"] for p in pieces)
    with tqdm(total=total, disable=not progress, unit="B", unit_scale=True, desc="prepare", dynamic_ncols=True,
              initial=sum(records[i]["bytes"] for i in records)) as bar:
        records.update(_run([j for j in jobs if j["index"] not in records], workers or default_workers(), bar, stats))
        docs = sum(r["documents"] for r in records.values())
        if docs == 0 or sum(r["content"] for r in records.values()) == 0:
            raise DataError(f"corpus {label} contains no text ({n_files} file(s), "
                            f"{'all empty' if docs == 0 else f'{docs} document(s) produced no tokens'}); "
                            "point the source at non-empty text files")
        for index, extra in _corner_cases(records, docs, float(job["val_fraction"])):
            force = {**jobs[index]["force"], **extra.pop("force", {})}
            records[index] = tokenize_piece({**jobs[index], **extra, "force": force})
    stats.seconds = time.perf_counter() - t0
    return _finalize(work, [records[i] for i in range(len(jobs))]), stats


def _corner_cases(records: dict[int, dict[str, Any]], docs: int, val_fraction: float) -> list[tuple[int, dict]]:
    """Pieces to redo: the only document split by tokens; else at least one document on each side (the one
    with the lowest hash goes to val, or the highest to train)."""
    if docs == 1:
        return [(next(i for i, r in records.items() if r["documents"]), {"single": True})]
    if val_fraction <= 0:
        return []
    if sum(r["splits"]["val"]["documents"] for r in records.values()) == 0:
        i, r = min(((i, r) for i, r in records.items() if r["min_train"]), key=lambda x: x[1]["min_train"][0])
        return [(i, {"force": {r["min_train"][1]: "val"}})]
    if sum(r["splits"]["train"]["documents"] for r in records.values()) == 0:
        i, r = max(((i, r) for i, r in records.items() if r["max_val"]), key=lambda x: x[1]["max_val"][0])
        return [(i, {"force": {r["max_val"][1]: "train"}})]
    return []


def _finalize(work: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Rename the pieces' files into ``{split}_{i:05d}.bin`` (document order) and drop the bookkeeping."""
    splits: dict[str, Any] = {}
    for split in SPLITS:
        names = [f for r in records for f in r["splits"][split]["files"]]
        final = [f"{split}_{i:05d}.bin" for i in range(len(names))]
        for old, new in zip(names, final):
            os.replace(work / old, work / new)
        splits[split] = {"files": final, "tokens": sum(r["splits"][split]["tokens"] for r in records),
                         "documents": sum(r["splits"][split]["documents"] for r in records)}
    keep = {f for s in SPLITS for f in splits[s]["files"]} | {".lock"}
    for f in work.iterdir():
        if f.name not in keep:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    splits["_content_tokens"] = sum(r["content"] for r in records)
    return splits
