"""The aggregation seam: what a rule is told about every cluster of a sync, what it decides, and what it needs
the round to move for it.

A rule sees one unit at a time (`Evidence`) and returns a `Decision`: who is left out, and every cluster's
weight in the merged update. Every cluster of the quorum runs the same rule on the same evidence, so all take
the same decision without more communication. A rule says what the round must move (`needs`):

* `Needs.SUM` — the rule decides from what every cluster *reported* in the sync's small exchange (norms,
  local steps, tokens); each cluster sends w·Δ into a SUM all-reduce: a ring all-reduce's bytes, nothing
  verified beyond "the merged update is finite" (`uniform`, `edit_norm`).
* `Needs.MEASUREMENTS` — the rule decides from quantities measured on what each cluster actually sent: the
  Gram matrix (norms, cosines), finiteness and count sketches. Up to `sync.gather_max` clusters every
  cluster receives every contribution and measures it exactly; above, every cluster sketches its own Δ, the
  merge is a SUM, and the SUM is checked against the sketches after it lands (docs/sync_math.md, "Sketched"):
  a mismatch gathers that sync (`verified`).
* `Needs.CONTRIBUTIONS` — every cluster receives every contribution at any cluster count, and the rule may
  merge them itself: a rule with a `combine(ev, decision, parts)` method returns the merged Δ (a coordinate-wise
  median, a trimmed mean, ...); without one, the round sums the contributions with the decision's weights.

A rule may ask more of the round and the trainer (`capabilities()`, optional; `Capabilities`): count sketches
of a size, the usefulness probe and taking back what it shows harmful (`retract.py`), how an MoE model's expert
rows are sent, and a check of the federation it is to serve. `LocalSGD`, the trainer and the config ask the rule
through `capabilities_of`; none of them names a rule.

Clipping, the outer step, the re-base and rollback stay in the one round (`round.py`) for every rule.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["Needs", "Evidence", "Decision", "Aggregator", "Combiner", "Capabilities", "nobody", "spread", "needs_of",
           "capabilities_of"]


class Needs(str, enum.Enum):
    SUM = "sum"
    MEASUREMENTS = "measurements"
    CONTRIBUTIONS = "contributions"


@dataclass(frozen=True)
class Evidence:
    """What a round knows about every cluster for one unit (rows in quorum order).

    `norms` are ‖Δᵢ‖ over the whole module: reported (SUM), measured on what was sent (gathered), or the
    reported norms whose claims the sketch check holds them to (sketched). `extra` holds the rest, by key:
    ``reported`` (the norms as reported), ``tokens`` (claimed), ``probe`` (the others' median probe score of
    each cluster's last update), ``sync``; a unit with experts (`experts.py`): ``expert_tokens`` [P, E] (the
    tokens each cluster routed to each of its experts over the interval), ``expert_sent`` [P, E] bool (whose
    rows each cluster sent); measured: ``gram`` [P, P], ``finite`` [P], ``sketches`` [P, dim], ``exact`` (the
    transport is lossless), ``measured`` ("gathered" or "sketched"); sketched also ``measured_norms`` (of the
    proven sketches), ``measure_tolerance`` (their relative precision) and ``distance_noise`` (the std of a
    sketched distance)."""

    module: str
    names: tuple[str, ...]
    norms: Tensor  # float64 [P]
    steps: Tensor  # float64 [P]: local steps since the anchor
    contributes: tuple[bool, ...]  # False: no local step since its anchor (weight 0, not judged)
    extra: Mapping[str, Tensor] = field(default_factory=dict)

    @property
    def contributors(self) -> list[int]:
        return [i for i, c in enumerate(self.contributes) if c]


def _finite_or_none(v: Any) -> Any:
    return v if not isinstance(v, float) or math.isfinite(v) else None


@dataclass
class Decision:
    """One unit's decision (identical on every cluster). `weights[i]` is cluster i's coefficient in the merged
    update (a combining rule may leave them nominal: they are what the `sync` event reports); `left_out[i]`
    says the rule refused cluster i's contribution; `skip`: no outer step for this unit (nobody is left to
    merge). `evidence[i]` is whatever the rule wants the `sync` event to say about cluster i (its scores, bounds
    and reasons), by key: nothing in the round reads it. `expert_weights[e][i]` (a unit with experts, the rule's
    option): cluster i's coefficient on expert e's rows instead of `weights[i]` (the round applies it in every
    mode; a cluster that did not send the expert's rows weighs 0 there whatever the rule says; an expert every
    cluster weighs 0 is not sent in a SUM)."""

    module: str
    norms: list[float]
    weights: list[float]
    left_out: list[bool]
    skip: bool
    evidence: list[dict[str, Any]] = field(default_factory=list)
    expert_weights: list[list[float]] | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly; non-finite floats become None."""
        d = asdict(self)
        d["norms"] = [_finite_or_none(float(v)) for v in self.norms]
        d["weights"] = [_finite_or_none(float(v)) for v in self.weights]
        if self.expert_weights is not None:
            d["expert_weights"] = [[_finite_or_none(float(v)) for v in row] for row in self.expert_weights]
        d["evidence"] = [{k: _finite_or_none(v) for k, v in e.items()} for e in self.evidence]
        return d


