"""What the rule is told about a round's clusters and what it decides: the norm exchange read, a unit's
`Evidence` built, every decision bounded by the quorum's median scale (`scale.py`), the commit vote counted,
and whoever misbehaved named (`suspects.py`). One per round (`round.py`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from edit_train.local_sgd.aggregator import Combiner, Decision, Evidence
from edit_train.local_sgd.sync.core import SyncCore, SyncReport
from edit_train.local_sgd.evidence import probe_judgement
from edit_train.local_sgd.sync.expert_rows import ExpertRows
from edit_train.local_sgd.aggregation.scale import bound_scale

EXTRA = ("local_steps", "secs_per_step", "total_steps", "stop_vote", "tokens")  # per-cluster scalars of the exchange
# A-EDiT: a member's claimed steps count at most what its claimed seconds per step fit in the interval's agreed
# duration (`time_caps`); a claim over NAMED_OVER times that is named (an honest cluster that slowed down within an
# interval, or stepped on longer while the quorum formed, is bounded a little, never named). A member's claimed speed
# counts at most SPEED_SPAN times the quorum's lower-median speed (an honest federation up to 1:SPEED_SPAN pays
# nothing; it bounds a member only where it is not the lower median: three members or more).
NAMED_OVER, SPEED_SPAN = 2.0, 16.0
# Where the roster declares each cluster's hardware speed (roster.py), a member's claimed speed counts at most
# DECLARED_SPAN times its declared share of the quorum's reference (`declared_floor`), and one over NAMED_OVER times
# that is named with what to check. Measured (benchmarks/insiders_checked.py: a member claiming 4x its speed and
# steps, consistently, and sending 15x its Δ; honest loss change at 2 / 3 clusters): a span of 1.0 -1.6 % / -1.1 %,
# 1.25 +1.3 % / +4.2 %, 1.5 +4.2 % / +8.4 %, none (SPEED_SPAN only) +14.7 % / +19.7 %. So the roster's speeds are
# the ceiling: an honest cluster faster than declared counts as declared (its weight, never its update, bounded).
DECLARED_SPAN = 1.0


def lower_median(x: Tensor) -> Tensor:
    """The lower median of a 1-D tensor (what one member of three cannot move outside the others' range)."""
    return x.sort().values[(x.numel() - 1) // 2]


def upper_median(x: Tensor) -> Tensor:
    """The upper median of a 1-D tensor: of two, the larger (one member of two cannot raise the other's bound
    by claiming more; of three or more, one member cannot move it outside the others' range)."""
    return x.sort().values[x.numel() // 2]


def declared_floor(secs: Tensor, declared: Tensor) -> Tensor:
    """The fewest seconds per step each member's claim counts as where the roster declares every member's speed:
    seconds per step x declared speed is the same for every honest member (its hardware's share of the work);
    the reference is the upper median of those (of two members the slower, relative to what the roster says),
    and a member counts at most `DECLARED_SPAN` times as fast as it. A member claiming to be slower than that
    lowers its own cap: bounding the others to `DECLARED_SPAN` x it leaves them that much more weight than it."""
    sigma = secs * declared
    return upper_median(sigma) / (DECLARED_SPAN * declared)


def time_caps(steps: Tensor, secs: Tensor, intervals: list[int], tau: float, min_steps: int = 1,
              first: bool = False, declared: Tensor | None = None) -> Tensor:
    """A-EDiT: the most local steps each member's claims let it have taken (docs/security.md, issue 69), computed
    from the exchange and the quorum's records only, so every member caps the same claims the same way.

    Each member's claimed work — steps x seconds per step per interval since its anchor — is that interval's
    duration as it says it spent it. The interval's agreed duration D is the lower median of those (at least τ: a
    member claiming no work cannot pull it down). A member's steps count at most ⌈D x its intervals / its seconds
    per step⌉ (an honest cluster plans ⌊τ / its last speed⌋ steps, its first interval until τ is spent: within it
    unless it slowed down or stepped on longer than the others while the quorum formed), and at least `min_steps`
    per interval (a cluster slower than τ per step takes one), plus one step (an overlapped cluster steps on while
    the quorum forms: the step in progress when it is issued), at the `first` sync two (a first interval is timed
    by the cluster's clock, and a step spent waiting for the others is not timed). Its seconds per step count at least the quorum's
    lower-median seconds per step / `SPEED_SPAN`; a non-finite or non-positive claim counts as the lower median;
    `declared` (the roster's speed of every member): at least `declared_floor` too."""
    k = torch.tensor(intervals, dtype=torch.float64)
    steps, secs = steps.to(torch.float64), secs.to(torch.float64)
    sane = torch.isfinite(secs) & (secs > 0)
    typical = lower_median(secs[sane]) if bool(sane.any()) else torch.tensor(math.inf, dtype=torch.float64)
    s = torch.where(sane, secs, typical).clamp_min(typical / SPEED_SPAN)
    if declared is not None and bool(torch.isfinite(s).all()):
        s = torch.maximum(s, declared_floor(s, declared.to(torch.float64)))
    work = torch.where(torch.isfinite(steps) & (steps >= 0), steps, torch.zeros_like(steps)) * s / k
    duration = max(float(lower_median(work)), tau)
    caps = torch.ceil(duration * k / s * (1 - 1e-6))  # rounding of the claims (float32 rows) gives no step
    caps = torch.where(torch.isfinite(caps), caps, torch.zeros_like(caps))  # no sane speed anywhere: min_steps
    return torch.maximum(caps, k * min_steps) + (2 if first else 1)


class Judge:
    """The rule's side of one round: `read` the exchange, then `evidence` and `decide` per unit."""

    def __init__(self, core: SyncCore, report: SyncReport, rows: ExpertRows) -> None:
        self.core, self.report, self.rows = core, report, rows
        self.meta: dict[str, Tensor] = {}  # per cluster: reported norms, steps, tokens, probe scores
        self.steps_bound = list(core.steps_bound)  # this round's (an overlapped round reads after the next began)
        self.bias: Tensor | None = None  # per cluster: what it reported of its expert bias (expert_bias.py)
        self.not_counted = list(core.not_counted)
        self.time_bound = (list(core.intervals_bound), core.sync_time_s, core.min_steps, core.first_sync) \
            if core.intervals_bound else None
        self.missed = list(core.missed)
        self.declared = list(core.declared)

    def read(self, full: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The exchange ([‖Δ‖² per unit ‖ last committed round ‖ routed tokens ‖ EXTRA ‖ probe score of every
        cluster's last update], one row per cluster) → (reported norms [P, units], markers [P], EXTRA [P, k])."""
        n, k, m = len(self.core.units), len(EXTRA), self.rows.width
        b = self.core.expert_bias.width if self.core.expert_bias is not None else 0
        norms, marks = full[:, :n].clamp_min(0).sqrt(), full[:, n]
        self.bias = full[:, n + 1 + m:n + 1 + m + b].clone() if b else None
        rows = torch.cat([full[:, :n], full[:, n + 1 + m + b:]], dim=1)  # without marker, routed tokens, bias
        scores = rows[:, n + k:]
        if scores.shape[1] != rows.shape[0]:  # nobody sent probe scores for this quorum
            scores = torch.full((rows.shape[0], rows.shape[0]), math.nan, dtype=torch.float64)
        bad = self.core.left_out_or_clipped.get(self.report.sync - 1, set())  # the scores rate the last sync's updates
        backed = {i for i, name in enumerate(self.report.quorum) if name in bad}
        raw, probe_suspects = probe_judgement(scores, self.core.probe_tolerance, backed)
        offset = self.core.probe_offset
        probe = raw - offset(list(self.report.quorum)) if offset is not None else raw
        said = rows[:, n].clone()
        steps = self._steps(said.clone(), rows[:, n + EXTRA.index("secs_per_step")].clone())
        for i in self.not_counted:  # it rolled back a sync it took part in (membership.py): weight 0
            if i < steps.numel():
                steps[i] = 0
        self.meta = {"reported": norms, "steps": steps, "tokens": self._tokens(steps.clone(),
                     rows[:, n + EXTRA.index("tokens")].clone(), said), "probe": probe, "probe_raw": raw,
                     "total_steps": rows[:, n + EXTRA.index("total_steps")].clone()}
        self._suspected(probe_suspects)
        self.rows.read(full[:, n + 1:n + 1 + m])
        self.report.cluster_norm = float(norms[self.report.position].pow(2).sum().sqrt())
        return norms, marks, rows[:, n:n + k]

    def _time_steps(self, claimed: Tensor, secs: Tensor) -> Tensor:
        """A time schedule: each claim bounded by `time_caps` (the same on every member). A claim over `NAMED_OVER`
        times it is named when this cluster's own claim is not (when every member is over — a sync lost by all —
        every weight is bounded alike and nobody is named), unless its record says it missed intervals since its
        last sync (cut off, or a fresh start before its first shared sync: its steps span intervals no sync count
        shows; they are bounded all the same, so saying so buys nothing)."""
        intervals, tau, least, first = self.time_bound
        caps = time_caps(claimed, secs, intervals, tau, least, first)
        named = ~(claimed.to(torch.float64) <= NAMED_OVER * caps)  # NaN is over too
        if len(self.missed) == claimed.numel():  # intervals missed that no sync count shows: bounded, not named
            named &= ~torch.tensor(self.missed, dtype=torch.bool)
        me = self.report.position
        if not bool(named[me]):
            for i in named.nonzero().flatten().tolist():
                self.name(i, f"claims {float(claimed[i]):.4g} local steps at {float(secs[i]):.4g} s per step at sync "
                             f"{self.report.sync}, more than the {float(caps[i]):.0f} the interval's agreed duration "
                             "lets it have taken (bounded to it)", "local steps")
        declared = self._declared(claimed.numel())
        if declared is not None:
            caps = torch.minimum(caps, time_caps(claimed, secs, intervals, tau, least, first, declared))
            self._name_speed(secs, declared, named)
        over = ~(claimed.to(torch.float64) <= caps)  # NaN is over too
        return torch.where(over, caps.to(claimed.dtype), claimed)

    def _declared(self, n: int) -> Tensor | None:
        """The roster's declared speed of every member of this round (None where any is not declared)."""
        d = self.declared
        return torch.tensor(d, dtype=torch.float64) if len(d) == n and all(x > 0 for x in d) else None

    def _name_speed(self, secs: Tensor, declared: Tensor, named: Tensor) -> None:
        """Name a member that claims to run over NAMED_OVER x DECLARED_SPAN times as fast, relative to the others,
        as the roster declares — unless this cluster is itself the fast one by that measure (of two members, either
        may be the one who lies about its speed: the one who knows its own claim is true names the other)."""
        s = secs.to(torch.float64)
        if not bool((torch.isfinite(s) & (s > 0)).all()):
            return  # a claim that is no speed is bounded as the typical one (time_caps), not a speed to compare
        fast = declared_floor(s, declared) * DECLARED_SPAN / s  # > 1: faster than the reference, declared share
        me = self.report.position
        if float(fast[me]) > NAMED_OVER * DECLARED_SPAN:
            return
        for i in (fast > NAMED_OVER * DECLARED_SPAN).nonzero().flatten().tolist():
            if not bool(named[i]):
                self.name(i, f"claims {float(secs[i]):.4g} s per step at sync {self.report.sync}, "
                             f"{float(fast[i]):.3g}x as fast, relative to the quorum, as the roster declares its "
                             f"hardware ({float(declared[i]):.4g}); counted as declared (if it is honest, its speed "
                             "in the roster is wrong: the operator corrects it)", "speed")

    def _steps(self, claimed: Tensor, secs: Tensor) -> Tensor:
        """The claimed local steps, each bounded under a step schedule by what the sync count lets that member have
        taken since the anchor it holds (`SyncCore.steps_bound`, the same on every member: the decisions stay
        everyone's). A claim over it and over this cluster's own steps (the honest lost the same syncs) is named: a
        claim of 4x its steps buys no weight (issue 69)."""
        caps = self.steps_bound
        if self.time_bound and len(self.time_bound[0]) == claimed.numel():
            return self._time_steps(claimed, secs)
        if len(caps) != claimed.numel():
            return claimed
        cap = torch.tensor(caps, dtype=claimed.dtype)
        over = ~(claimed <= cap)  # NaN is over too
        own = self.report.local_steps
        for i in over.nonzero().flatten().tolist():
            if not float(claimed[i]) <= own:
                self.name(i, f"claims {float(claimed[i]):.4g} local steps at sync {self.report.sync}, more than the "
                             f"{caps[i]} the step schedule allows since its anchor (bounded to it)", "local steps")
        return torch.where(over, cap, claimed)

    def _tokens(self, steps: Tensor, claimed: Tensor, said: Tensor) -> Tensor:
        """The claimed tokens, each bounded by the cluster's (bounded) local steps x the most tokens per step any
        configured cluster takes (a claim of 10^12 tokens weighs what its steps can hold); those over what its own
        claimed steps can hold are named (a claim of steps over its bound is named for the steps, `_steps`)."""
        cap = self.core.max_tokens_per_step
        if cap <= 0:
            return claimed
        most = steps.clamp_min(0) * cap
        over = ~(claimed <= most)  # NaN is over too
        for i in (over & ~(claimed <= said.clamp_min(0) * cap)).nonzero().flatten().tolist():
            self.name(i, f"claims {float(claimed[i]):.4g} tokens for {float(steps[i]):.0f} local steps, more than "
                         f"{cap} per step (bounded to {float(most[i]):.4g})", "tokens")
        return torch.where(over, most, claimed)

    def bias_committed(self) -> None:
        """The round commits: the expert bias moves by the rule (`expert_bias.py`) on what the exchange carried,
        the claims bounded as the tokens are; its MaxVio goes into the `sync` event."""
        eb = self.core.expert_bias
        if eb is None or self.bias is None:
            return
        sync = self.report.sync
        eb.committed(self.report.quorum, self.rows.exchanged, self.bias, self.meta["steps"], self.meta["tokens"],
                     self.report.position, lambda i, what: self.name(i, f"{what} at sync {sync}", "expert bias"),
                     self.meta["total_steps"])
        self.report.expert_bias = dict(eb.last)

    def name(self, i: int, what: str, kind: str) -> None:
        """Name cluster `i` (not this one) for `what` (suspects.py)."""
        q = self.core.transport.quorum
        if self.core.suspects is not None and q is not None and i != self.report.position:
            self.core.suspects.name(q, i, what, kind)

    def _suspected(self, who: dict[int, str]) -> None:
        """Evaluators whose probe scores were not counted: in the `sync` event (`probe_suspects`), and named
        (suspects.py: one line with the roster key that signed its records, and the event's `suspects`)."""
        self.report.probe_suspects = {self.report.quorum[i]: why for i, why in who.items()}
        for i, why in who.items():
            what = "disagree with the other evaluators'" if why == "disagrees" else \
                "flag an update no other evaluator measured (one evaluator decides nothing)"
            self.name(i, f"sent probe scores that {what} (sync {self.report.sync}): not counted", f"probe {why}")

    def evidence(self, name: str, norms: Tensor, measured: dict[str, Tensor]) -> Evidence:
        """What the rule is told about unit `name`: `norms` (reported or measured) and what was `measured`."""
        steps = self.meta["steps"]
        i = self.core.index[name]
        extra = {"reported": self.meta["reported"][:, i].clone(), "tokens": self.meta["tokens"].clone(),
                 "probe": self.meta["probe"].clone(), "probe_raw": self.meta["probe_raw"].clone(),
                 "sync": torch.tensor(self.report.sync), **measured,
                 **({"total_steps": self.meta["total_steps"].clone()} if "total_steps" in self.meta else {}),
                 **self.rows.evidence(name)}
        return Evidence(name, tuple(self.report.quorum), norms.clone(), steps.clone(),
                        tuple(bool(s > 0) for s in steps.tolist()), extra)

    def decide(self, ev: Evidence) -> Decision:
        """The rule's decision, every contribution then bounded by the quorum's median scale (scale.py): over
        `scale_bound` times it clipped to the median and named, over `scale_spread` times it held to the spread
        (silently: recorded in the unit's evidence as `scale_hold`)."""
        d = self.core.rule.decide(ev)
        if isinstance(self.core.rule, Combiner):
            return d
        clipped, held = bound_scale(d, ev, self.core.scale_bound, self.core.scale_spread, self.core.lr_shape)
        for key, factors in (("scale_clip", clipped), ("scale_hold", held)):
            for i, f in factors.items():
                if len(d.evidence) == len(ev.names):
                    d.evidence[i] = {**d.evidence[i], key: f}
        self._remember(ev, d, clipped)
        for i, f in clipped.items():
            self.name(i, f"sent a pseudo-gradient {1 / f:.3g} times the quorum's median norm per lr-weighted step "
                         f"at sync {self.report.sync}, over algo.rule.scale_bound={self.core.scale_bound:g} (its "
                         f"weight in unit {ev.module} scaled by {f:.3g}: it counts as the median's size; check its "
                         f"data, its optimizer and the local steps it claims)", "scale")
        return d

    def _remember(self, ev: Evidence, d: Decision, clipped: dict[int, float]) -> None:
        """Which clusters this sync's decisions left out or clipped in some unit (the last two syncs kept): what
        backs a lone evaluator's extreme probe score of their update at the next sync (`read`)."""
        seen = self.core.left_out_or_clipped
        out = seen.setdefault(self.report.sync, set())
        out.update(ev.names[i] for i in clipped)
        out.update(ev.names[j] for j, w in enumerate(d.weights) if w == 0.0 and ev.contributes[j])
        for old in [k for k in seen if k < self.report.sync - 1]:
            del seen[old]

    def reported(self, name: str) -> Decision:
        """Unit `name` decided on what every cluster reported (a SUM, or a sketched SUM's provisional decision)."""
        i = self.core.index[name]
        return self.rows.pin(self.decide(self.evidence(name, self.meta["reported"][:, i], {})), None)

    def majority(self, votes: Tensor) -> bool:
        """The commit: no strict majority of the quorum voted no — a tie keeps what you have (an honest "no" — a
        non-finite merged unit — is everyone's, since every cluster merges the same contributions; a lone "no" is a
        local fault). The round ANDs this cluster's own vote: a member whose vote differs from the outcome rolls
        itself back and is named (it heals or syncs on at its next sync; docs/security.md)."""
        yes = [bool(v > 0) for v in votes.tolist()]
        commit = 2 * sum(yes) >= len(yes)
        if yes[self.report.position]:
            for i, said in enumerate(yes):
                if not said:
                    outcome = "committed without it" if commit else "a strict majority voted no: rolled back"
                    self.name(i, f"voted no at sync {self.report.sync} ({outcome})", "veto")
        return commit
