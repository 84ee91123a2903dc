"""What expert subsets per site save, per configured cluster, as `edit-train-info` reports it (a plan of the
configuration, like `memplan.py`: bytes from `plan/traffic.py`, which the training core never imports)."""

from __future__ import annotations

import torch

from edit_train.config import Config
from edit_train.train.expert_subsets import subsets_spec


def subsets_plan(cfg: Config) -> dict | None:
    """What expert subsets save, per configured cluster (`edit-train-info`): the experts it owns, the elements
    it leaves at home per sync, its sync's bytes (payload and tags, `plan/traffic.sync_bytes`, gathered at one
    rank per cluster: exact) against every expert sent, and the memory the frozen rows' copy costs per rank
    (`plan/subsets.saving`, the planner's figures too). None when off."""
    from edit_train.cluster.mesh import fsdp_units
    from edit_train.config import cluster_specs
    from edit_train.local_sgd.moe.experts import UnitExperts
    from edit_train.local_sgd.sync.round import build_units
    from edit_train.model import CausalLM
    from edit_train.model.expert_params import sync_pieces
    from edit_train.plan.subsets import cluster_map, saving

    spec = subsets_spec(cfg)
    if not (spec and cfg.model.num_experts):
        return None
    with torch.device("meta"):
        model = CausalLM(cfg.model)
    units = build_units(model, fsdp_units(model))
    pieces = sync_pieces(model)
    found = [(u, pieces(u.name, u.module, u.params)) for u in units]
    numels = [sum(p.numel() for p in u.params) for u in units]
    specs = cluster_specs(cfg)
    world = len(specs)
    owners, note = cluster_map(spec, world, cfg.model.num_experts)  # `routed`: split's sizes (the note says so)
    out: dict = {}
    for s in specs:
        owned = owners[s.index]
        home = [UnitExperts.of(f[0], f[1], u.params).unsent(owned, u.params) if f else 0 for u, f in found]
        out[s.name] = {"experts": [e for e, o in enumerate(owned) if o] if not note else note,
                       **saving(numels, home, world, cfg.sync.compression, ranks=cfg.cluster.ranks,
                                gather_max=cfg.sync.gather_max)}
    return out
