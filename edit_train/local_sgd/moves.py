"""How a sync's contributions move — decided in one place, torch-free: the round (`round.py`), the planner
(`plan/traffic.py`) and the federation's lanes (`federation/modules.py`) all ask these two functions.

* ``sum``: a rule that decides from what every cluster reported (`Needs.SUM`) — or a cluster alone — has every
  cluster send w·Δ into a SUM;
* ``gathered``: every cluster receives every contribution: a rule that needs the contributions, or one that
  needs measurements among at most `gather_max` clusters (or with no sketches to check a SUM by, or sparse
  payloads, whose SUM moves every contribution anyway);
* ``sketched``: a rule that needs measurements above `gather_max` clusters: a SUM checked against count
  sketches at the vote (`sketch_check.py`; a check that fails gathers that sync again).
"""

from __future__ import annotations

MODES = ("sum", "gathered", "sketched")


def aggregation(needs: str, clusters: int, gather_max: int, sketch_dim: int, sparse: bool = False) -> str:
    """How `clusters` clusters' contributions move for a rule that needs `needs` ("sum", "measurements",
    "contributions"): one of MODES (the `sync` event's `aggregation`)."""
    if clusters <= 1 or needs == "sum":
        return "sum"
    if needs == "contributions" or clusters <= gather_max or sketch_dim <= 0 or sparse:
        return "gathered"
    return "sketched"


def wire(mode: str, sparse: bool) -> str:
    """What a lane does with a unit's payload in `mode`: "gather" (each cluster's own goes to every cluster) or
    "sum" (a reduction). A SUM of sparse payloads is a gather of tagged pieces, summed where they land."""
    return "gather" if mode == "gathered" or sparse else "sum"
