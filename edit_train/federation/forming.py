"""Forming one sync's quorum in the background, so that a cluster that reaches its sync point first keeps
training instead of waiting for the others (A-EDiT: nobody waits for a straggler).

Two phases, each on a daemon thread, polled by the training loop at step boundaries:

  asking      the cluster leader asks the Lighthouse (blocks until every live cluster asked, or the join
              timeout); the GIL is released while torchft's client waits
  connecting  every rank connects its lanes for the issued quorum (torchft's reconfigurable gloo groups;
              a few ms once the peers connect too — the same background configure torchft's Manager does)

Every rank of the cluster must take the same branch at the same step boundary (what follows are collectives
inside the cluster), so readiness is agreed with one MIN all-reduce over the cluster's group. `poll(block=True)`
is the synchronous quorum (`FederationComm.form`); only the time spent waiting there counts as blocked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from edit_train.cluster.collectives import broadcast_json
from edit_train.federation.link import FederationError, FederationRefused
from edit_train.federation.quorum import Membership

if TYPE_CHECKING:
    from edit_train.federation.comm import FederationComm


class Background:
    """One call on a daemon thread (a process that stops mid-quorum must not wait for it); the main thread
    collects its result or its exception."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread by wait()
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def join(self) -> None:
        self._done.wait()

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class Forming:
    """The quorum of one sync in formation. `membership` is set when `poll()` returns True (None: this
    cluster is cut off from the federation)."""

    def __init__(self, comm: FederationComm, sync: int, data: dict[str, Any]) -> None:
        self.comm = comm
        self.phase = "asking"
        self.membership: Membership | None = None
        self._issued: Membership | None = None
        self._connect: Background | None = None
        self._ask = Background(lambda: comm.ask(sync, data), "edit-train-quorum") if comm.rank == 0 else None

    def _ready(self, job: Background | None, block: bool) -> bool:
        """The same answer on every rank of the cluster: has `job` (this rank's, if any) finished?"""
        c = self.comm
        if block:
            if job is not None:
                with c.clock.waiting():
                    job.join()
            return True
        ready = job is None or job.done()
        if c.shard_pg is None or c.size <= 1:
            return ready
        flag = torch.tensor([1.0 if ready else 0.0], device=c.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=c.shard_pg)
        return bool(flag.item() > 0)

    def poll(self, block: bool = False) -> bool:
        c = self.comm
        if self.phase == "asking":
            if not self._ready(self._ask, block):
                return False
            with c.clock.waiting():
                got = self._ask.wait() if self._ask is not None else None
                got = broadcast_json(got, c.shard_pg, c.size, c.device)  # the leader's answer to the cluster
            if not got["ok"]:
                raise (FederationRefused if got.get("refused") else FederationError)(got["error"])
            issued = Membership.from_json(got["m"]) if got["m"] is not None else None
            if issued is None or len(issued.members) <= 1:
                self.membership, self.phase = issued, "done"
                return True
            self._issued, self.phase = issued, "connecting"
            self._connect = Background(lambda: c.connect(issued), "edit-train-lanes")
        if self.phase == "connecting":
            if not self._ready(self._connect, block):
                return False
            assert self._connect is not None and self._issued is not None
            with c.clock.waiting():
                ok = c.agree(bool(self._connect.wait()))
            if not ok:
                c.lanes.abort()
                raise FederationError(f"quorum {self._issued.quorum_id} {self._issued.names}: a peer did not connect")
            self.membership, self.phase = self._issued, "done"
        return self.phase == "done"
