"""The EDiT aggregator over a changing set of clusters.

`PseudoGradAggregator` keeps its statistics as per-worker vectors. In a federation the workers of a sync
are whoever the quorum holds, so statistics are kept per cluster *name* (a roster slot each, in order of
first appearance, identical on every cluster because a cluster that missed a quorum heals the roster
before it takes part again). For each sync the rows of the contributing clusters are cut out, the
unchanged aggregator decides on them, and the rows are written back. Absent clusters keep their
statistics; participants with nothing to contribute (no local step since their anchor) get weight 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from edit_train.local_sgd.penalty import Decision, PenaltyConfig, PseudoGradAggregator


class RosterAggregator:
    def __init__(self, cfg: PenaltyConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.roster: list[str] = []
        self._rows: dict[str, Tensor] = {}  # "<module>/<field>" -> [len(roster), ...]

    def _admit(self, names: Sequence[str]) -> None:
        new = [n for n in names if n not in self.roster]
        if not new:
            return
        self.roster.extend(new)
        for key, val in self._rows.items():
            pad = torch.zeros((len(new), *val.shape[1:]), dtype=val.dtype)
            self._rows[key] = torch.cat([val, pad])

    def decide(self, module: str, norms: Tensor, names: Sequence[str], contributes: Sequence[bool],
               steps: Tensor | Sequence[float] | None = None) -> Decision:
        """One module's decision for the participants `names` (rows of `norms`, in that order)."""
        g = torch.as_tensor(norms, dtype=torch.float64).reshape(-1)
        idx = [i for i, c in enumerate(contributes) if c]
        self._admit([names[i] for i in idx])
        if not idx:
            n = len(names)
            return Decision(module=module, norms=g.tolist(), weights=[0.0] * n, anomalous=[False] * n,
                            z=[0.0] * n, all_anomalous=True)
        slots = torch.tensor([self.roster.index(names[i]) for i in idx])
        sub = PseudoGradAggregator(self.cfg, len(idx))
        mine = {k: v.index_select(0, slots) for k, v in self._rows.items() if k.rsplit("/", 1)[0] == module}
        if mine:
            sub.load_state_dict(mine)
        s = None if steps is None else torch.as_tensor(steps, dtype=torch.float64).reshape(-1)[idx]
        d = sub.decide(module, g[idx], s)
        for key, val in sub.state_dict().items():
            full = self._rows.get(key)
            if full is None:
                full = torch.zeros((len(self.roster), *val.shape[1:]), dtype=val.dtype)
            full = full.clone()
            full[slots] = val
            self._rows[key] = full
        return _expand(d, idx, len(names), g)

    # ------------------------------------------------------------- state
    def state_tensors(self) -> dict[str, Tensor]:
        return {k: v.clone().contiguous() for k, v in self._rows.items()}

    def load(self, roster: list[str], tensors: dict[str, Tensor]) -> None:
        for key, val in tensors.items():
            if val.shape[0] != len(roster):
                raise ValueError(f"penalty state: {key!r} has {val.shape[0]} rows for {len(roster)} clusters")
        self.roster = list(roster)
        self._rows = {k: v.clone() for k, v in tensors.items()}


def _expand(d: Decision, idx: list[int], n: int, g: Tensor) -> Decision:
    """Spread a decision over k contributors to all n participants (others: weight 0, not anomalous)."""
    k = len(idx)
    out = {}
    for f in dataclasses.fields(d):
        val = getattr(d, f.name)
        if isinstance(val, list) and len(val) == k and f.name != "norms":
            default = False if val and isinstance(val[0], bool) else 0.0
            full = [default] * n
            for j, i in enumerate(idx):
                full[i] = val[j]
            out[f.name] = full
    out["norms"] = g.tolist()
    return dataclasses.replace(d, **out)
