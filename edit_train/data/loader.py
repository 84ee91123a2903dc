"""Memory-mapped token datasets and a resumable, partitioned loader of packed sequences.

The token stream of a split is cut into non-overlapping windows of ``seq_len + 1`` tokens
(window ``w`` = ``tokens[w*seq_len : w*seq_len + seq_len + 1]``; consecutive windows share one boundary token,
so every token is a label exactly once). Each epoch the window indices are permuted (seeded by ``seed`` and
the epoch) and part ``p`` of ``num_parts`` takes ``perm[p::num_parts]``: parts see disjoint windows. All parts
have the same number of batches per epoch, so they advance in lock-step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from .prepare import SPLITS, read_meta, shard_span
from .tokenizer import DataError

__all__ = ["TokenDataset", "TokenLoader", "eval_batches", "interleaved_windows"]

_STATE_VERSION = 1


class TokenDataset:
    """The tokens of one split of a prepared dataset, memory-mapped read-only across its shard files."""

    def __init__(self, data_dir: str | os.PathLike[str], split: str) -> None:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        self.data_dir = Path(data_dir)
        self.split = split
        self.meta: dict[str, Any] = read_meta(self.data_dir)
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self.vocab_size: int = int(self.meta["vocab_size"])
        self.eos_id: int | None = self.meta.get("eos_id")
        self._shards: list[np.memmap] = []
        for entry in self.meta["splits"][split]["files"]:
            path, start, stop = shard_span(self.data_dir, entry)
            count = (path.stat().st_size // self.dtype.itemsize if stop is None else stop) - start
            if count == 0:
                continue
            self._shards.append(np.memmap(path, dtype=self.dtype, mode="r", offset=start * self.dtype.itemsize,
                                          shape=(count,)))
        sizes = np.array([len(s) for s in self._shards], dtype=np.int64)
        # _starts[i] = global index of shard i's first token; _starts[-1] = total tokens
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.tokens: int = int(self._starts[-1])

    def __len__(self) -> int:
        return self.tokens

    def get(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split's stream as int64 (reads across shard boundaries)."""
        if not 0 <= start <= stop <= self.tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.tokens})")
        out = np.empty(stop - start, dtype=np.int64)
        pos = start
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while pos < stop:
            shard_lo = int(self._starts[i])
            take = min(stop, int(self._starts[i + 1])) - pos
            out[pos - start : pos - start + take] = self._shards[i][pos - shard_lo : pos - shard_lo + take]
            pos += take
            i += 1
        return out

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.data_dir)!r}, {self.split!r}, tokens={self.tokens})"


