"""Three drivers of the one sync round (`round.py`): *when* each unit is reduced and applied.

* `BlockingDriver(hooks=True)` — layer-wise (EDiT): the exchange blocks at the sync point, then each unit is
  reduced and applied in a forward pre-hook registered *before* FSDP's own (so it runs on the local shard
  before FSDP gathers it), the next unit's reduction already in flight (prefetch). The vote follows the
  last unit; a failure rolls every applied unit back and raises `SyncAborted` (the step is redone). A sketched
  round whose check fails gathers every unit again at the vote and commits; the forward that already ran on
  the sketched parameters is redone (`ForwardStale`).
* `BlockingDriver(hooks=False)` — at_end: the same, every unit at once at the sync point (`flush()` right
  after `begin()`).
* `OverlapDriver` — the round runs in the background while local steps go on: exchange, reductions and the
  vote are polled at step boundaries (every rank of the cluster agrees when something has landed), and
  nothing is applied before the vote passed; then θ ← θ̄_new + (θ − θ_snap), so local progress is kept.
  A lost cluster drops the round whole; a sketched round whose check fails goes back to reducing, gathered.

A driver reports a finished round through `on_complete(report)` and a failed one through
`on_abort(report, why)`. What the exchange carried (each cluster's EXTRA columns) is returned with the round
that commits: by `begin` for the blocking drivers, by the `poll`/`flush` that applies it for overlap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from edit_train.local_sgd.errors import FederationError, ForwardStale, SyncAborted
from edit_train.local_sgd.protocols import Handle
from edit_train.local_sgd.sync.round import SyncCore, SyncReport, SyncRound

log = logging.getLogger(__name__)

Done = Callable[[SyncReport], None]
Aborted = Callable[[SyncReport, str], None]


class Driver:
    """What the façade calls; the subclasses decide when units move."""

    def __init__(self, core: SyncCore, on_complete: Done, on_abort: Aborted) -> None:
        self.core, self.on_complete, self.on_abort = core, on_complete, on_abort
        self.round: SyncRound | None = None

    @property
    def pending(self) -> bool:
        return self.round is not None

    def begin(self, sync: int, local_steps: int, extra: list[float]) -> Tensor | None:
        raise NotImplementedError

    def poll(self, block: bool = False) -> Tensor | None:
        """Advance a round in flight; the EXTRA columns when it committed just now."""
        return None

    def flush(self) -> Tensor | None:
        """Finish the round in flight (blocking)."""
        return None

    def _fail(self, why: str) -> None:
        rnd, self.round = self.round, None
        if rnd is not None:
            rnd.rollback()
            log.warning("sync %d aborted and rolled back: %s", rnd.report.sync, why)
            self.on_abort(rnd.report, why)

    def _done(self) -> None:
        rnd, self.round = self.round, None
        if rnd is not None:
            rnd.committed()
            self.on_complete(rnd.report)


class BlockingDriver(Driver):
    """Layer-wise (`hooks=True`) or at_end (`hooks=False`); see the module docstring."""

    def __init__(self, core: SyncCore, on_complete: Done, on_abort: Aborted, hooks: bool, prefetch: bool) -> None:
        super().__init__(core, on_complete, on_abort)
        self.prefetch = prefetch
        self.hooks = hooks
        if hooks:
            for unit in core.units:
                unit.module.register_forward_pre_hook(self._hook(unit.name), prepend=True)

    def _hook(self, name: str) -> Callable[[nn.Module, Any], None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            if self.round is not None and name in self.round.todo:
                with self.core.span("sync"):
                    self._unit(name)
        return hook

    def begin(self, sync: int, local_steps: int, extra: list[float]) -> Tensor | None:
        self.round = SyncRound(self.core, sync, local_steps, eager=True)
        try:
            gathered = self.round.gathered(self.round.exchange(extra))
        except FederationError as exc:
            self._fail(str(exc))
            raise SyncAborted(str(exc)) from None
        return gathered

    @torch.no_grad()
    def _unit(self, name: str, in_forward: bool = True) -> None:
        rnd = self.round
        assert rnd is not None
        rnd.launch(name)
        if self.prefetch:
            i = self.core.index[name] + 1
            if i < len(self.core.units):
                rnd.launch(self.core.units[i].name)
        try:
            rnd.land(name)
        except FederationError as exc:
            self._fail(str(exc))
            raise SyncAborted(str(exc)) from None
        rnd.apply(name)
        if not rnd.todo:
            self._commit(in_forward)

    def _commit(self, in_forward: bool) -> None:
        rnd = self.round
        assert rnd is not None
        regathered = False
        try:
            ok = rnd.voted(rnd.vote())
            if not ok and rnd.regather():  # the sketched SUM did not check out: gather this sync, every unit now
                regathered = True
                for name in list(rnd.todo):
                    rnd.launch(name)
                    rnd.land(name)
                    rnd.apply(name)
                ok = rnd.voted(rnd.vote())
            why = "a cluster did not commit" if not rnd.report.nonfinite else \
                f"the reduced pseudo-gradient of {rnd.report.nonfinite} is not finite"
        except FederationError as exc:
            ok, why = False, str(exc)
        if not ok:
            self._fail(why)
            raise SyncAborted(why)
        self._done()
        if regathered and in_forward:
            raise ForwardStale(f"sync {rnd.report.sync} was gathered again ({rnd.report.regathered})")

    def flush(self) -> Tensor | None:
        """Synchronize every remaining unit now, in unit order."""
        while self.round is not None and self.round.todo:
            self._unit(self.round.todo[0], in_forward=False)
        return None


class OverlapDriver(Driver):
    """The round in the background; see the module docstring."""

    def __init__(self, core: SyncCore, on_complete: Done, on_abort: Aborted) -> None:
        super().__init__(core, on_complete, on_abort)
        self._exchange: Handle[Tensor] | None = None
        self._vote: Handle[bool] | None = None
        self._gathered: Tensor | None = None
        self.phase = "idle"  # idle | gathering | reducing | voting

    def begin(self, sync: int, local_steps: int, extra: list[float]) -> Tensor | None:
        assert self.round is None, "previous overlapped sync still in flight"
        self.round = SyncRound(self.core, sync, local_steps, eager=False)
        try:
            self._exchange = self.round.exchange(extra)
        except FederationError as exc:
            self._drop(str(exc))
            return None
        self.phase = "gathering"
        return None

    def _ready(self, ready: bool, block: bool) -> bool:
        """Every rank of the cluster takes the same branch (what follows are cluster collectives)."""
        return block or self.core.transport.cluster.agree(ready)

    @torch.no_grad()
    def poll(self, block: bool = False) -> Tensor | None:
        try:
            return self._poll(block)
        except FederationError as exc:
            self._drop(str(exc))
            return None

    def _poll(self, block: bool) -> Tensor | None:
        rnd = self.round
        if rnd is None:
            return None
        if self.phase == "gathering":
            assert self._exchange is not None
            if not self._ready(self._exchange.ready(), block):
                return None
            self._gathered = rnd.gathered(self._exchange)
            for name in list(rnd.todo):
                rnd.launch(name)
            self.phase = "reducing"
        if self.phase == "reducing":
            if not self._ready(all(rnd.ready(n) for n in rnd.todo), block):
                return None
            for name in list(rnd.todo):
                rnd.land(name)
            # vote without waiting for the others to land theirs (a blocking vote would wait for the
            # slowest cluster's next step boundary)
            self._vote, self.phase = rnd.vote(), "voting"
        if self.phase == "voting":
            if not self._ready(self._vote is None or self._vote.ready(), block):
                return None
            if not rnd.voted(self._vote):
                if rnd.regather():  # the sketched SUM did not check out: gather this sync (in the background too)
                    for name in list(rnd.todo):
                        rnd.launch(name)
                    self._vote, self.phase = None, "reducing"
                    return self._poll(block)
                raise FederationError("a cluster did not commit" if not rnd.report.nonfinite else
                                      f"the reduced pseudo-gradient of {rnd.report.nonfinite} is not finite")
            for name in list(rnd.todo):
                rnd.apply(name)
            gathered = self._gathered
            self._reset()
            self._done()
            return gathered
        return None

    def _reset(self) -> None:
        self._exchange = self._vote = self._gathered = None
        self.phase = "idle"

    def _drop(self, why: str) -> None:
        self._reset()
        self._fail(why)

    def flush(self) -> Tensor | None:
        return self.poll(block=True)
