"""Aux-loss-free balancing across clusters: what a sync does to the MoE routers' expert bias (`algo.expert_bias`).

A Ling 2.0 router chooses experts on score + bias; every optimizer step moves the bias by the public update rule
``u · sign(mean(load) − load)`` (zero-mean), from that step's load (`model/moe.bias_update`). Between syncs every
cluster does that from its own data. At a sync (each MoE layer, each expert):

* ``mean``   — the anchor's bias is the clusters' mean; every cluster continues from it.
* ``global`` — every cluster applies the update rule to the federation's load of the interval: the routed counts
  the exchange carries (`experts.py`), summed over the clusters, per token of the clusters that own the expert.
  The anchor's bias is b̄ + s · update(load), s the quorum's lower-median local steps (an interval of s steps from
  one sign); every cluster continues from it, so all hold the same bias, as if one cluster had seen every
  cluster's tokens.
* ``local``  — every cluster keeps its own bias across syncs; the anchor (what a joiner starts from, what the
  run ends on and exports) carries the ``global`` bias.

The bias never passes through the outer optimizer or the rule's norm tests. What a cluster reports is a claim,
bounded by what its tokens trained can hold: no expert more than its bounded tokens T, no layer more than k·T in
all (top-k: every token picks k experts, each once); a bias no further from the anchor's than its steps can move
it (2·u per step, steps at most `STEPS_MULTIPLE` times the quorum's lower median). A claim over a bound is cut to
it and its cluster named (the `sync` event's `suspects`).

Expert subsets (`expert_subsets`): each cluster also reports which experts it owns (all of them without
subsets). An expert a cluster does not own gets no bias update from it: its counts and bias do not enter that
expert's load or mean; an expert nobody owns keeps the anchor's bias.

Pure tensor math on [clusters, MoE layers, experts]; the model's side is a `BiasHook` (the trainer's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["RULES", "STEPS_MULTIPLE", "BiasHook", "BiasSync", "sign_update", "bound_counts", "bound_biases",
           "global_update", "mean_bias", "max_violation", "maxvio_of"]

RULES = ("mean", "global", "local")
STEPS_MULTIPLE = 4.0  # a bias counts at most this many times the quorum's lower-median steps of moves


@dataclass(frozen=True)
class BiasHook:
    """The model's side (the trainer's): the routers' expert bias, [MoE layers, experts] (every rank of a cluster
    holds the same), read and written; `owned()`: which experts this cluster owns ([layers, experts] bool, None:
    all)."""

    get: Callable[[], Tensor]
    set: Callable[[Tensor], None]
    rate: float  # model.moe_router_bias_update_rate (u)
    zero_mean: bool  # model.moe_router_bias_update_zero_mean
    top_k: int  # model.num_experts_per_tok
    owned: Callable[[], Tensor | None] = lambda: None


def sign_update(load: Tensor, rate: float, zero_mean: bool = True, active: Tensor | None = None) -> Tensor:
    """The public update rule per row of `load` [..., E] (float64): ``rate · sign(mean(load) − load)`` over the
    `active` experts (bool, default all; the others: 0), minus its mean over them when `zero_mean`. Equal to
    `model.moe.bias_update` on a row with every expert active."""
    load = load.to(torch.float64)
    act = torch.ones_like(load, dtype=torch.bool) if active is None else active.to(torch.bool)
    n = act.sum(-1, keepdim=True).clamp_min(1)
    mean = torch.where(act, load, torch.zeros_like(load)).sum(-1, keepdim=True) / n
    delta = torch.where(act, rate * torch.sign(mean - load), torch.zeros_like(load))
    if zero_mean:
        delta = torch.where(act, delta - delta.sum(-1, keepdim=True) / n, delta)
    return delta


def _water_fill(rows: Tensor, cap: Tensor) -> Tensor:
    """Each row of `rows` [..., E] (>= 0) with its largest values cut down to one level τ, the least cut that brings
    its sum to `cap` [..., 1] (rows within it unchanged): what is over the bound is taken from the inflated counts,
    not from the rest."""
    a, _ = rows.sort(-1)  # ascending
    n = a.shape[-1]
    below = torch.cat([torch.zeros_like(a[..., :1]), a.cumsum(-1)[..., :-1]], -1)  # Σ of the m smallest, m = 0..n-1
    m = torch.arange(n, dtype=a.dtype)
    tau = (cap - below) / (n - m)  # the level if the n - m largest are cut to it
    lo = torch.cat([torch.zeros_like(a[..., :1]), a[..., :-1]], -1)
    ok = (tau >= lo) & (tau <= a)
    level = torch.where(ok, tau, torch.full_like(tau, math.inf)).amin(-1, keepdim=True)
    return torch.where(rows.sum(-1, keepdim=True) > cap, torch.minimum(rows, level), rows)


def bound_counts(counts: Tensor, tokens: Tensor, top_k: int) -> tuple[Tensor, list[int]]:
    """Each cluster's routed counts [P, L, E] as the federation takes them: within [0, T] per expert and at most
    k·T per layer (the largest cut down to one level until it fits), T its bounded tokens `tokens` [P]; non-finite
    counts count as T. Returns (the bounded counts, the clusters whose counts were cut)."""
    t = tokens.to(torch.float64).clamp_min(0).reshape(-1, 1, 1)
    c = counts.to(torch.float64)
    c = torch.where(torch.isfinite(c), c, t.expand_as(c))
    out = _water_fill(torch.minimum(c.clamp_min(0), t), t * top_k)
    cut = [i for i in range(c.shape[0]) if not torch.equal(out[i], counts[i].to(torch.float64))]
    return out, cut


def bound_biases(biases: Tensor, anchor: Tensor, steps: Tensor, rate: float) -> tuple[Tensor, list[int]]:
    """Each cluster's bias [P, L, E] within ``anchor ± 2·rate·s`` (s its local steps, at most STEPS_MULTIPLE
    times the quorum's lower median; a non-finite bias is the anchor's). Returns (bounded, clusters cut)."""
    s = steps.to(torch.float64).clamp_min(0)
    s0 = sorted(s.tolist())[(len(s) - 1) // 2] if len(s) else 0.0
    reach = (2.0 * rate * torch.minimum(s, torch.full_like(s, STEPS_MULTIPLE * s0))).reshape(-1, 1, 1)
    b = biases.to(torch.float64)
    a = anchor.to(torch.float64).unsqueeze(0).expand_as(b)
    b = torch.where(torch.isfinite(b), b, a)
    out = torch.maximum(torch.minimum(b, a + reach), a - reach)
    # a difference within float rounding of the reach is not a lie (a float32 bias moved by float64 steps)
    cut = [i for i in range(b.shape[0]) if bool(((out[i] - biases[i].to(torch.float64)).abs() > 1e-6 * (1 + reach[i])).any()
                                                 or not torch.isfinite(biases[i]).all())]
    return out, cut


def _owned(owned: Tensor | None, shape: torch.Size) -> Tensor:
    return torch.ones(shape, dtype=torch.bool) if owned is None else owned.to(torch.bool)


def global_update(counts: Tensor, tokens: Tensor, steps: float, rate: float, zero_mean: bool = True,
                  owned: Tensor | None = None) -> Tensor:
    """[L, E]: what ``global`` adds to the anchor's bias: ``steps · sign_update(ℓ)``, ℓₑ = Σᵢ cᵢₑ / Σᵢ Tᵢ over the
    clusters i that own e (the federation's load per token that could have reached it; without subsets the plain
    summed load over the total tokens). An expert nobody owns (or no owner trained a token) gets nothing."""
    own = _owned(owned, counts.shape)
    c = torch.where(own, counts.to(torch.float64), torch.zeros((), dtype=torch.float64))
    backing = torch.where(own, tokens.to(torch.float64).reshape(-1, 1, 1).expand(counts.shape),
                          torch.zeros((), dtype=torch.float64)).sum(0)
    active = backing > 0
    load = torch.where(active, c.sum(0) / backing.clamp_min(1e-300), torch.zeros_like(backing))
    return steps * sign_update(load, rate, zero_mean, active)


def mean_bias(biases: Tensor, anchor: Tensor, owned: Tensor | None = None) -> Tensor:
    """[L, E]: ``mean``'s anchor: per expert, the mean of the owners' biases (the anchor's where nobody owns it)."""
    own = _owned(owned, biases.shape)
    n = own.sum(0)
    total = torch.where(own, biases.to(torch.float64), torch.zeros((), dtype=torch.float64)).sum(0)
    return torch.where(n > 0, total / n.clamp_min(1), anchor.to(torch.float64))


def max_violation(load: Tensor, active: Tensor | None = None) -> Tensor:
    """MaxVio per row of `load` [..., E] (the aux-loss-free papers' imbalance): max over the (active) experts of
    load / mean load − 1; 0 for a row without load."""
    load = load.to(torch.float64)
    act = torch.ones_like(load, dtype=torch.bool) if active is None else active.to(torch.bool)
    n = act.sum(-1).clamp_min(1)
    mean = torch.where(act, load, torch.zeros_like(load)).sum(-1) / n
    top = torch.where(act, load, torch.full_like(load, -math.inf)).amax(-1)
    return torch.where(mean > 0, top / mean.clamp_min(1e-300) - 1.0, torch.zeros_like(mean))


def maxvio_of(names: Sequence[str], counts: Tensor, owned: Tensor | None = None) -> dict[str, Any]:
    """The `sync` event's MaxVio: per cluster (over the experts it owns) and of the federation's summed load, per
    MoE layer."""
    own = _owned(owned, counts.shape)
    per = {n: [round(float(v), 6) for v in max_violation(counts[i], own[i])] for i, n in enumerate(names)}
    return {"clusters": per, "federation": [round(float(v), 6) for v in max_violation(counts.sum(0))]}


@dataclass
class BiasSync:
    """One cluster's expert-bias state across syncs: the anchor's bias and the rule (`algo.expert_bias`).

    The round calls `payload()` at its exchange (what rides in the small all-gather: owned ‖ bias, 2·L·E values),
    `committed(...)` when it commits (this cluster's live bias set, the anchor's moved); checkpoints and heals
    carry `state_json()` (JSON floats: bit-exact for float32 biases)."""

    rule: str
    hook: BiasHook
    anchor: Tensor | None = None  # [L, E] float64
    snap: Tensor | None = None  # the live bias at the exchange (overlap: its progress since is kept)
    last: dict[str, Any] = field(default_factory=dict)  # what the last commit measured (the `sync` event)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"algo.expert_bias={self.rule!r}: use one of {', '.join(RULES)}")

    def live(self) -> Tensor:
        return self.hook.get().detach().to("cpu", torch.float64)

    def start(self) -> None:
        """The local phase starts (every cluster holds the same bias): the anchor's bias is the live one."""
        if self.anchor is None:
            self.anchor = self.live().clone()

    @property
    def width(self) -> int:
        return 2 * self.live().numel()

    def payload(self) -> list[float]:
        live = self.live()
        self.start()
        self.snap = live.clone()
        owned = self.hook.owned()
        own = torch.ones_like(live) if owned is None else owned.to(torch.float64)
        return torch.cat([own.reshape(-1), live.reshape(-1)]).tolist()

    def read(self, columns: Tensor) -> tuple[Tensor, Tensor]:
        """The exchange's columns [P, 2·L·E] -> (owned [P, L, E] bool, biases [P, L, E])."""
        assert self.anchor is not None
        shape = (columns.shape[0], *self.anchor.shape)
        half = self.anchor.numel()
        return columns[:, :half].reshape(shape) > 0.5, columns[:, half:].reshape(shape).to(torch.float64)

    def new_anchor(self, counts: Tensor | None, columns: Tensor, steps: Tensor, tokens: Tensor,
                   name: Callable[[int, str], None] = lambda i, what: None) -> Tensor:
        """The anchor's bias after this sync (every cluster computes the same from the exchange). `counts` [P, L,
        E] the routed counts reported, `steps` / `tokens` [P] the bounded claims; `name(i, what)` names a liar."""
        assert self.anchor is not None
        owned, biases = self.read(columns)
        h = self.hook
        if self.rule == "mean":
            bounded, cut = bound_biases(biases, self.anchor, steps, h.rate)
            for i in cut:
                name(i, f"reported an expert bias further from the anchor's than its {float(steps[i]):.0f} steps "
                        f"can move it (2·{h.rate:g} per step; cut to that)")
            return mean_bias(bounded, self.anchor, owned)
        if counts is None:  # no routed counts exchanged (no MoE layer hooked): nothing to balance on
            return self.anchor.clone()
        bounded, cut = bound_counts(counts, tokens, h.top_k)
        for i in cut:
            name(i, f"reported routed counts over what its {float(tokens[i]):.4g} tokens can hold (an expert at most "
                    f"once per token, {h.top_k} per token in all; cut to that)")
        s = sorted(steps.clamp_min(0).tolist())[(len(steps) - 1) // 2] if len(steps) else 0.0
        return self.anchor + global_update(bounded, tokens, s, h.rate, h.zero_mean, owned)

    @torch.no_grad()
    def committed(self, names: Sequence[str], counts: Tensor | None, columns: Tensor, steps: Tensor,
                  tokens: Tensor, name: Callable[[int, str], None] = lambda i, what: None) -> None:
        """The round committed: the anchor's bias moves; this cluster's live bias follows it (``mean``,
        ``global``: plus what it moved since the exchange) or stays its own (``local``)."""
        anchor = self.new_anchor(counts, columns, steps, tokens, name)
        live = self.live()
        if self.rule != "local":
            moved = live - self.snap if self.snap is not None and self.snap.shape == live.shape else 0.0
            self.hook.set((anchor + moved).to(torch.float32))
        self.anchor, self.snap = anchor, None
        owned, _ = self.read(columns)
        self.last = {"rule": self.rule, "maxvio": maxvio_of(names, counts, owned) if counts is not None else {},
                     "spread": round(float(self.read(columns)[1].std(0, unbiased=False).max()), 9)
                     if columns.shape[0] > 1 else 0.0}

    def rolled_back(self) -> None:
        self.snap = None

    def to_anchor(self) -> None:
        """The run ends (every cluster on θ̄) or a joiner starts: the live bias is the anchor's."""
        if self.anchor is not None:
            self.hook.set(self.anchor.to(torch.float32))

    # ------------------------------------------------------------------ checkpoint / heal
    def state_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "anchor": self.anchor.tolist() if self.anchor is not None else None}

    def load_json(self, state: Any, source: str) -> None:
        """Adopt a checkpoint's or heal payload's state (ValueError, one line, for a malformed one)."""
        if state is None:
            return
        anchor = state.get("anchor") if isinstance(state, dict) else "?"
        if anchor is None:
            self.anchor = None
            return
        shape = tuple(self.live().shape)
        try:
            t = torch.tensor(anchor, dtype=torch.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{source}: expert_bias anchor is not a table of numbers") from None
        if tuple(t.shape) != shape or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{source}: expert_bias anchor has shape {tuple(t.shape)} (want {shape}) or non-finite "
                             "values")
        self.anchor = t
