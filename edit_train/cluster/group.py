"""The ranks of one cluster and what they do together over the cluster's fast links (the core's
`ClusterGroup`). Nothing here crosses clusters or is counted as cross-cluster bytes. JSON and raw bytes
only: no pickle. A cluster of one rank makes every call local."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from edit_train.local_sgd.errors import ClusterError


class RankGroup:
    """One cluster's ranks (`pg` None: a lone rank). Every collective ends within `timeout_s` (the group's
    own timeout, `cluster.timeout_s`): past it, or when a rank died, `ClusterError` says which call waited."""

    def __init__(self, pg: dist.ProcessGroup | None = None, rank: int = 0, size: int = 1,
                 device: torch.device | None = None, timeout_s: float = 600.0) -> None:
        self.pg, self.rank, self.size = pg, rank, size
        self.device = device or torch.device("cpu")
        self.timeout_s = timeout_s

    @property
    def _many(self) -> bool:
        return self.pg is not None and self.size > 1

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            if isinstance(exc, ClusterError):
                raise
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            who = "its leader (rank 0)" if what.startswith("broadcast") else "a rank of this cluster"
            raise ClusterError(f"cluster {what} across {self.size} ranks did not complete within "
                               f"{self.timeout_s:g} s (cluster.timeout_s): {who} died or stalled ({why})") from None

    def _reduce(self, t: Tensor, op: dist.ReduceOp.RedOpType) -> Tensor:
        if self._many:
            with self._guard("all-reduce"):
                dist.all_reduce(t, op=op, group=self.pg)
        return t

    def agree(self, ok: bool) -> bool:
        """True only if every rank says ok (every rank takes the same branch)."""
        if not self._many:
            return ok
        return bool(self._reduce(torch.tensor([1.0 if ok else 0.0], device=self.device), dist.ReduceOp.MIN).item() > 0)

    def sum_(self, t: Tensor) -> Tensor:
        return self._reduce(t, dist.ReduceOp.SUM)

    def max_(self, t: Tensor) -> Tensor:
        return self._reduce(t, dist.ReduceOp.MAX)

    def all_gather(self, t: Tensor) -> Tensor:
        """[ranks, *t.shape]: every rank's `t`, in rank order."""
        if not self._many:
            return t.unsqueeze(0).clone()
        outs = [torch.empty_like(t) for _ in range(self.size)]
        with self._guard("all-gather"):
            dist.all_gather(outs, t.contiguous(), group=self.pg)
        return torch.stack(outs)

    def broadcast_(self, t: Tensor) -> Tensor:
        """The leader's (rank 0's) tensor, in place on every rank."""
        if self._many:
            with self._guard("broadcast"):
                dist.broadcast(t, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return t

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """The leader's (rank 0's) bytes on every rank."""
        if not self._many:
            assert payload is not None
            return payload
        n = self.broadcast_(torch.tensor([len(payload) if payload is not None else 0], dtype=torch.long,
                                         device=self.device))
        buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=self.device)
        if payload is not None and self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return bytes(self.broadcast_(buf).cpu().numpy().tobytes())

    def broadcast_json(self, obj: Any) -> Any:
        """A JSON-serialisable object from the leader."""
        payload = json.dumps(obj).encode() if obj is not None or self.rank == 0 else None
        return json.loads(self.broadcast_bytes(payload).decode())

    def all_gather_json(self, obj: Any) -> list[Any]:
        """One JSON-serialisable object per rank."""
        if not self._many:
            return [obj]
        payload = json.dumps(obj).encode()
        sizes = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(self.size)]
        with self._guard("all-gather"):
            dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.long, device=self.device),
                            group=self.pg)
        width = int(max(int(s.item()) for s in sizes))
        buf = torch.zeros(width, dtype=torch.uint8, device=self.device)
        if payload:
            buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        bufs = [torch.zeros(width, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        with self._guard("all-gather"):
            dist.all_gather(bufs, buf, group=self.pg)
        return [json.loads(bytes(b[:int(s.item())].cpu().numpy().tobytes()).decode()) for b, s in zip(bufs, sizes)]

    def full(self, local: Tensor, like: Tensor | None) -> Tensor:
        """The whole tensor of which `local` is this rank's FSDP2 shard (`like`: the sharded parameter)."""
        if like is not None and hasattr(like, "device_mesh"):
            from torch.distributed.tensor import DTensor

            dt = DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape,
                                    stride=like.stride(), run_check=False)
            with self._guard("all-gather of a sharded tensor"):
                return dt.full_tensor()
        return local

    def shard(self, full: Tensor, like: Tensor) -> Tensor:
        """This rank's FSDP2 shard (torch.chunk of dim 0) of a whole tensor shaped like `like`'s shard."""
        if tuple(full.shape) == tuple(like.shape):
            return full
        part = torch.chunk(full, self.size, dim=0)[self.rank] if full.dim() > 0 else full
        if tuple(part.shape) != tuple(like.shape):
            raise ValueError(f"a tensor of shape {tuple(full.shape)} does not shard to {tuple(like.shape)}")
        return part


def local_tensor(t: Tensor) -> Tensor:
    """The rank-local shard of a (possibly DTensor) parameter or state tensor."""
    return t.to_local() if hasattr(t, "to_local") else t