def _serves_any(clusters: int, gather_max: int, compression: str, experts: int = 0) -> tuple[str, str] | None:
    return None


@dataclass(frozen=True)
class Capabilities:
    """What a rule asks of the round and the trainer beyond its decisions (the defaults ask nothing)."""

    sketch_dim: int = 0  # count-sketch buckets per unit the round measures (0: none; sketched syncs need some)
    probe_tokens: int = 0  # the usefulness probe: validation tokens each cluster scores every update on (0: none)
    probe_tolerance: float = 0.1  # a probe score this far off is harmful; an evaluator this far from the others' is
    # suspected; a healed anchor this much worse on the cluster's probe slice is refused
    retract: bool = False  # take back, one sync late, an admitted update the probe then shows harmful (retract.py)
    # (quorum's cluster names) -> what to subtract from each one's probe score (its own threshold less
    # `probe_tolerance`, from its history): an update is judged on how much more it hurts the others than that
    # cluster's updates usually do (None: on its score as measured)
    probe_offset: Callable[[list[str]], Tensor] | None = None
    expert_min_tokens: int = 0  # a cluster sends no rows of an expert it routed fewer tokens to (0: every row)
    weighs_experts: bool = True  # the rule may weigh experts (a gathered round measures each expert's Gram matrix)
    # expert subsets per site ("" off): the experts each cluster trains and sends (`experts.owned_experts`'s spec);
    # the others stay at the anchor on it and report no routed tokens, so their update comes from their owners only
    expert_subsets: str = ""
    expert_subsets_syncs: int = 0  # `routed`: the committed syncs of every-expert training the map is decided after
    # (clusters, sync.gather_max, sync.compression, the model's experts) -> (config field, why) when the rule
    # cannot serve them
    refuse: Callable[[int, int, str, int], tuple[str, str] | None] = _serves_any


@runtime_checkable
class Aggregator(Protocol):
    """An aggregation rule (unit by unit; the same answer on every cluster). Optional members: `needs`
    (default `Needs.SUM`) and `capabilities()` (default `Capabilities()`, or one with the rule's `sketch_dim`
    attribute: count-sketch buckets a MEASUREMENTS rule wants)."""

    def decide(self, ev: Evidence) -> Decision: ...

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]: ...  # JSON + tensors a checkpoint/heal keeps

    def load(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None: ...


@runtime_checkable
class Combiner(Aggregator, Protocol):
    """A rule that merges the gathered contributions itself (`Needs.CONTRIBUTIONS`): `parts[i]` is cluster i's
    contribution as this rank holds it (its local shard of each tensor, the same layout for every cluster), and
    the answer is the merged Δ in that layout. Every cluster calls it on bit-identical parts, in quorum order."""

    def combine(self, ev: Evidence, decision: Decision, parts: list[list[Tensor]]) -> list[Tensor]: ...


def needs_of(rule: Aggregator) -> Needs:
    """What `rule` needs moved (`needs`, default a SUM)."""
    return Needs(getattr(rule, "needs", Needs.SUM))


def capabilities_of(rule: Aggregator) -> Capabilities:
    """What `rule` asks beyond its decisions (`capabilities()`; the one place its optional members are read)."""
    ask = getattr(rule, "capabilities", None)
    if callable(ask):
        caps = ask()
        assert isinstance(caps, Capabilities), f"{type(rule).__name__}.capabilities() must return Capabilities"
        return caps
    return Capabilities(sketch_dim=int(getattr(rule, "sketch_dim", 0)))


def nobody(ev: Evidence) -> Decision:
    """No cluster contributes: no outer step for this module."""
    n = len(ev.names)
    return Decision(ev.module, ev.norms.tolist(), [0.0] * n, [False] * n, True, [{} for _ in range(n)])


def spread(d: Decision, idx: list[int], n: int, norms: Tensor) -> Decision:
    """A decision over the contributors `idx` spread to all `n` clusters (the others: weight 0, not left out,
    no evidence)."""
    def full(values: list[Any], default: Any) -> list[Any]:
        out = [default] * n
        for j, i in enumerate(idx):
            out[i] = values[j]
        return out
    evidence = full(d.evidence, None) if d.evidence else [None] * n
    experts = [full(row, 0.0) for row in d.expert_weights] if d.expert_weights is not None else None
    return Decision(d.module, norms.tolist(), full(d.weights, 0.0), full(d.left_out, False), d.skip,
                    [e if e is not None else {} for e in evidence], experts)
