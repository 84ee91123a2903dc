"""ddp and the synchronous warm-up: a quorum every step, gradients averaged over it (torchft-style
fault-tolerant DDP). The loss (for the loss-spike guard) and the stop vote ride along with the gradients."""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from edit_train.local_sgd.errors import FederationError, FederationRefused, SyncAborted
from edit_train.local_sgd.sync.membership import Membership
from edit_train.local_sgd.protocols import Quorum, Transport

log = logging.getLogger(__name__)


def local_grads(model: nn.Module) -> list[Tensor]:
    """This rank's gradient shards, in parameter order."""
    out = []
    for p in model.parameters():
        if p.grad is not None:
            out.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    return out


def average(transport: Transport, q: Quorum, tensors: list[Tensor]) -> None:
    """Average over the members that were in step; a member that just healed (its gradients were taken
    on a stale replica) sends zeros and receives the average."""
    behind = q.behind()
    if q.me in behind:
        for t in tensors:
            t.zero_()
    transport.reduce_(tensors).wait()
    n = max(len(q.members) - len(behind), 1)
    for t in tensors:
        t.div_(n)
    transport.abort()


class GradientExchange:
    def __init__(self, transport: Transport, membership: Membership) -> None:
        self.t, self.membership = transport, membership

    def exchange(self, model: nn.Module, step: int, loss: float | Tensor | None, vote: bool | None
                 ) -> tuple[float | Tensor | None, bool]:
        """Average this step's gradients over the quorum. Returns (the agreed loss, the stop: a strict majority of
        the quorum's votes, the mean of the votes past one half — one member's vote never stops the others). A
        loss given as a tensor stays on the device (no host read): the agreed loss is then a 0-d tensor."""
        tensors = local_grads(model)
        extra: list[Tensor] = []
        for value in (loss, None if vote is None else float(vote)):
            if isinstance(value, Tensor):
                extra.append(value.detach().reshape(1).to(device=self.t.cluster.device, dtype=torch.float32))
            elif value is not None:
                extra.append(torch.tensor([value], dtype=torch.float32, device=self.t.cluster.device))
        if self.t.federated:
            try:  # a quorum every step, gradients averaged over it
                self.membership.holds(step)  # the replica's version is its step
                q = self.membership.form(1)
                if q is not None and q.shared:
                    average(self.t, q, tensors + extra)
            except FederationRefused:
                raise
            except (FederationError, SyncAborted) as exc:
                log.warning("cluster %s: gradient exchange failed (%s); step taken with local gradients",
                            self.t.name, exc)
                self.t.abort()
        agreed = None if loss is None else extra[0].reshape(()) if isinstance(loss, Tensor) else float(extra[0].item())
        stop = vote is not None and float(extra[-1].item()) > 0.5
        return agreed, stop

    def join(self, q: Quorum, model: nn.Module, riders: int) -> None:
        """A cluster joining a quorum that is averaging gradients takes part with zeros (and learns nothing)."""
        zeros = [torch.zeros_like(p.data.to_local() if hasattr(p.data, "to_local") else p.data) for p in model.parameters()]
        zeros += [torch.zeros(1, device=self.t.cluster.device) for _ in range(riders)]
        try:
            average(self.t, q, zeros)
        except FederationError as exc:
            log.warning("cluster %s: joining the gradient exchange failed: %s", self.t.name, exc)
            self.t.abort()
