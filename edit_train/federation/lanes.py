"""Cross-cluster process groups for one quorum: torchft's reconfigurable gloo groups, one per *lane*.

Layout is by unit, not by rank. A unit's pseudo-gradient is cut into the federation's `chunks` fixed
pieces; cluster c hands chunk j to its rank `j % size_c`; lane j is the group of chunk j's owners, one
rank per participating cluster (its rank in the lane = the cluster's position in the sorted quorum).
When every cluster has the same size the federation pairs rank r with rank r instead (lane r), so each
rank reduces its own FSDP shard in place with no resharding (the cheaper layout).

Lane 0 always joins the cluster leaders: it carries the small control exchanges (norms, votes) and healing.
Gloo over TCP with tensors staged on CPU, so clusters of different accelerators can sync.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor
from torchft.process_group import ProcessGroupGloo

from edit_train.local_sgd.errors import FederationError
from edit_train.local_sgd.protocols import Quorum

log = logging.getLogger(__name__)


class Work(Protocol):
    """A collective in flight on a lane (torch's `Work`)."""

    def is_completed(self) -> bool: ...

    def wait(self) -> Any: ...


class LaneGroup(Protocol):
    """One lane's process group for one quorum: what the transport and `compressed_reduce` call on it. torchft's
    reconfigurable gloo group (`BoundGloo`) across hosts; `inproc.ThreadGroup` between threads."""

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None: ...

    def abort(self, errored: bool = False) -> None: ...

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def allreduce(self, tensors: list[Tensor], opts: Any) -> Work: ...

    def allgather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> Work: ...

    def alltoall_base(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int],
                      opts: Any = None) -> Work: ...

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> Work: ...

    def recv(self, tensors: list[Tensor], src: int, tag: int) -> Work: ...


class BoundGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, listening on one address (`host`) instead of whatever the
    hostname resolves to, so a local run keeps every socket on 127.0.0.1."""

    def __init__(self, host: str, timeout: datetime.timedelta) -> None:
        super().__init__(timeout=timeout)
        self._host = host

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        from torch.distributed import ProcessGroup as BaseProcessGroup
        from torch.distributed.distributed_c10d import ProcessGroupGloo as BaseGloo

        opts = BaseGloo._Options()
        opts._timeout = self._timeout
        opts._devices = [BaseGloo.create_device(hostname=self._host)]
        backend = BaseGloo(store, rank, world_size, opts)
        backend._set_sequence_number_for_group()
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.GLOO, backend)
        if torch.cuda.is_available():
            pg._register_backend(torch.device("cuda"), BaseProcessGroup.BackendType.GLOO, backend)
        return pg


def lanes_of(rank: int, size: int, quorum: Quorum, chunks: int) -> list[int]:
    """The lanes this rank takes part in."""
    if quorum.paired:
        return [rank]
    return [j for j in range(chunks) if j % size == rank]


class Lanes:
    """The configured lane groups of this rank for the current quorum. `make_group()` builds one
    reconfigurable group (torchft's `configure(store_addr, replica_id, rank, world_size)` / `abort()`):
    gloo over TCP here, threads in `federation.inproc`."""

    def __init__(self, make_group: Callable[[], LaneGroup]) -> None:
        self.make_group = make_group
        self.groups: dict[int, LaneGroup] = {}
        self.quorum: Quorum | None = None

    def configure(self, quorum: Quorum, rank: int, size: int, chunks: int) -> None:
        """(Re)build this rank's lane groups for `quorum` (blocks until every peer connected)."""
        self.abort()
        self.quorum = quorum
        store = quorum.members[0].store
        groups: dict[int, LaneGroup] = {}
        for j in lanes_of(rank, size, quorum, chunks):
            pg = self.make_group()
            try:
                pg.configure(f"{store}/edit-train/{quorum.nonce}/lane{j}", f"lane{j}", quorum.me,
                             len(quorum.members))
            except Exception as exc:  # noqa: BLE001
                raise FederationError(f"lane {j} of quorum {quorum.quorum_id} with {quorum.names} could "
                                      f"not connect: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
            groups[j] = pg
        if self.quorum is not quorum:  # given up on meanwhile (its deadline passed): never used
            for pg in groups.values():
                pg.abort(errored=False)
            raise FederationError(f"quorum {quorum.quorum_id}: lanes connected after their deadline")
        self.groups = groups

    def abort(self) -> None:
        for pg in self.groups.values():
            try:
                pg.abort(errored=False)
            except Exception:  # noqa: BLE001
                pass
        self.groups.clear()
        self.quorum = None
