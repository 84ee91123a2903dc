"""Data: tokenizers, corpus preparation into memory-mapped token shards, and a resumable loader.

Typical use (what the trainer does)::

    data_dir = ensure_dataset("stdlib", "byte", min_tokens=batch_size * (seq_len + 1))
    loader = TokenLoader(data_dir, "train", batch_size, seq_len, part=rank, num_parts=world_size, seed=seed)
    x, y = loader.next_batch()
"""

from .tokenizer import ByteTokenizer, DataError, HFTokenizer, load_tokenizer, tokenizer_id
from .prepare import (
    prepare_with_stats,
    dataset_key,
    default_cache_dir,
    dtype_for_vocab,
    ensure_dataset,
    prepare_corpus,
    read_meta,
    stdlib_files,
)

_LAZY = {"TokenDataset", "TokenLoader", "eval_batches"}  # loader imports torch; keep `edit-train-prepare` light


def __getattr__(name: str):
    if name in _LAZY:
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DataError",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "tokenizer_id",
    "prepare_corpus",
    "prepare_with_stats",
    "ensure_dataset",
    "default_cache_dir",
    "dataset_key",
    "dtype_for_vocab",
    "read_meta",
    "stdlib_files",
    "TokenDataset",
    "TokenLoader",
    "eval_batches",
]