def _num_windows(tokens: int, seq_len: int) -> int:
    return max(0, (tokens - 1) // seq_len) if tokens > seq_len else 0


def _check_shape(batch_size: int, seq_len: int, part: int, num_parts: int) -> None:
    if batch_size < 1:
        raise DataError(f"batch_size must be ≥ 1, got {batch_size}")
    if seq_len < 1:
        raise DataError(f"seq_len must be ≥ 1, got {seq_len}")
    if num_parts < 1 or not 0 <= part < num_parts:
        raise DataError(f"data part {part} is not in [0, num_parts={num_parts})")


class TokenLoader:
    """Packed ``[batch_size, seq_len]`` input/label batches for one part of the data, resumable exactly.

    ``part`` / ``num_parts``: the trainer passes ``part = index * ranks + rank`` and
    ``num_parts = count * ranks`` so every rank sees different windows.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        split: str,
        batch_size: int,
        seq_len: int,
        part: int = 0,
        num_parts: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        _check_shape(batch_size, seq_len, part, num_parts)
        self.dataset = TokenDataset(data_dir, split)
        self.split = split
        self.batch_size, self.seq_len = int(batch_size), int(seq_len)
        self.part, self.num_parts = int(part), int(num_parts)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.num_windows = _num_windows(self.dataset.tokens, self.seq_len)
        need = self.num_parts * self.batch_size
        if self.num_windows < need:
            raise DataError(
                f"corpus too small for batch_size × seq_len × world; split {split!r} of {self.dataset.data_dir} "
                f"has {self.dataset.tokens} tokens = {self.num_windows} windows of seq_len+1={self.seq_len + 1}, "
                f"but batch_size={self.batch_size} × parts={self.num_parts} needs {need} "
                f"(≥ {need * self.seq_len + 1} tokens); use a larger corpus or reduce batch_size/seq_len"
            )
        #: batches per epoch, identical for every part
        self.batches_per_epoch = (self.num_windows // self.num_parts) // self.batch_size
        self.epoch = 0
        self.cursor = 0  # index of the next batch within the epoch
        self._perm_epoch: int | None = None
        self._part_windows: np.ndarray | None = None

    # -- windows ------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.dataset.vocab_size

    def epoch_windows(self, epoch: int) -> np.ndarray:
        """The window indices this part visits in ``epoch``, in order (only full batches)."""
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            perm = rng.permutation(self.num_windows)
        else:
            perm = np.arange(self.num_windows)
        return perm[self.part :: self.num_parts][: self.batches_per_epoch * self.batch_size]

    def _windows_for_epoch(self) -> np.ndarray:
        if self._perm_epoch != self.epoch or self._part_windows is None:
            self._part_windows = self.epoch_windows(self.epoch)
            self._perm_epoch = self.epoch
        return self._part_windows

    def _gather(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.seq_len
        rows = np.stack([self.dataset.get(int(w) * t, int(w) * t + t + 1) for w in windows])
        data = torch.from_numpy(rows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    # -- iteration ----------------------------------------------------------------------------------------------

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs, labels)``, both int64 ``[batch_size, seq_len]``; labels are inputs shifted by one."""
        if self.cursor >= self.batches_per_epoch:
            self.epoch += 1
            self.cursor = 0
        windows = self._windows_for_epoch()
        b = self.batch_size
        batch = windows[self.cursor * b : (self.cursor + 1) * b]
        self.cursor += 1
        return self._gather(batch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    # -- resumption ---------------------------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        """What a saved position is only valid for (``part`` is deliberately not part of it)."""
        return {
            "split": self.split,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_parts": self.num_parts,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "tokens": self.dataset.tokens,
            "tokenizer_id": str(self.dataset.meta["tokenizer_id"]),
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: restoring it makes the next batch identical to this loader's next one."""
        return {
            "version": _STATE_VERSION,
            "epoch": int(self.epoch),
            "cursor": int(self.cursor),
            "part": self.part,
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            epoch, cursor, fp = int(state["epoch"]), int(state["cursor"]), dict(state["fingerprint"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(
                f"data loader state is malformed ({exc!r}); expected keys epoch, cursor, fingerprint"
            ) from None
        mine = self.fingerprint()
        diff = {k: (fp.get(k), v) for k, v in mine.items() if fp.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise DataError(f"data loader state does not match this loader ({detail}); resume with the same data "
                            "and batch settings or start a fresh run")
        if epoch < 0 or not 0 <= cursor <= self.batches_per_epoch:
            raise DataError(f"data loader state has an invalid position (epoch={epoch}, cursor={cursor})")
        self.epoch, self.cursor = epoch, cursor


def interleaved_windows(counts: list[int], limit: int) -> list[tuple[int, int]]:
    """The first `limit` of (dataset, window) pairs taken from datasets holding `counts` windows in turn:
    window 0 of each, then window 1 of each, ...; a dataset that runs out is skipped."""
    out: list[tuple[int, int]] = []
    w = 0
    while len(out) < limit and w < max(counts, default=0):
        out.extend((d, w) for d, c in enumerate(counts) if w < c)
        w += 1
    return out[:limit]


def eval_batches(
    data_dir: str | os.PathLike[str] | list[str | os.PathLike[str]],
    batch_size: int,
    seq_len: int,
    max_batches: int,
    part: int = 0,
    num_parts: int = 1,
    split: str = "val",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic evaluation batches: the first windows of ``split`` (no shuffle), part ``p`` taking every
    ``num_parts``-th one. Every part gets the same number of batches; the last one may be smaller than
    ``batch_size`` when the split is small. Raises :class:`DataError` when there is not one window per part.

    A list of dataset directories is one validation set drawn from all of them: their windows in turn (the
    first window of each, then the second of each, ...); a list of one is the same as that directory.
    """
    _check_shape(batch_size, seq_len, part, num_parts)
    if max_batches < 1:
        return []
    dirs = list(data_dir) if isinstance(data_dir, (list, tuple)) else [data_dir]
    sets = [TokenDataset(d, split) for d in dirs]
    counts = [_num_windows(ds.tokens, seq_len) for ds in sets]
    per_part = sum(counts) // num_parts
    if per_part == 0:
        where = ", ".join(str(d) for d in dirs)
        raise DataError(
            f"{split} split of {where} has {sum(ds.tokens for ds in sets)} tokens, fewer than one window of "
            f"seq_len+1={seq_len + 1} per part ({num_parts} parts); prepare with a larger val_fraction, use a larger "
            "corpus or reduce seq_len"
        )
    per_part = min(per_part, max_batches * batch_size)
    mine = interleaved_windows(counts, per_part * num_parts)[part::num_parts][:per_part]
    out = []
    for i in range(0, per_part, batch_size):
        rows = np.stack([sets[d].get(w * seq_len, w * seq_len + seq_len + 1) for d, w in mine[i : i + batch_size]])
        data = torch.from_numpy(rows)
        out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return out
