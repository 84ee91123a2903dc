"""Sharded safetensors, the Hugging Face way, one tensor at a time in both directions.

A directory holds either one ``model.safetensors`` or shards ``model-0000k-of-0000n.safetensors`` listed in
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}``), as
``transformers``' ``save_pretrained`` writes them and the Hub serves them.

Memory: :class:`ShardWriter` holds at most one shard's tensors before it writes them (``safetensors`` writes
from the tensors' own memory); :func:`iter_tensors` hands out one tensor at a time, each from its own mapping of
the file, released when the caller lets the tensor go. So writing a directory costs about one shard above what
the caller keeps, and reading it about one tensor. Nothing unpickles.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' customary 5GB shards
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``5000000``, ``"5GB"``, ``"500MB"``, ``"2GiB"`` -> bytes (ValueError naming the value otherwise)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = _SIZE_RE.match(str(size))
        unit = m.group(2).upper() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(f"shard size {size!r}: give bytes or a size such as 5GB, 500MB or 2GiB")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise ValueError(f"shard size {size!r}: must be at least 1 byte")
    return n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ShardWriter:
    """Collects tensors into shards of at most ``max_bytes`` (a bigger tensor gets a shard of its own), writing
    each shard as soon as the next tensor would not fit. :meth:`close` names the files and writes the index
    (or, for a single shard, just ``model.safetensors``), and returns the file names."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | str = DEFAULT_SHARD_BYTES,
                 metadata: Mapping[str, str] | None = None) -> None:
        self.dir = Path(directory)
        self.max_bytes = parse_size(max_bytes)
        self.metadata = {"format": "pt", **dict(metadata or {})}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names of every written shard, in order
        self.total_bytes = 0
        self._names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        self._names.add(name)
        size = _nbytes(tensor)
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().cpu().contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        save_file(self._pending, str(self.dir / f".shard-{len(self._shards):05d}.safetensors"), metadata=self.metadata)
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        names = [WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.replace(self.dir / f".shard-{i:05d}.safetensors", self.dir / name)
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {t: names[i] for i, shard in enumerate(self._shards) for t in shard}}
            (self.dir / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            names.append(WEIGHTS_INDEX_NAME)
        return names


def weight_files(directory: str | os.PathLike[str]) -> tuple[dict[Path, list[str]], Path]:
    """{file: tensor names in it} of a directory (one ``model.safetensors`` or the shards its index lists),
    and the file that says so (for messages). Reads headers only. ValueError naming the file when unusable."""
    d = Path(directory)
    single, index = d / WEIGHTS_NAME, d / WEIGHTS_INDEX_NAME
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {single: list(f.keys())}, single
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types; nothing else is parsed
            raise ValueError(f"{single}: not a valid safetensors file ({_why(exc)})") from None
    if not index.is_file():
        raise ValueError(f"{single}: not found (nor {index.name}); expected a Hugging Face BailingMoe directory")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: unreadable index ({exc})") from None
    files: dict[Path, list[str]] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or "/" in file or "\\" in file or file.startswith("."):
            raise ValueError(f"{index}: shard name {file!r} must be a file in {d}")
        files.setdefault(d / file, []).append(name)
    for f in files:
        if not f.is_file():
            raise ValueError(f"{f}: listed in {index.name} but missing")
    return files, index


def _why(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def header_shapes(files: Mapping[Path, list[str]]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from the files' headers (no tensor data is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path, names in files.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                have = set(f.keys())
                for name in names:
                    if name not in have:
                        raise ValueError(f"{path}: no tensor {name!r}, which the index puts there")
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{path}: not a valid safetensors file ({_why(exc)})") from None
    return shapes


def iter_tensors(files: Mapping[Path, list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every listed tensor, file by file. Each tensor is read through its own short-lived
    ``safe_open``: safetensors maps the file and the tensor it hands out lives in that mapping, whose pages stay
    resident until the file is closed, so one open per tensor keeps at most one tensor's pages (not a whole
    shard's) in memory once the caller has copied it and let it go."""
    for path, names in files.items():
        for name in names:
            try:
                with safe_open(str(path), framework="pt") as f:
                    t = f.get_tensor(name)
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types; nothing else is parsed
                raise ValueError(f"{path}: not a valid safetensors file ({_why(exc)})") from None
            yield name, t
            del t
