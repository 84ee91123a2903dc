"""``edit-train-prepare``: turn a corpus into token shards (the trainer also does this on first use)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

from edit_train.data import DataError, ensure_dataset, prepare_corpus, read_meta
from edit_train.data.prepare import DEFAULT_VAL_FRACTION


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edit-train-prepare",
        description="Tokenize a corpus into memory-mapped train/val token shards.",
    )
    p.add_argument("source", nargs="?", default="stdlib",
                   help="'stdlib' (default: this Python's standard library), 'stdlib:<family>[+<family>]' (some of its "
                        "package families: net, systems, dev, core, or all), a file, a directory, a glob "
                        "(quote it), or .jsonl files with a string \"text\" field per line")
    p.add_argument("--out", default=None,
                   help="output directory (default: the trainer's cache, $EDIT_TRAIN_CACHE or ~/.cache/edit-train)")
    p.add_argument("--cache-dir", default=None, help="cache root used when --out is not given (edit-train's "
                   "data.cache_dir; default $EDIT_TRAIN_CACHE or ~/.cache/edit-train)")
    p.add_argument("--tokenizer", default="byte", help="'byte' (default) or the path to a HuggingFace tokenizer.json")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                   help=f"fraction of documents held out (default {DEFAULT_VAL_FRACTION}, as edit-train's "
                        "data.val_fraction: the split is part of the cache key)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default 0)")
    p.add_argument("--shard-tokens", type=int, default=16_000_000, help="max tokens per shard file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    try:
        if args.out is None:
            out = ensure_dataset(args.source, args.tokenizer, cache_dir=args.cache_dir, val_fraction=args.val_fraction,
                                 seed=args.seed, shard_tokens=args.shard_tokens, progress=not args.quiet)
            meta = read_meta(out)
        else:
            out = Path(args.out)
            meta = prepare_corpus(args.source, out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                                  shard_tokens=args.shard_tokens, seed=args.seed, progress=not args.quiet)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    print(f"{out}: train {tr['tokens']} tokens ({tr['documents']} docs, {len(tr['files'])} shards), "
          f"val {va['tokens']} tokens ({va['documents']} docs); vocab {meta['vocab_size']} {meta['dtype']}, "
          f"tokenizer {meta['tokenizer']} [{time.perf_counter() - t0:.1f}s]")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
