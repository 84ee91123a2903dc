"""ddp and the synchronous warm-up: a quorum every step, gradients averaged over it (torchft-style
fault-tolerant DDP). Functions of the `LocalSGD` they serve."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from edit_train.federation.link import FederationError, FederationRefused
from edit_train.local_sgd.sync import SyncAborted

if TYPE_CHECKING:
    from edit_train.local_sgd.algorithms import LocalSGD

log = logging.getLogger(__name__)


def grads_allreduce(algo: LocalSGD) -> None:
    """Average this step's gradients over the quorum (the shared loss and the stop vote ride along)."""
    grads = []
    for p in algo.model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grads.append(g)
    vote = None
    loss = None
    if algo.shared_loss is not None:  # ddp: the loss-spike decision must be the same on every group
        loss = torch.tensor([algo.shared_loss], dtype=torch.float32, device=algo.comm.device)
        grads.append(loss)
    if algo.cfg.time_budget_s > 0:
        _, agreed = algo._group_agree(0.0, algo._want_stop())
        vote = torch.tensor([1.0 if agreed else 0.0], device=algo.comm.device)
        grads.append(vote)
        algo._last_exchange_t = time.time()
    if algo.comm.federated:
        try:  # torchft-style fault-tolerant DDP: a quorum every step, gradients averaged over it
            algo.sync_index = algo.total_steps  # the replica's version is its step
            m = algo._quorum(1)
            if m is not None and len(m.members) > 1:
                average_grads(algo, m, grads)
        except FederationRefused:
            raise
        except (FederationError, SyncAborted) as exc:
            log.warning("cluster %s: gradient exchange failed (%s); step taken with local gradients",
                        algo.comm.name, exc)
            algo.comm.abort()
    if vote is not None and float(vote.item()) > 0:
        algo.stopped = True
    if loss is not None:
        algo.shared_loss = float(loss.item())


def average_grads(algo: LocalSGD, m: Any, grads: list[torch.Tensor]) -> None:
    """Average over the members that were in step; a member that just healed (its gradients were taken
    on a stale replica) sends zeros and receives the average."""
    behind = m.behind()
    if m.me in behind:
        for g in grads:
            g.zero_()
    algo.comm.all_reduce_(grads, params=None)
    n = max(len(m.members) - len(behind), 1)
    for g in grads:
        g.div_(n)
    algo.comm.abort()
