"""``edit-train-prepare``: turn a corpus into token shards (the trainer also does this on first use).

Streams a corpus of any size on every core (``--workers``), shows a progress bar, and resumes where a stopped run
left off (run the same command again); the last line says how many tokens per second it tokenized."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

from edit_train.data import DataError, dataset_key, default_cache_dir, prepare_with_stats
from edit_train.data.prepare import DEFAULT_VAL_FRACTION


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edit-train-prepare",
        description="Tokenize a corpus into memory-mapped train/val token shards.",
    )
    p.add_argument("source", nargs="?", default="stdlib",
                   help="'stdlib' (default: this Python's standard library), 'stdlib:<family>[+<family>]' (some of its "
                        "package families: net, systems, dev, core, or all), a file, a directory, a glob "
                        "(quote it) of text files, .jsonl files (a string field per line) or .parquet files (a "
                        "string column), or pre-tokenized token files with --token-dtype")
    p.add_argument("--out", default=None,
                   help="output directory (default: the trainer's cache, $EDIT_TRAIN_CACHE or ~/.cache/edit-train)")
    p.add_argument("--cache-dir", default=None, help="cache root used when --out is not given (edit-train's "
                   "data.cache_dir; default $EDIT_TRAIN_CACHE or ~/.cache/edit-train)")
    p.add_argument("--tokenizer", default="byte", help="'byte' (default) or the path to a HuggingFace tokenizer.json")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                   help=f"fraction of documents held out (default {DEFAULT_VAL_FRACTION}, as edit-train's "
                        "data.val_fraction: the split is part of the cache key)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default 0)")
    p.add_argument("--text-column", default="text", help="the text field of .jsonl lines / text column of .parquet "
                   "files (edit-train's data.text_column; default text)")
    p.add_argument("--token-dtype", default=None, choices=["uint16", "uint32"],
                   help="the source is pre-tokenized flat token files of this dtype, made by --tokenizer (edit-train's "
                        "data.token_dtype); they are checked and used in place, not copied")
    p.add_argument("--workers", type=int, default=0, help="processes tokenizing at once (default 0: every core)")
    p.add_argument("--shard-tokens", type=int, default=16_000_000, help="max tokens per shard file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    try:
        extra = {"text_column": args.text_column, "token_dtype": args.token_dtype, "workers": args.workers}
        if args.out is None:
            out = Path(args.cache_dir or default_cache_dir()).expanduser() / "data" / dataset_key(
                args.source, args.tokenizer, args.val_fraction, args.seed, args.text_column, args.token_dtype)
        else:
            out = Path(args.out)
        meta, stats = prepare_with_stats(args.source, out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                                         shard_tokens=args.shard_tokens, seed=args.seed, progress=not args.quiet,
                                         **extra)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("error: interrupted; run the same command again to resume where it stopped", file=sys.stderr)
        raise SystemExit(130) from None
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    how = "cached" if stats is None and "format" not in meta else "pre-tokenized, used in place" if stats is None else (
        f"{stats.tokens_per_s:,.0f} tokens/s on {stats.workers} process{'es' if stats.workers > 1 else ''}"
        + (f", {stats.resumed} of {stats.pieces} pieces resumed" if stats.resumed else ""))
    print(f"{out}: train {tr['tokens']} tokens ({tr['documents']} docs, {len(tr['files'])} shards), "
          f"val {va['tokens']} tokens ({va['documents']} docs); vocab {meta['vocab_size']} {meta['dtype']}, "
          f"tokenizer {meta['tokenizer']} [{time.perf_counter() - t0:.1f}s, {how}]")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
