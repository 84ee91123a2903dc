"""A cluster's simulation hooks from its config: the one object the training loop calls (sim/hooks.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from edit_train.sim.byzantine import PayloadFaults
from edit_train.sim.faults import FaultInjector
from edit_train.sim.hetero import Slowdown
from edit_train.sim.hooks import Chain, StepHooks

if TYPE_CHECKING:
    from edit_train.cluster.mesh import Topology
    from edit_train.config import ClusterSpec, Config


def step_hooks(cfg: Config, topo: Topology, specs: list[ClusterSpec], run_dir: Path,
               step: Callable[[], int]) -> StepHooks:
    """This cluster's faults (`faults`: the training-side ones, then what it sends or claims) and its simulated
    slowdown (each cluster's `slowdown`, `cluster.slowdown_schedule`), chained; the no-op `StepHooks()` when none
    concerns it. `step`: the trainer's current step (a payload fault is active by step). Both lists are parsed
    (and a bad entry refused) whether or not this cluster has one."""
    faults = FaultInjector(cfg.faults, topo.index, cfg.model.vocab_size, run_dir=run_dir,
                           is_leader=topo.is_leader, cluster=topo.name, rank=topo.rank)
    slowdown = Slowdown(topo.index, [s.slowdown for s in specs], list(cfg.cluster.slowdown_schedule), len(specs))
    parts: list[StepHooks] = []
    if faults.faults:
        parts.append(faults)
    if faults.byzantine:
        parts.append(PayloadFaults(faults, step, seed=cfg.seed + topo.index))
    if slowdown.active:
        parts.append(slowdown)
    if not parts:
        return StepHooks()
    return parts[0] if len(parts) == 1 else Chain(parts)
