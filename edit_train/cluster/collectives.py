"""Collectives inside one cluster (its fast links). Nothing here crosses clusters; none of it is
counted as cross-cluster bytes. JSON and raw bytes only: no pickle."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def shard_sum_(t: torch.Tensor, pg: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """SUM all-reduce inside the cluster."""
    if pg is not None and size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=pg)
    return t


def broadcast_bytes(payload: bytes | None, pg: dist.ProcessGroup | None, size: int,
                    device: torch.device) -> bytes:
    """Broadcast bytes from the cluster's rank 0 to its other ranks (the payload of rank 0 wins)."""
    if pg is None or size <= 1:
        assert payload is not None
        return payload
    src = dist.get_global_rank(pg, 0)
    n = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.long, device=device)
    dist.broadcast(n, src=src, group=pg)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=device)
    if payload is not None and dist.get_rank() == src:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=src, group=pg)
    return bytes(buf.cpu().numpy().tobytes())


def broadcast_json(obj: Any, pg: dist.ProcessGroup | None, size: int, device: torch.device) -> Any:
    """Broadcast a JSON-serialisable object from the cluster's rank 0."""
    payload = json.dumps(obj).encode() if obj is not None else None
    return json.loads(broadcast_bytes(payload, pg, size, device).decode())


def all_gather_json(obj: Any, pg: dist.ProcessGroup | None, size: int, device: torch.device) -> list[Any]:
    """All-gather one JSON-serialisable object per rank of the cluster."""
    if pg is None or size <= 1:
        return [obj]
    payload = json.dumps(obj).encode()
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(size)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.long, device=device), group=pg)
    width = int(max(int(s.item()) for s in sizes))
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    if payload:
        buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    bufs = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(bufs, buf, group=pg)
    return [json.loads(bytes(b[:int(s.item())].cpu().numpy().tobytes()).decode()) for b, s in zip(bufs, sizes)]


def group_max(values: list[float], pg: dist.ProcessGroup | None, size: int, device: torch.device) -> list[float]:
    if pg is None or size <= 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return t.cpu().tolist()
