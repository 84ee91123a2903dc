"""Which experts this cluster fed: the tokens its MoE layers routed to each expert over each interval.

The MoE blocks add every training forward's counts to a device tensor (`CausalLM.expert_counts`, no host
sync per step). `RoutedTally.take` closes an interval: it reads the counts, sums them over the cluster's ranks
(each rank routed its own micro-batch), resets them and logs one `experts` event {step, cluster, cluster_index,
interval, steps, layers, counts [MoE layers][experts]}. An interval is the local steps one sync contributes —
the sync core takes the counts itself when a round's exchange starts (`hook`, `local_sgd/moe/experts.py`: they ride
the exchange to every cluster and weigh the experts' rows; a missed sync does not close the interval) —, or
`log_every` steps without local SGD (ddp, the synchronous warm-up: `due`). `edit-train-report` draws from these
events which cluster feeds which expert (report/experts.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from edit_train.cluster.mesh import Topology
from edit_train.local_sgd.moe.expert_bias import BiasHook
from edit_train.local_sgd.moe.experts import Owned, RoutedCounts, layer_mask, owned_counts
from edit_train.model import CausalLM
from edit_train.model.config import ModelConfig
from edit_train.model.expert_params import sync_pieces


class RoutedTally:
    def __init__(self, model: CausalLM, topo: Topology, emit: Callable[..., None], step: Callable[[], int],
                 local_sgd: bool, warmup_steps: int, log_every: int,
                 owned: Callable[[], Owned | None] = lambda: None) -> None:
        self.model, self.topo, self.emit, self.step = model, topo, emit, step
        self.owned = owned  # expert subsets: the experts this cluster owns now (None: every one)
        self.local_sgd, self.warmup_steps, self.log_every = local_sgd, warmup_steps, max(log_every, 1)
        self.layers = model.moe_layers()
        self.steps = 0  # training steps in the open interval
        self.intervals = 0  # intervals this incarnation closed
        self.hooked = False  # the sync core closes the local-SGD intervals (`hook`)

    def hook(self) -> RoutedCounts | None:
        """What the sync core takes the counts with (None: no MoE layer, or no local SGD)."""
        if not self.layers or not self.local_sgd:
            return None
        self.hooked = True
        return RoutedCounts(self.take, sync_pieces(self.model))

    def counted(self) -> None:
        """One more training step in the open interval."""
        self.steps += 1

    def due(self, step: int, local_steps: int) -> bool:
        """Whether the interval closes after `step` steps: a sync began in this step (`local_steps`, the
        local steps since the last sync, is back to 0), or without local SGD every `log_every` steps."""
        if not self.layers or self.steps == 0:
            return False
        if self.local_sgd and step > self.warmup_steps:
            return local_steps == 0 and not self.hooked
        return step % self.log_every == 0 or step == self.warmup_steps

    def take(self) -> torch.Tensor:
        """This cluster's routed tokens per expert since the last take, summed over its ranks: ``[MoE layers,
        experts]`` int64 on the CPU. Resets the counts and logs the interval (every rank of the cluster calls
        it at the same point: the sum is a collective over the cluster's ranks)."""
        counts = self.model.expert_counts().clone()
        self.model.reset_expert_counts()
        if self.topo.distributed and self.topo.ranks > 1:
            dist.all_reduce(counts, group=self.topo.shard_pg)
        counts = counts.cpu()
        if self.topo.is_leader:
            self.emit("experts", step=self.step(), cluster_index=self.topo.index, cluster=self.topo.name,
                      interval=self.intervals, steps=self.steps, layers=self.layers, counts=counts.tolist())
        self.intervals += 1
        self.steps = 0
        return owned_counts(counts, self.owned())  # what it sends: 0 for an expert it does not own (the event: all)


def expert_bias_hook(model: CausalLM, cfg: ModelConfig, owned: Callable[[], Owned | None] = lambda: None
                     ) -> BiasHook | None:
    """The sync core's handle on the routers' expert bias (`local_sgd/moe/expert_bias.py`, algo.expert_bias): every MoE
    block's ``gate.expert_bias`` as one [MoE layers, experts] table, read and written (every rank holds the same);
    `owned`: the experts this cluster owns now under expert subsets. None without an expert bias."""
    blocks = [b for b in model.moe_blocks() if b.gate.expert_bias is not None]
    if not blocks or not cfg.moe_router_enable_expert_bias:
        return None

    def get() -> torch.Tensor:
        return torch.stack([b.gate.expert_bias.detach().to("cpu", torch.float32) for b in blocks])

    @torch.no_grad()
    def put(table: torch.Tensor) -> None:
        for b, row in zip(blocks, table):
            b.gate.expert_bias.copy_(row.to(b.gate.expert_bias.device, torch.float32))

    def mask() -> torch.Tensor | None:
        o = owned()
        if o is None:
            return None
        return torch.tensor([list(layer_mask(o, i) or ()) for i in range(len(blocks))], dtype=torch.bool)

    return BiasHook(get, put, cfg.moe_router_bias_update_rate, cfg.moe_router_bias_update_zero_mean,
                    cfg.num_experts_per_tok, mask)
