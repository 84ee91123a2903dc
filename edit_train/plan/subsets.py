"""Expert subsets per site in a plan (the verified rule's `expert_subsets`, SPES-style; off by default): which
experts each configured cluster owns, and what leaving the others at home saves it — the one place both
`edit-train plan` and `edit-train-info` (`expert_plan.py`) take these figures from.

* **The map** (`cluster_map`): per configured cluster, the experts it owns, from the product's own parser
  (`local_sgd/experts.owned_experts`, imported only when subsets are on: it brings torch). A spec decided at
  run time (anything but ``split`` or a static map such as ``0+1|2+3``) cannot be resolved before the run: it
  is planned as ``split`` (the same number of experts per cluster), and the note says so.
* **The saving** (`saving`): a cluster's bytes per sync with the unowned experts' rows left out
  (`traffic.sync_bytes(..., unsent=...)`, exact) against every expert sent; the frozen rows' copy it holds per
  rank through each optimizer step (fp32, ``4 × unsent // ranks``: `train/expert_subsets.FrozenRows`); no
  optimizer state saved (the experts are stacked tensors with one AdamW state each).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from edit_train.plan.traffic import Codec, sync_bytes

STATIC = re.compile(r"[0-9+|\s]+")  # a static map: each cluster's experts, 0+1|2+3


def cluster_map(spec: str, clusters: int, experts: int) -> tuple[list[tuple[bool, ...]], str]:
    """(per configured cluster, which experts it owns; a note, "" when the map is static). Raises ValueError
    (one line) for a static map the product refuses. Empty map for "" (off)."""
    if not spec:
        return [], ""
    from edit_train.local_sgd.moe.experts import owned_experts

    note = ""
    if spec != "split" and not STATIC.fullmatch(spec):
        note = (f"expert_subsets={spec} is decided at run time: planned as split ({experts} experts over "
                f"{clusters} clusters)")
        spec = "split"
    owned = [owned_experts(spec, i, clusters, experts) for i in range(clusters)]
    return [o for o in owned if o is not None], note


def home(owned: Sequence[bool], expert_sizes: Sequence[int]) -> list[int]:
    """Per sync unit, the elements a cluster owning `owned` leaves at home: the unowned experts' rows
    (`expert_sizes[u]`: one routed expert's elements in unit u, 0 without experts)."""
    unowned = len(owned) - sum(bool(o) for o in owned)
    return [unowned * n for n in expert_sizes]


def saving(units: Sequence[int], unsent: Sequence[int], world: int, codec: Codec | str, *, ranks: int = 1,
           paired: bool = True, chunks: int = 4, gather_max: int = 4,
           needs: str = "measurements") -> dict[str, int | float]:
    """What one cluster saves by leaving `unsent` (per unit) at home, in a sync among `world` clusters."""
    every, nbytes = (sync_bytes(units, world, codec, ranks=ranks, paired=paired, chunks=chunks, gather_max=gather_max,
                                needs=needs, unsent=left) for left in (None, unsent))
    return {"unsent_params_per_sync": sum(unsent), "bytes_per_sync": nbytes, "bytes_per_sync_every_expert": every,
            "bytes_saved_per_sync": every - nbytes, "bytes_saved_fraction": (every - nbytes) / every if every else 0.0,
            "frozen_copy_bytes_per_rank": 4 * sum(unsent) // max(ranks, 1),  # fp32 rows held through a step
            "optimizer_bytes_saved_per_rank": 0}  # stacked experts: one AdamW state per tensor
