"""Joining the federation before the first step: a fresh federation starts together, a resumed one regroups
within the grace window, and a restarted, late or new cluster heals from a live peer (and continues from the
federation's step). A function of the `LocalSGD` it serves."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from edit_train.cluster.mesh import local_tensor
from edit_train.federation.link import FederationError, FederationRefused
from edit_train.local_sgd.gradients import average_grads
from edit_train.local_sgd.sync import SyncAborted

if TYPE_CHECKING:
    from edit_train.local_sgd.algorithms import LocalSGD

log = logging.getLogger(__name__)


def join_federation(algo: LocalSGD) -> None:
    """Before the first step: meet the federation; a restarted, late or new cluster heals from a live
    peer here (and continues from the federation's step)."""
    if not algo.comm.federated:
        return
    algo._joining = True
    deadline = time.time() + algo.cfg.start_timeout_s
    regroup = time.time() + algo.cfg.regroup_s
    m = None
    try:
        while True:
            try:
                m = algo._quorum(0)
            except FederationRefused:
                raise
            except (FederationError, SyncAborted) as exc:
                algo.comm.abort()
                if time.time() >= deadline:
                    log.warning("cluster %s: could not join at start (%s); training alone until the next sync",
                                algo.comm.name, exc)
                    m = None
                    break
                log.info("cluster %s: joining: %s; trying again", algo.comm.name, exc)
                continue
            # a fresh federation starts together: ask again until every configured cluster is in. A
            # resumed one (the whole federation restarted from its checkpoints) regroups the same way
            # within the grace window, so that the first cluster back does not sync alone; a cluster
            # restarting while the others run finds them within that window, or heals at its next sync
            missing = m is not None and not set(algo.cfg.expected) <= set(m.names)
            fresh = m is not None and m.max_sync == 0 and algo.total_steps == 0 and time.time() < deadline
            resumed = m is not None and algo.total_steps > 0 and m.max_sync <= algo.sync_index \
                and time.time() < regroup
            if missing and (fresh or resumed):
                algo.comm.abort()
                time.sleep(0.1)
                continue
            break
    finally:
        algo._joining = False
    if m is not None and not any(mm.contributes for mm in m.members):
        algo.sync_index = m.max_sync
        algo.comm.abort()
    elif m is not None and algo.engine is None:  # ddp / warm-up: the others are averaging gradients
        zeros = [torch.zeros_like(local_tensor(p.data)) for p in algo.model.parameters()]
        extra = int(algo.cfg.shares_loss) + int(algo.cfg.time_budget_s > 0)
        zeros += [torch.zeros(1, device=algo.comm.device) for _ in range(extra)]
        try:
            average_grads(algo, m, zeros)
        except FederationError as exc:
            log.warning("cluster %s: joining the gradient exchange failed: %s", algo.comm.name, exc)
            algo.comm.abort()
    elif m is not None:  # the others are mid-sync: take part with weight 0
        algo._run_sync(algo.total_steps, m)
