"""What every sync round of one cluster works with (`SyncCore`: its units, anchors, rule, transport and the
collaborators the rule's capabilities bring), and what a round reports (`SyncReport`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from edit_train.local_sgd.aggregator import Aggregator, Decision, needs_of
from edit_train.local_sgd.evidence import buckets, shard_positions
from edit_train.local_sgd.moe.expert_bias import BiasSync
from edit_train.local_sgd.moe.experts import Experts, UnitExperts
from edit_train.local_sgd.moves import aggregation
from edit_train.local_sgd.sync.outer import OuterState
from edit_train.local_sgd.protocols import Contributions, Quorum, Transport
from edit_train.local_sgd.aggregation.retract import Retraction
from edit_train.local_sgd.aggregation.suspects import Suspects
from edit_train.local_sgd.aggregation.scale import LrShape


@dataclass
class Unit:
    """A synchronization unit (= an FSDP unit): an nn.Module and the parameters it owns."""

    name: str
    module: nn.Module
    params: list[nn.Parameter]

    def live(self) -> list[Tensor]:
        """The rank-local shards of the parameters (fresh views: FSDP may re-point them)."""
        return [p.data.to_local() if hasattr(p.data, "to_local") else p.data for p in self.params]


def build_units(model: nn.Module, unit_modules: list[nn.Module]) -> list[Unit]:
    """Units in forward order: the root (what no sub-unit owns) first, then `unit_modules` in order."""
    names = {id(m): n for n, m in model.named_modules()}
    owned: set[int] = set()
    subs = []
    for m in unit_modules:
        params = [p for p in m.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        subs.append(Unit(names[id(m)], m, params))
    root_params = [p for p in model.parameters() if id(p) not in owned]
    units = [Unit("root", model, root_params)] if root_params else []
    return units + [u for u in subs if u.params]


@dataclass
class SyncCore:
    """What every round of one cluster works with."""

    units: list[Unit]
    outer: OuterState
    rule: Aggregator
    transport: Transport
    clip: float | None  # φ (None: no clipping)
    span: Callable[[str], AbstractContextManager[Any]] = lambda _name: nullcontext()
    gather_max: int = 4  # a rule that needs measurements: up to this many clusters, gather; above, sketch
    sketch_dim: int = 0  # count-sketch buckets per unit (the rule's direction test; the sketched check)
    keep: Callable[[str, list[Tensor], Contributions], None] | None = None  # (unit, old anchor, contributions)
    kept: bool = False  # the last round left unsent parts in the live parameters (sync.unsent=keep, unsent experts)
    retract: Retraction | None = None  # gathered: take back an update the probe showed harmful (retract.py)
    experts: Experts | None = None  # an MoE model: routed tokens per expert, which rows are whose (experts.py)
    scale_bound: float = 0.0  # a contribution counts for at most this many times the quorum's median (scale.py)
    scale_spread: float = 0.0  # one between this and scale_bound times it counts as this many (scale.py; 0: off)
    lr_shape: LrShape | None = None  # the shared lr schedule's shape: norms per lr-weighted step (None: per step)
    max_tokens_per_step: int = 0  # a cluster's claimed tokens are bounded by its local steps x this (0: unbounded)
    # a step schedule: per member of the round's quorum, the most local steps it can have taken since its anchor (the
    # steps between the anchor version it holds and the boundary this sync makes: the same on every member, from the
    # quorum's records); a claim over it counts as it (judge.py). Empty: no bound (a time schedule: below).
    # Set for each round.
    steps_bound: list[int] = field(default_factory=list)
    # a time schedule (A-EDiT): per member, the intervals since the anchor it holds (the quorum's records), and τ;
    # a member's claimed local steps are bounded by what its claimed seconds per step fit in the interval's agreed
    # duration (judge.time_caps: the same on every member). Empty: no bound. Set for each round.
    intervals_bound: list[int] = field(default_factory=list)
    sync_time_s: float = 0.0
    min_steps: int = 1  # algo.min_steps: the fewest local steps a cluster takes in an interval
    missed: list[bool] = field(default_factory=list)  # per member: says it missed intervals since its last sync
    first_sync: bool = False  # the federation's first sync (its intervals timed by each cluster's clock)
    # per member, its hardware speed as the roster declares it (judge.time_caps: a claimed speed counts at most
    # DECLARED_SPAN x its declared share); empty or any 0: none declared (bounded by SPEED_SPAN only). Per round.
    declared: list[float] = field(default_factory=list)
    # positions in the round's quorum whose update counts for nothing (a member that rolled back a sync it took
    # part in: its Δ is from another anchor; membership.py). Set for each round.
    not_counted: list[int] = field(default_factory=list)
    suspects: Suspects | None = None  # who this cluster names (suspects.py)
    probe_tolerance: float = 0.1  # an evaluator this far from the others' probe scores is suspected (evidence.py)
    probe_offset: Callable[[list[str]], Tensor] | None = None  # the rule's offset of each cluster's probe score
    expert_bias: BiasSync | None = None  # the routers' expert bias across syncs (algo.expert_bias, expert_bias.py)
    # sync -> the clusters this cluster's rule left out or clipped to the median in some unit of it (the last two
    # syncs): what backs a lone evaluator's high probe score of their update (judge.py, evidence.probe_judgement)
    left_out_or_clipped: dict[int, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {u.name: i for i, u in enumerate(self.units)}
        self.needs = needs_of(self.rule)
        self._hashed: dict[tuple[str, bool, int], tuple[Tensor, Tensor]] = {}
        self._positions: dict[str, Tensor] = {}

    def movement(self, q: Quorum) -> str:
        """How this quorum's contributions move (`moves.aggregation`)."""
        return aggregation(self.needs.value, len(q.members) if q.shared else 1, self.gather_max, self.sketch_dim,
                           self.transport.gathers_sums)

    def positions(self, name: str) -> Tensor:
        """Where this rank's elements of unit `name` sit in the unit's flat Δ (computed once)."""
        if name not in self._positions:
            cluster = self.transport.cluster
            self._positions[name] = torch.cat(shard_positions(self.unit(name).params, cluster.rank, cluster.size))
        return self._positions[name]

    def hashed(self, name: str, whole: bool, dim: int | None = None) -> tuple[Tensor, Tensor] | None:
        """The fixed count sketch's buckets and signs for unit `name` (`dim` buckets, default `sketch_dim`): its
        whole flat Δ, or this rank's shard (computed once)."""
        dim = self.sketch_dim if dim is None else dim
        if dim <= 0:
            return None
        key = (name, whole, dim)
        if key not in self._hashed:
            numel = sum(p.numel() for p in self.unit(name).params)
            pos = torch.arange(numel, dtype=torch.int64) if whole else self.positions(name)
            self._hashed[key] = buckets(pos, dim)
        return self._hashed[key]

    def unit(self, name: str) -> Unit:
        return self.units[self.index[name]]

    def unit_experts(self, name: str) -> UnitExperts | None:
        return self.experts.units.get(name) if self.experts is not None else None

    @property
    def where(self) -> tuple[int, int]:
        """This rank's place in its cluster (rank, ranks): which rows of a sharded parameter it holds."""
        return self.transport.cluster.rank, self.transport.cluster.size


