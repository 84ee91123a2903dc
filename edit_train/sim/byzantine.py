"""A cluster whose contributions go wrong on the way out: its transport, wrapped. Everything else (quorum,
exchanges, votes, heal) passes through untouched, so it takes part in the sync like an honest cluster and
reports the norms of its true pseudo-gradient; only the tensors it hands to `gather` / `reduce_` change.

A lying member (`lie_steps`, `lie_config`, `lie_heal`, sim/faults.py) changes what it claims when it asks for a
quorum instead (its own identity signs the lie), vets nothing, and with `lie_heal` sends a finite but wrong
anchor to whoever heals from it.

`PayloadFaults` is where the training loop's seam meets these (sim/hooks.py, its `transport` point): the
algorithm gets the wrapped transport, the loop knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LIE_SCALE = 1e30  # lie_heal: the anchor it sends, times its own

import torch
from torch import Tensor

from edit_train.local_sgd.protocols import Transport
from edit_train.sim.faults import FaultInjector
from edit_train.sim.hooks import StepHooks


def corrupt(kind: str, tensors: list[Tensor], gen: torch.Generator) -> list[Tensor]:
    """What a cluster with fault `kind` sends instead of `tensors` (a module's Δ, possibly weighted)."""
    if kind == "sign_flip":
        return [-t for t in tensors]
    if kind == "lie_norm":
        return [10.0 * t for t in tensors]
    if kind == "nan_payload":
        return [torch.full_like(t, float("nan")) for t in tensors]
    if kind == "random_direction":
        noise = [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t) for t in tensors]
        scale = float(torch.sqrt(sum(t.double().pow(2).sum() for t in tensors)))
        total = float(torch.sqrt(sum(n.double().pow(2).sum() for n in noise)))
        return [n * (scale / total if total > 0 else 0.0) for n in noise]
    raise ValueError(f"unknown payload fault {kind!r}")


def lie(kind: str, sync: int, data: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """What a lying member claims instead of (`sync`, `data`)."""
    if kind == "lie_steps":
        return sync, {**data, "total_steps": 2**53 - 1}
    if kind == "lie_config":
        return 2**40, {**data, "fp": "another-configuration"}
    if kind == "lie_heal":
        return sync + 1, {**data, "anchor": "f" * 32}
    raise ValueError(f"unknown claim fault {kind!r}")


class ByzantineTransport:
    """`inner`, except that a module's contribution is corrupted while a payload fault is active at the
    trainer's current step (`step()`)."""

    def __init__(self, inner: Transport, faults: FaultInjector, step: Callable[[], int], seed: int = 0) -> None:
        self.inner, self.faults, self.step = inner, faults, step
        self._gen = torch.Generator().manual_seed(10_007 + seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _out(self, tensors: list[Tensor], key: str) -> list[Tensor]:
        kind = self.faults.payload_fault(self.step()) if key else None
        return corrupt(kind, tensors, self._gen) if kind else tensors

    def form_start(self, sync: int, data: dict[str, Any], vet: Any = None) -> None:
        kind = self.faults.claim_fault(self.step())
        if kind is None:
            return self.inner.form_start(sync, data, vet)
        sync, data = lie(kind, sync, data)
        return self.inner.form_start(sync, data)

    def send_bytes(self, payload: bytes, dst: int) -> None:
        if self.faults.claim_fault(self.step()) == "lie_heal":
            from edit_train.federation import heal

            meta, tensors = heal.decode(payload)
            meta = {k: v for k, v in meta.items() if k not in ("kind", "version")}
            payload = heal.encode(meta, {k: v * LIE_SCALE if "/anchor/" in k else v for k, v in tensors.items()})
        self.inner.send_bytes(payload, dst)

    def gather(self, tensors: list[Tensor], params: list[Tensor] | None = None, key: str = "", **kw: Any) -> Any:
        return self.inner.gather(self._out(tensors, key), params, key, **kw)

    def reduce_(self, tensors: list[Tensor], params: list[Tensor] | None = None, key: str = "", **kw: Any) -> Any:
        sent = self._out(tensors, key)
        handle = self.inner.reduce_(sent, params, key, **kw)
        if sent is tensors:
            return handle
        return _Into(handle, sent, tensors)


class PayloadFaults(StepHooks):
    """The hooks of a Byzantine or lying cluster: its transport wrapped (`ByzantineTransport`), nothing else."""

    def __init__(self, faults: FaultInjector, step: Callable[[], int], seed: int = 0) -> None:
        self.faults, self.step, self.seed = faults, step, seed

    def transport(self, transport: Any) -> Any:
        return ByzantineTransport(transport, self.faults, self.step, seed=self.seed)


class _Into:
    """A SUM that ran on corrupted copies: the result goes back into the caller's tensors."""

    def __init__(self, handle: Any, sent: list[Tensor], into: list[Tensor]) -> None:
        self.handle, self.sent, self.into = handle, sent, into

    @property
    def blocked_s(self) -> float:
        return float(self.handle.blocked_s)

    def ready(self) -> bool:
        return bool(self.handle.ready())

    def wait(self) -> None:
        self.handle.wait()
        for t, s in zip(self.into, self.sent):
            t.copy_(s)
