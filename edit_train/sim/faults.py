"""Fault injection: make one cluster misbehave for a window of steps.

`faults` is a list of `{kind, group, start, end, ...}` (steps are 0-based, `end` exclusive):
* `garbage_data` — the group trains on uniform random tokens;
* `lr_spike`     — the group's inner LR is multiplied by `factor` (default 10);
* `nan_grad`     — the group's gradients become NaN (tests the numerical-safety path);
* `kill`         — the group's first rank SIGKILLs itself at the start of step `start` (once per run
                   directory: a marker file keeps a restarted job from dying again);
* `kill_cluster` — every rank of cluster `cluster` (index or name) SIGKILLs itself at step `step`
                   (once per run directory); the local launcher restarts the cluster after
                   `run.restart_delay_s` and it heals from a live peer;
* `partition`    — cluster `cluster` cannot reach the others (nor the Lighthouse) for `seconds` from step
                   `step`: it keeps training alone and rejoins afterwards.

`FaultInjector` applies these through the training loop's seam (sim/hooks.py, `StepHooks`): the loop calls it
before a step, for the step's lr, on each batch and on the gradients, and knows no fault kind.

Byzantine faults happen where a real one would, in what the cluster sends (`sim/byzantine.py` wraps its
transport); its own training is healthy and it reports its true norms:
* `sign_flip`        — it sends −Δ;
* `random_direction` — it sends a random vector with Δ's norm (module by module);
* `lie_norm`         — it reports Δ's norm and sends 10 Δ;
* `nan_payload`      — it reports finite norms and sends NaN.

Lying members (issue 37) lie in what they claim when they ask for a quorum, signed with their own identity
(the gate lets them in: they are on the roster); they vet nothing themselves:
* `lie_steps`  — it claims 2^53 − 1 steps (once this made every cluster jump to the end of the run);
* `lie_config` — it claims another configuration fingerprint and sync 2^40 (once this made the honest refuse
                 themselves);
* `lie_heal`   — it claims the sync after the true one with a made-up anchor digest, and a heal payload it sends
                 carries 1e30 times its anchor (once it became everyone's heal source).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import os
import signal
from pathlib import Path

import torch
from torch import nn

from edit_train.retired import entry_field
from edit_train.sim.hooks import Federation, StepHooks

PAYLOAD_KINDS = ("sign_flip", "random_direction", "lie_norm", "nan_payload")
CLAIM_KINDS = ("lie_steps", "lie_config", "lie_heal")
KINDS = ("garbage_data", "lr_spike", "nan_grad", "kill", "kill_cluster", "partition", *PAYLOAD_KINDS, *CLAIM_KINDS)


class FaultError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    group: int
    start: int
    end: int
    factor: float = 10.0
    seconds: float = 0.0
    cluster: str = ""  # a cluster name (kill_cluster / partition may name it instead of its index)

    def active(self, step: int, group: int) -> bool:
        return self.group == group and self.start <= step < self.end


def parse_faults(specs: list[dict[str, Any]] | None) -> list[Fault]:
    faults = []
    for i, spec in enumerate(specs or []):
        spec = dict(spec)
        kind = spec.get("kind")
        if kind not in KINDS:
            raise FaultError(f"faults[{i}].kind: {kind!r} is not one of {', '.join(KINDS)}")
        spec = entry_field(spec, "faults")
        unknown = set(spec) - {"kind", "start", "end", "factor", "cluster", "step", "seconds"}
        if unknown:
            raise FaultError(f"faults[{i}]: unknown field(s) {sorted(unknown)}; use kind, cluster, "
                             "start/step, end, factor, seconds")
        target = spec.get("cluster", 0)
        name = "" if isinstance(target, int) or str(target).isdigit() else str(target)
        try:
            fault = Fault(kind, int(target) if not name else -1, int(spec.get("step", spec.get("start", 0))),
                          int(spec.get("end", 1 << 62)), float(spec.get("factor", 10.0)),
                          float(spec.get("seconds", 0.0)), name)
        except (TypeError, ValueError) as exc:
            raise FaultError(f"faults[{i}]: {exc}") from None
        if kind == "partition" and not 0 < fault.seconds < float("inf"):  # nan, inf: a partition never healed
            raise FaultError(f"faults[{i}].seconds: a partition needs a finite number of seconds > 0, "
                             f"got {fault.seconds}")
        if fault.end <= fault.start:
            raise FaultError(f"faults[{i}]: end ({fault.end}) must be > start ({fault.start})")
        faults.append(fault)
    return faults


class FaultInjector(StepHooks):
    """Applies the faults that concern this rank's group (the training-side ones as the loop's `StepHooks`)."""

    def __init__(self, specs: list[dict[str, Any]] | None, group: int, vocab_size: int, seed: int = 1234,
                 run_dir: str | Path | None = None, is_leader: bool = True, cluster: str = "",
                 rank: int = 0) -> None:
        self.faults = [f for f in parse_faults(specs) if f.group == group or (f.cluster and f.cluster == cluster)]
        self.cluster = cluster or str(group)
        self.rank = rank
        self.group = group
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.is_leader = is_leader
        self.vocab_size = vocab_size
        self._gen = torch.Generator().manual_seed(seed + group)

    def _active(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.active(step, self.group)]

    # ------------------------------------------------------------- the loop's seam (sim/hooks.py)
    def before_step(self, step: int, federation: Federation) -> None:
        self.maybe_kill(step)
        cut = self.partition_at(step)
        if cut > 0:
            federation.partition(cut)

    def lr(self, step: int, lr: float) -> float:
        return lr * self.lr_scale(step)

    def batch(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.corrupt_batch(step, x, y)

    def grads(self, step: int, model: nn.Module) -> None:
        self.corrupt_grads(step, model)

    # ------------------------------------------------------------------------ the faults
    def maybe_kill(self, step: int) -> None:
        """`kill` fault: SIGKILL this process (the group's first rank) at the start of `start`, once;
        `kill_cluster`: every rank of the cluster, once."""
        for f in self.faults:
            if f.kind == "kill_cluster" and step == f.start:
                marker = (self.run_dir or Path(".")) / f".fault-kill-{self.cluster}-r{self.rank}-s{f.start}"
                if not marker.exists():
                    marker.write_text("fired\n")
                    os.kill(os.getpid(), signal.SIGKILL)
        for f in self.faults:
            if f.kind != "kill" or step != f.start or not self.is_leader:
                continue
            marker = (self.run_dir or Path(".")) / f".fault-kill-g{f.group}-s{f.start}"
            if marker.exists():
                continue
            marker.write_text("fired\n")
            os.kill(os.getpid(), signal.SIGKILL)

    def partition_at(self, step: int) -> float:
        """Seconds this cluster is cut off from the federation starting at `step` (0: none)."""
        return sum(f.seconds for f in self.faults if f.kind == "partition" and f.start == step)

    def payload_fault(self, step: int) -> str | None:
        """The Byzantine fault active at `step`, if any (what the cluster sends is corrupted)."""
        active = [f.kind for f in self.faults if f.kind in PAYLOAD_KINDS and f.active(step, self.group)]
        return active[0] if active else None

    def claim_fault(self, step: int) -> str | None:
        """The lie this cluster tells in its quorum requests at `step`, if any."""
        active = [f.kind for f in self.faults if f.kind in CLAIM_KINDS and f.active(step, self.group)]
        return active[0] if active else None

    @property
    def byzantine(self) -> bool:
        return any(f.kind in (*PAYLOAD_KINDS, *CLAIM_KINDS) for f in self.faults)

    def lr_scale(self, step: int) -> float:
        scale = 1.0
        for f in self._active("lr_spike", step):
            scale *= f.factor
        return scale

    def corrupt_batch(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._active("garbage_data", step):
            return x, y
        seq = torch.randint(0, self.vocab_size, (x.shape[0], x.shape[1] + 1), generator=self._gen)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    @torch.no_grad()
    def corrupt_grads(self, step: int, model: nn.Module) -> None:
        if not self._active("nan_grad", step):
            return
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                g.fill_(float("nan"))