@dataclass
class SyncReport:
    """What one sync did on this rank (the `sync` event is made from it)."""

    sync: int
    local_steps: int
    quorum: list[str]  # the clusters in this sync, by name, in the order the decisions use
    position: int  # this cluster's row in the decisions
    decisions: dict[str, Decision] = field(default_factory=dict)
    clip: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    blocked_s: float = 0.0
    cluster_norm: float = 0.0  # this cluster's whole-model ‖Δ‖
    sizes: dict[str, int] = field(default_factory=dict)  # parameters per unit (for the effective weight)
    nonfinite: list[str] = field(default_factory=list)  # units whose reduced Δ was non-finite
    retracted: dict[str, dict[str, Any]] = field(default_factory=dict)  # cluster -> {sync, probe}: taken back
    mode: str = "sum"  # how the contributions moved: sum | gathered | sketched (moves.py)
    regathered: str = ""  # sketched, then gathered: why the sketches did not check out
    unsent: int = 0  # elements of this cluster's Δ it did not send (rows of experts it or nobody touched)
    expert_shares: dict[str, list[float]] = field(default_factory=dict)  # unit -> each expert's share of it
    probe_suspects: dict[str, str] = field(default_factory=dict)  # evaluator -> why its probe scores did not count
    expert_bias: dict[str, Any] = field(default_factory=dict)  # rule, MaxVio per cluster and layer (expert_bias.py)
