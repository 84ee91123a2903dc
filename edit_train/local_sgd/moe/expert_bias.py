"""Aux-loss-free balancing across clusters: what a sync does to the MoE routers' expert bias (`algo.expert_bias`).

A Ling 2.0 router chooses experts on score + bias; every optimizer step moves the bias by the public update rule
``u · sign(mean(load) − load)`` (zero-mean) from that step's load (`model/moe.bias_update`). Per rule:

* ``mean``   — each step's update from the cluster's own load; at a sync the anchor's bias is the clusters' mean
  and every cluster continues from it.
* ``global`` — each step's update from the federation's load, estimated from the last committed interval's
  routed counts (the ones the exchange carries, `experts.py`): each expert's current own load times the
  federation-to-own ratio of that interval, and where the cluster routed nothing to it, the others' load per step. At a sync the anchor's bias is the clusters' biases weighted per expert by the
  tokens each routed to it (a cluster that never routed to an expert had no feedback on it and gives it nothing),
  and every cluster continues from it: all hold the same bias, each step balanced — one interval's lag aside —
  as one cluster that saw every cluster's tokens would balance it. (Applying the rule to the interval's summed load
  once per sync, s steps from one sign, limit-cycles: docs/noniid.md.)
* ``local``  — each step's update from the cluster's own load; the syncs leave every cluster's bias its own. The
  anchor (what a joiner starts from, what the run ends on and exports) is the ``global`` sync's: the biases
  weighted by the tokens each cluster routed to each expert.

The bias never passes through the outer optimizer or the rule's norm tests. What a cluster reports is a claim,
bounded by what its tokens trained can hold: no expert more than its bounded tokens T, no layer more than k·T in
all (top-k: every token picks k experts, each once; the largest counts cut to one level until it fits); a bias no
further from the anchor's than its steps can move it (2·u per step, steps at most `STEPS_MULTIPLE` times the
quorum's lower median). A claim over a bound is cut to it and its cluster named (the `sync` event's `suspects`).

Expert subsets (`expert_subsets`): each cluster also reports which experts it owns (all of them without
subsets; its counts are 0 on the others, `experts.owned_counts`). An expert a cluster does not own gets no bias
update from it: its bias does not enter that expert's mean (nor its counts the load) under any rule; an expert
nobody owns, or (``global``, ``local``) no owner routed a token to, keeps the anchor's bias.

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
           "mean_bias", "max_violation", "maxvio_of"]

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
    over = rows.sum(-1, keepdim=True) > cap * (1 + 1e-12)  # (rounding of an honest k·T is not over)
    return torch.where(over, torch.minimum(rows, level), rows)


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


def bound_biases(biases: Tensor, steps: Tensor, rate: float) -> tuple[Tensor, list[int]]:
    """Each cluster's bias [P, L, E] within ``m ± 4·rate·s`` of m, the quorum's elementwise lower-median bias (the
    same reference on every cluster, a liar's bias cannot move it past an honest one), s its steps (at most
    STEPS_MULTIPLE times the quorum's lower median): two honest clusters that started from one bias are at most
    2·rate per step each from it. A non-finite bias is m. Returns (bounded, clusters cut)."""
    s = steps.to(torch.float64).clamp_min(0)
    s0 = sorted(s.tolist())[(len(s) - 1) // 2] if len(s) else 0.0
    reach = (4.0 * rate * torch.minimum(s, torch.full_like(s, STEPS_MULTIPLE * s0))).reshape(-1, 1, 1)
    b = biases.to(torch.float64)
    finite = torch.isfinite(b)
    ordered = torch.where(finite, b, torch.full_like(b, math.inf)).sort(0).values  # the finite ones first
    at = ((finite.sum(0) - 1).clamp_min(0) // 2).unsqueeze(0)  # the lower median of the finite ones
    m = ordered.gather(0, at)[0]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).unsqueeze(0).expand_as(b)
    b = torch.where(finite, b, m)
    out = torch.maximum(torch.minimum(b, m + reach), m - reach)
    # a difference within float rounding of the reach is not a lie (a float32 bias moved by float64 steps)
    cut = [i for i in range(b.shape[0]) if not bool(finite[i].all())
           or bool(((out[i] - b[i]).abs() > 1e-6 * (1 + reach[i])).any())]
    return out, cut


def _owned(owned: Tensor | None, shape: torch.Size) -> Tensor:
    return torch.ones(shape, dtype=torch.bool) if owned is None else owned.to(torch.bool)


def mean_bias(biases: Tensor, anchor: Tensor, owned: Tensor | None = None, weights: Tensor | None = None) -> Tensor:
    """[L, E]: per expert, the mean of the owners' biases (`weights` [P, L, E]: weighted, e.g. by the tokens each
    routed to the expert); the anchor's where nobody owns it (or no owner has weight)."""
    own = _owned(owned, biases.shape)
    w = own.to(torch.float64) if weights is None else torch.where(own, weights.to(torch.float64), 0.0)
    n = w.sum(0)
    total = (w * biases.to(torch.float64)).sum(0)
    return torch.where(n > 0, total / n.clamp_min(1e-300), anchor.to(torch.float64))


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
    others: Tensor | None = None  # global: the other clusters' load per step of the last committed interval
    own: Tensor | None = None  # global: this cluster's load of that interval (bounded as the others')
    fed: Tensor | None = None  # global: the federation's load of that interval
    load: Tensor | None = None  # the last commit's bounded counts [P, L, E]
    agreed: bool = False  # the anchor came from a committed sync (or a checkpoint / heal of one), not this cluster

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

    def new_anchor(self, counts: Tensor | None, columns: Tensor, steps: Tensor, tokens: Tensor, me: int,
                   name: Callable[[int, str], None] = lambda i, what: None, total: Tensor | None = None) -> Tensor:
        """The anchor's bias after this sync (every cluster computes the same from the exchange): the owners' mean
        of the bounded biases (``global``, ``local``: weighted by the tokens each routed to the expert). `counts` [P, L, E] the routed counts reported, `steps` / `tokens` [P] the bounded
        claims (``local``: a bias is bounded by `total`, every step the cluster claims, since it is never reset),
        `me` this cluster's row; `name(i, what)` names a liar. Under ``global`` it also keeps the other
        clusters' bounded load per step (`others`) for the next interval's updates."""
        assert self.anchor is not None
        owned, biases = self.read(columns)
        h = self.hook
        # local never resets a bias, and the first sync after a warm-up (each cluster moved its own) neither had one
        reach = total if (self.rule == "local" or not self.agreed) and total is not None else steps
        bounded, cut = bound_biases(biases, reach, h.rate)
        for i in cut:
            name(i, f"reported an expert bias further from the quorum's median than {float(reach[i]):.0f} steps can "
                    f"move two clusters apart (4·{h.rate:g} per step; cut to that)")
        if counts is not None:
            load, cut = bound_counts(counts, tokens, h.top_k)
            for i in cut:
                name(i, f"reported routed counts over what its {float(tokens[i]):.4g} tokens can hold (an expert at "
                        f"most once per token, {h.top_k} per token in all; cut to that)")
            self.load = load
            if self.rule == "global":
                self.own = load[me].clone()
                per_step = load / steps.to(torch.float64).clamp_min(1).reshape(-1, 1, 1)
                keep = [i for i in range(load.shape[0]) if i != me]
                self.others = per_step[keep].sum(0) if keep else torch.zeros_like(self.anchor)
                self.fed = load.sum(0)
            if self.rule != "mean":  # the clusters that routed an expert's tokens decide its bias, by how many
                return mean_bias(bounded, self.anchor, owned, load)
        return mean_bias(bounded, self.anchor, owned)

    def step_load(self) -> Callable[[Tensor], Tensor] | None:
        """``global``: this cluster's step load [L, E] -> the federation's, estimated: each expert's current own load
        times the federation-to-own ratio of the last committed interval (feedback every step, at the federation's
        scale), and where this cluster routed it nothing then, the others' load per step of that interval. None
        otherwise (or before the first sync)."""
        if self.rule != "global" or self.others is None or self.own is None or self.fed is None:
            return None
        mine = self.own > 0
        ratio = torch.where(mine, self.fed / self.own.clamp_min(1e-300), torch.ones_like(self.fed))
        add = torch.where(mine, torch.zeros_like(self.others), self.others)

        def federation(load: Tensor) -> Tensor:
            return load.to(torch.float64) * ratio.to(load.device) + add.to(load.device)
        return federation

    @torch.no_grad()
    def committed(self, names: Sequence[str], counts: Tensor | None, columns: Tensor, steps: Tensor,
                  tokens: Tensor, me: int, name: Callable[[int, str], None] = lambda i, what: None,
                  total: Tensor | None = None) -> None:
        """The round committed: the anchor's bias moves; this cluster's live bias follows it (``mean``,
        ``global``: plus what it moved since the exchange) or stays its own (``local``)."""
        anchor = self.new_anchor(counts, columns, steps, tokens, me, name, total)
        live = self.live()
        if self.rule != "local":
            moved = live - self.snap if self.snap is not None and self.snap.shape == live.shape else 0.0
            self.hook.set((anchor + moved).to(torch.float32))
        self.anchor, self.snap, self.agreed = anchor, None, True
        owned, biases = self.read(columns)
        self.last = {"rule": self.rule,
                     "maxvio": maxvio_of(names, self.load, owned) if counts is not None else {},
                     "spread": round(float(biases.std(0, unbiased=False).max()), 9) if columns.shape[0] > 1 else 0.0}

    def rolled_back(self) -> None:
        self.snap = None

    def to_anchor(self) -> None:
        """The run ends (every cluster on θ̄) or a joiner starts: the live bias is the anchor's."""
        if self.anchor is not None:
            self.hook.set(self.anchor.to(torch.float32))

    # ------------------------------------------------------------------ checkpoint / heal
    def state_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "anchor": self.anchor.tolist() if self.anchor is not None else None,
                **{k: (getattr(self, k).tolist() if getattr(self, k) is not None else None)
                   for k in ("others", "own", "fed")}, "agreed": self.agreed}

    def load_json(self, state: Any, source: str) -> None:
        """Adopt a checkpoint's or heal payload's state (ValueError, one line, for a malformed one)."""
        if state is None:
            return
        if not isinstance(state, dict):
            raise ValueError(f"{source}: expert_bias is {type(state).__name__}, not a record")
        anchor = state.get("anchor")
        if anchor is None:
            self.anchor = None
            return
        self.agreed = bool(state.get("agreed", True))
        self.anchor = _table(anchor, tuple(self.live().shape), source, "anchor")
        for k in ("others", "own", "fed"):
            v = state.get(k)
            setattr(self, k, None if v is None else _table(v, tuple(self.live().shape), source, k))


def _table(values: Any, shape: tuple[int, ...], source: str, what: str) -> Tensor:
    try:
        t = torch.tensor(values, dtype=torch.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: expert_bias {what} is not a table of numbers") from None
    if tuple(t.shape) != shape or not bool(torch.isfinite(t).all()):
        raise ValueError(f"{source}: expert_bias {what} has shape {tuple(t.shape)} (want {shape}) or non-finite values")
    return t
