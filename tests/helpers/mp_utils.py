"""Run a function on N gloo ranks on 127.0.0.1 (a free port each time); results come back as JSON."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """`fn(rank, world, *args)` must be a module-level function returning something JSON-serialisable."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(world, free_port(), out, fn, args), nprocs=world, join=True,
                           start_method="spawn")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def _solo_entry(rank: int, world: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(fn(rank, world, *args)))


def run_processes(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """`fn(rank, world, *args)` in `world` processes with no torch.distributed world among them (each is a
    cluster of its own); results come back as JSON."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_solo_entry, args=(world, out, fn, args), nprocs=world, join=True, start_method="spawn")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
