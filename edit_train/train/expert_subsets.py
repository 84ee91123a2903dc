"""Expert subsets per site (SPES-style, the verified rule's `expert_subsets`; off by default): this cluster
trains only the experts it owns; every other expert stays frozen at the anchor on it.

Which experts a cluster owns is, for a static map (``split``, ``0+1|2+3``), a pure function of the configuration
and the cluster's configured index (`local_sgd/experts.owned_experts`), so a resumed, restarted or healed cluster
has the same assignment: nothing about it is saved, and a cluster whose config differs is refused by the
configuration fingerprint. Under ``routed`` the sync core decides the map after a warm-up of syncs
(`local_sgd/moe/assignment.py`; checkpointed and healed with the sync state) and the trainer follows it
(`follow`): every expert trains until then, only the cluster's own from the step the map reaches it.

* **Frozen rows.** An expert is whole dim-0 rows of the stacked ``gate_proj``/``up_proj``/``down_proj``
  (`model/expert_params.py`), so its rows share one parameter — and one AdamW state — with the owned experts':
  they cannot be left out of the optimizer. `FrozenRows` zeroes their gradients (before the clip: Adam's
  moments for them stay 0) and copies the rows before each optimizer step, and writes them back after it: the
  rows change only at a sync, where they take the merged anchor. Exact, whatever the weight
  decay; the memory it costs is the copy (the unowned share of the expert rows), and it saves none (the
  optimizer state is per stacked tensor).
* **The counts it reports** (`RoutedTally`): 0 for the experts it does not own (`experts.owned_counts`), so the
  sync leaves them out of what it sends and out of their merge (docs/sync_math.md, "Expert subsets").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from edit_train.config import Config
from edit_train.local_sgd.moe.experts import Owned, layer_mask
from edit_train.model.expert_params import EXPERT_PARAMS
from edit_train.model.moe import MoEBlock


def _local(p: Tensor) -> Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


class FrozenRows:
    """The rows of the experts this cluster does not own, held through each optimizer step."""

    def __init__(self, model: nn.Module, owned: Owned) -> None:
        self.owned = owned  # one mask for every MoE layer (a static map) or one per layer (routed)
        self.params: list[tuple[nn.Parameter, Tensor]] = []  # (stacked parameter, local rows to hold)
        blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]  # in MoE-layer order, as the counts
        for layer, block in enumerate(blocks):
            mask = layer_mask(owned, layer)
            assert mask is not None
            for name in EXPERT_PARAMS:
                p = getattr(block.experts, name)
                rows = self._local_rows(p, mask)
                if rows.numel():
                    self.params.append((p, rows))
        self.saved: list[Tensor] = []

    @staticmethod
    def _local_rows(p: Tensor, owned: Sequence[bool]) -> Tensor:
        """This rank's local dim-0 rows of `p` that belong to experts it does not own (FSDP2 Shard(0) layout)."""
        from edit_train.local_sgd.evidence import shard_range

        placements = getattr(p, "placements", None)
        if placements is not None:
            mesh = p.device_mesh
            lo, hi = shard_range(p, mesh.get_local_rank(), mesh.size())
        else:
            lo, hi = 0, p.shape[0]
        frozen = [r - lo for r in range(lo, hi) if not owned[r]]
        return torch.tensor(frozen, dtype=torch.int64)

    @property
    def elements(self) -> int:
        """Parameter elements this rank holds frozen (what one copy of them costs)."""
        return sum(int(rows.numel()) * (_local(p).numel() // max(_local(p).shape[0], 1)) for p, rows in self.params)

    @torch.no_grad()
    def hold(self) -> None:
        """Before an optimizer step (and its gradient clip): zero the frozen rows' gradients and copy the rows."""
        for p, rows in self.params:
            if p.grad is not None:
                _local(p.grad).index_fill_(0, rows.to(_local(p.grad).device), 0.0)
        self.saved = [_local(p).detach().index_select(0, rows.to(_local(p).device)) for p, rows in self.params]

    @torch.no_grad()
    def restore(self) -> None:
        """After it: write them back (the step's weight decay and any momentum never touch them)."""
        for (p, rows), kept in zip(self.params, self.saved):
            _local(p).index_copy_(0, rows.to(kept.device), kept)
        self.saved = []


def subsets_spec(cfg: Config) -> str:
    """The rule's expert subsets ("" off or without local SGD): asked of the rule, never read by its name."""
    from edit_train.local_sgd.aggregator import capabilities_of
    from edit_train.local_sgd.aggregation.rules import make_rule

    return capabilities_of(make_rule(cfg.algo.rule)).expert_subsets if cfg.algo.local_sgd else ""


def frozen_rows(cfg: Config, model: nn.Module, index: int, clusters: int) -> FrozenRows | None:
    """This cluster's frozen rows under the rule's expert subsets (None: off, no MoE layer, or no local SGD)."""
    from edit_train.local_sgd.moe.experts import owned_experts

    spec = subsets_spec(cfg)
    if not spec:
        return None
    if not any(isinstance(m, MoEBlock) for m in model.modules()):
        return None
    owned = owned_experts(spec, index, clusters, cfg.model.num_experts)
    return FrozenRows(model, owned) if owned is not None else None


def follow(current: FrozenRows | None, model: nn.Module, owned: Owned | None) -> FrozenRows | None:
    """Under ``routed``: the frozen rows for the map the sync core holds now (`owned`, per MoE layer; None: not
    decided or not routed — `current` stays). A new FrozenRows when the map is new to this trainer (decided,
    healed in, resumed); `current` itself otherwise."""
    if owned is None or (current is not None and current.owned == owned):
        return current
    return FrozenRows(model, owned)
