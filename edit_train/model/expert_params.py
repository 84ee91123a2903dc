"""Which rows of a sync unit's parameters belong to which routed expert (for expert-aware merging).

A routed expert ``e`` of an MoE block is exactly rows ``e`` (dim 0) of its stacked ``experts.gate_proj``,
``experts.up_proj`` ``[E, I, H]`` and ``experts.down_proj`` ``[E, H, I]``. The router (``mlp.gate.weight``,
``[E, H]``) is *not* an expert's: every token's softmax trains all its rows, so it is merged like the shared
modules, as are attention, norms and the shared experts. Rows of ``CausalLM.expert_counts()`` are the MoE
layers in order: `count_rows` says which row counts the tokens of which unit.

Pure functions of module structure; `local_rows` maps an expert's rows onto one rank's FSDP2 shard (dim-0
``Shard(0)``, ``torch.chunk`` layout: ``ceil(rows / ranks)`` rows per rank, the last ranks short or empty).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from edit_train.model.moe import MoEBlock

Pieces = list[list[tuple[int, slice]]]  # per expert: (index into the unit's params, rows of that parameter)

EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")  # the stacked [E, ...] parameters of RoutedExperts


def expert_slices(unit: nn.Module, params: list[nn.Parameter]) -> dict[str, list[list[tuple[int, slice]]]]:
    """For each MoE block inside `unit` (by its name in the unit, e.g. ``"mlp"``), per expert ``e`` the pieces
    that are expert ``e``'s: ``(index into params, rows along dim 0 of that full parameter)``. `params` is the
    unit's parameter list as the sync holds it (`local_sgd.round.Unit.params`); a parameter not in it (owned by
    another unit) is left out. Empty for a unit with no MoE block."""
    index = {id(p): i for i, p in enumerate(params)}
    out: dict[str, list[list[tuple[int, slice]]]] = {}
    for name, block in unit.named_modules():
        if not isinstance(block, MoEBlock):
            continue
        stacked = [getattr(block.experts, n) for n in EXPERT_PARAMS]
        out[name] = [[(index[id(p)], slice(e, e + 1)) for p in stacked if id(p) in index]
                     for e in range(block.num_experts)]
    return out


def count_rows(model: nn.Module) -> dict[str, int]:
    """Unit name (``layers.{i}``, as ``model.named_modules()`` names it) -> its row of ``expert_counts()``."""
    layers = getattr(model, "layers", [])
    moe = [i for i, layer in enumerate(layers) if isinstance(getattr(layer, "mlp", None), MoEBlock)]
    return {f"layers.{i}": row for row, i in enumerate(moe)}


def sync_pieces(model: nn.Module) -> Callable[[str, nn.Module, list[nn.Parameter]], tuple[int, Pieces] | None]:
    """What the sync core asks of a unit (`local_sgd.experts.RoutedCounts.pieces`): its row of
    ``expert_counts()`` and each expert's rows of its parameters, or None for a unit without an MoE block."""
    rows = count_rows(model)

    def pieces(name: str, unit: nn.Module, params: list[nn.Parameter]) -> tuple[int, Pieces] | None:
        blocks = expert_slices(unit, params) if name in rows else {}
        if len(blocks) != 1:  # a unit is one decoder layer: one MoE block or none
            return None
        return rows[name], next(iter(blocks.values()))
    return pieces


def local_rows(rows: slice, dim0: int, shard_rank: int, shard_size: int) -> slice | None:
    """`rows` (of a parameter with `dim0` rows) as rows of rank `shard_rank`'s dim-0 shard out of
    `shard_size`, or None when that rank holds none of them."""
    per = -(-dim0 // shard_size)
    lo, hi = shard_rank * per, min((shard_rank + 1) * per, dim0)
    start, stop = max(rows.start, lo), min(rows.stop, hi)
    return slice(start - lo, stop - lo) if start < stop else None
