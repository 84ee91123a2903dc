"""Cross-group collectives with byte accounting, blocked-time accounting and a WAN-link model.

Every collective over the sync group (the ranks sharing a shard index across worker groups) goes
through `CrossGroupComm`, so the bytes that cross clusters are counted from the tensors actually sent,
and the simulated link (`latency + bytes / bandwidth`) is applied where a real link would be: an
asynchronous reduction only costs wall time if somebody waits for it before the link would deliver.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class LinkModel:
    """Simulated cross-cluster link: each transfer takes latency + bytes / bandwidth."""

    bandwidth_mbps: float = 0.0  # megabits per second; 0 = infinite
    latency_ms: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.bandwidth_mbps > 0 or self.latency_ms > 0

    def seconds(self, nbytes: int) -> float:
        secs = self.latency_ms / 1000.0
        if self.bandwidth_mbps > 0:
            secs += nbytes * 8 / (self.bandwidth_mbps * 1e6)
        return secs


class Pending:
    """A cross-group collective in flight. `wait()` returns the seconds this rank was blocked."""

    def __init__(self, comm: CrossGroupComm, work: Any, ready_at: float,
                 on_done: Any = None) -> None:
        self._comm, self._work, self._ready_at, self._on_done = comm, work, ready_at, on_done
        self.done = False

    def ready(self) -> bool:
        """Non-blocking: has the data landed (and would the simulated link have delivered it)?"""
        if self.done:
            return True
        finished = self._work is None or self._work.is_completed()
        return finished and time.perf_counter() >= self._ready_at

    def wait(self) -> float:
        if self.done:
            return 0.0
        t0 = time.perf_counter()
        if self._work is not None:
            self._work.wait()
        remaining = self._ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        if self._on_done is not None:
            self._on_done()
        self.done = True
        blocked = time.perf_counter() - t0
        self._comm.blocked_s += blocked
        return blocked


class CrossGroupComm:
    """Collectives over the sync group (`pg=None` and one group = a single-process no-op)."""

    def __init__(self, pg: dist.ProcessGroup | None, num_groups: int, device: torch.device,
                 link: LinkModel | None = None) -> None:
        self.pg = pg
        self.num_groups = num_groups
        self.device = device
        self.link = link or LinkModel()
        self.bytes_sent = 0
        self.blocked_s = 0.0
        self.collectives = 0
        self._link_free_at = 0.0  # transfers share the link's bandwidth: they queue behind each other

    @property
    def active(self) -> bool:
        return self.pg is not None and self.num_groups > 1

    def _account(self, nbytes: int) -> float:
        """Count the bytes; return when the simulated link delivers them (transfers queue for bandwidth)."""
        self.bytes_sent += nbytes
        self.collectives += 1
        now = time.perf_counter()
        if not self.link.enabled:
            return now
        start = max(now, self._link_free_at)
        transfer = self.link.seconds(nbytes) - self.link.latency_ms / 1000.0
        self._link_free_at = start + transfer
        return start + transfer + self.link.latency_ms / 1000.0

    def all_reduce_(self, tensors: list[torch.Tensor], async_op: bool = False) -> Pending:
        """In-place SUM all-reduce of `tensors` (flattened into one buffer, one collective)."""
        if not self.active or not tensors:
            return Pending(self, None, 0.0)
        flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
        ready_at = self._account(flat.numel() * flat.element_size())
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.pg, async_op=True)

        def unflatten() -> None:
            if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr():
                return
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n

        pending = Pending(self, work, ready_at, on_done=unflatten)
        if not async_op:
            pending.wait()
        return pending

    def all_gather(self, vec: torch.Tensor) -> torch.Tensor:
        """Blocking all-gather of a small 1-D tensor -> [num_groups, n] (row = group index)."""
        if not self.active:
            return vec.unsqueeze(0).clone()
        out = [torch.empty_like(vec) for _ in range(self.num_groups)]
        ready_at = self._account(vec.numel() * vec.element_size())
        work = dist.all_gather(out, vec.contiguous(), group=self.pg, async_op=True)
        Pending(self, work, ready_at).wait()
        return torch.stack(out)

    def all_gather_async(self, vec: torch.Tensor) -> tuple[Pending, list[torch.Tensor]]:
        if not self.active:
            return Pending(self, None, 0.0), [vec.clone()]
        out = [torch.empty_like(vec) for _ in range(self.num_groups)]
        ready_at = self._account(vec.numel() * vec.element_size())
        work = dist.all_gather(out, vec.contiguous(), group=self.pg, async_op=True)
        return Pending(self, work, ready_at), out


def shard_sum_(t: torch.Tensor, pg: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """SUM all-reduce inside a worker group (fast intra-cluster links; not accounted)."""
    if pg is not None and size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=pg)
    return t


def broadcast_json(obj: Any, src: int, device: torch.device) -> Any:
    """Broadcast a JSON-serialisable object from `src` over the default group (no pickle)."""
    payload = json.dumps(obj).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    dist.broadcast(size, src=src)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=src)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def all_gather_json(obj: Any, device: torch.device) -> list[Any]:
    """All-gather one JSON-serialisable object per rank over the default group (no pickle)."""
    payload = json.dumps(obj).encode()
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.long, device=device))
    width = int(max(int(s.item()) for s in sizes))
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    if payload:
        buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    bufs = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[:int(s.item())].cpu().tolist()).decode()) for b, s in zip(bufs, sizes)]
