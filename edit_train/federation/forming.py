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
import time
from collections.abc import Callable
from typing import Any

import torch

from edit_train.federation.link import LinkClock
from edit_train.local_sgd.errors import FederationError, FederationRefused
from edit_train.local_sgd.protocols import ClusterGroup, Quorum
from edit_train.local_sgd.sync.waits import Wait, WaitInterrupted


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

    def join(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class Forming:
    """The quorum of one sync in formation. `quorum` is set when `poll()` returns True (None: this cluster
    is cut off from the federation). `ask` is the leader's Lighthouse request (None on the other ranks);
    `connect(quorum)` configures this rank's lanes and says whether every peer connected."""

    def __init__(self, cluster: ClusterGroup, clock: LinkClock, ask: Callable[[], dict[str, Any]] | None,
                 connect: Callable[[Quorum], bool], abort: Callable[[], None],
                 deadlines: tuple[float, float] = (330.0, 60.0), label: str = "this cluster") -> None:
        self.cluster, self.clock, self.connect, self.abort = cluster, clock, connect, abort
        self.label = label  # "cluster b, sync 3": whose wait the progress lines are
        self.deadlines = {"asking": deadlines[0], "connecting": deadlines[1]}  # seconds per phase
        self.started = time.monotonic()
        self.phase = "asking"
        self.quorum: Quorum | None = None
        self._issued: Quorum | None = None
        self._connect: Background | None = None
        self._ask = Background(ask, "edit-train-quorum") if ask is not None else None

    def _ready(self, job: Background | None, block: bool) -> bool:
        """The same answer on every rank of the cluster: has `job` (this rank's, if any) finished? Past the
        phase's deadline on any rank, FederationError naming what never came (every rank raises it)."""
        limit = self.deadlines[self.phase]
        if block:
            done, stopped = True, False
            if job is not None:
                with self.clock.waiting():
                    wait = self._wait(limit)
                    try:
                        done = wait.until(job.join)
                        if done:
                            wait.done("it came")
                    except WaitInterrupted:
                        done, stopped = False, True
            # 1: this rank's job is late; 2: a signal asked this rank to stop (every rank gives the sync up)
            late = self.cluster.max_(torch.tensor([2.0 if stopped else 0.0 if done else 1.0],
                                                  device=self.cluster.device))
            if float(late[0]) > 1:
                self.abort()
                raise WaitInterrupted(f"{self.label}: stopped waiting for {self._what()}: a signal asked this "
                                      "cluster to stop")
            if float(late[0]) > 0:
                self._expired(limit)
            return True
        state = torch.tensor([0.0 if job is None or job.done() else 1.0,
                              1.0 if time.monotonic() - self.started > limit else 0.0], device=self.cluster.device)
        pending, expired = (float(v) > 0 for v in self.cluster.max_(state))
        if pending and expired:
            self._expired(limit)
        return not pending

    def _what(self) -> str:
        return {"asking": "the Lighthouse's answer to this cluster's quorum request",
                "connecting": f"every peer of quorum {self._issued.quorum_id if self._issued else '?'} to connect its "
                              "lanes"}[self.phase]

    def _wait(self, limit: float) -> Wait:
        """This phase's wait: progress lines while it lasts (the leader's; its ranks wait for it silently)."""
        return Wait(f"{self._what()} ({self.label})", limit, started=self.started)

    def _expired(self, limit: float) -> None:
        what = self._what()
        self.abort()
        raise FederationError(f"{what} did not come within {limit:g} s: this sync is skipped")

    def poll(self, block: bool = False) -> bool:
        c = self.cluster
        if self.phase == "asking":
            if not self._ready(self._ask, block):
                return False
            with self.clock.waiting():
                got = self._ask.wait() if self._ask is not None else None
                got = c.broadcast_json(got)  # the leader's answer to the cluster
            if not got["ok"]:
                raise (FederationRefused if got.get("refused") else FederationError)(got["error"])
            issued = Quorum.from_json(got["m"]) if got["m"] is not None else None
            if issued is None or len(issued.members) <= 1:
                self.quorum, self.phase = issued, "done"
                return True
            self._issued, self.phase, self.started = issued, "connecting", time.monotonic()
            self._connect = Background(lambda: self.connect(issued), "edit-train-lanes")
        if self.phase == "connecting":
            if not self._ready(self._connect, block):
                return False
            assert self._connect is not None and self._issued is not None
            with self.clock.waiting():
                ok = c.agree(bool(self._connect.wait()))
            if not ok:
                self.abort()
                raise FederationError(f"quorum {self._issued.quorum_id} {self._issued.names}: a peer did not connect")
            self.quorum, self.phase = self._issued, "done"
        return self.phase == "done"
