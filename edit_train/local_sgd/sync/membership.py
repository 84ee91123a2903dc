"""This cluster's place in the federation: a quorum per sync (admission, healing, step adoption) and the
meeting before the first step.

A quorum is vetted before its lanes connect (`claims.vet`: a member whose claims cannot be the federation's is
left out alone; this cluster refuses itself only when it is the odd one, `FederationRefused`: retrying cannot
help); then whoever is not at the agreed anchor heals from a member holding it (`Quorum.agreed`, `healing.py`).
Under a step schedule every cluster ends at `train.steps`, so a cluster that fell behind (joined late, lost a
quorum race) adopts the federation's step — the lower median of the quorum's claims, its own counted, each
bounded by what the agreed sync count implies (`claims.agreed_steps`) — rather than syncing one interval late
forever. No claim moves a cluster past what the sync count implies, so a claim of train.steps from a start-up
quorum (one asked again for, or one the liar is in) sends nobody to the end of the run.

Joining (`meet`): a fresh federation starts together (ask again until every configured cluster is in the
quorum or was left out of it, bounded by `quorum_timeout_s`); a resumed one regroups within the grace window
`join_timeout_s`, so the first cluster back does not sync alone; a cluster restarting while the others run finds
them within that window, or heals at its next sync. A cluster its launcher started again after a failure
(`restarted`) is never a fresh start, even without a checkpoint: the federation began without it, so it waits
the grace window, not `quorum_timeout_s` for clusters that may have finished the run long ago.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from edit_train.local_sgd.aggregation import claims
from edit_train.local_sgd.errors import FederationError, FederationRefused, HealError, SyncAborted
from edit_train.local_sgd.sync.healing import Healer
from edit_train.local_sgd.sync.pacer import Pacer
from edit_train.local_sgd.protocols import Quorum, Transport
from edit_train.local_sgd.aggregation.suspects import Suspects
from edit_train.local_sgd.sync.waits import STOP, Wait

log = logging.getLogger(__name__)


@dataclass
class MembershipConfig:
    fingerprint: str = ""  # hash of what must agree across clusters (model, algorithm, chunks)
    expected: tuple[str, ...] = ()  # the configured clusters: a fresh start waits (bounded) until all met
    quorum_timeout_s: float = 60.0
    join_timeout_s: float = 5.0  # a resumed cluster waits this long (the grace window) for the others to resume
    restarted: bool = False  # started again by its launcher after a failure: the federation began without it
    authoritative: bool = False  # fingerprint and steps are the operator's roster's (this cluster was checked
    terms_source: str = "this cluster's configuration"  # against it at start): a cluster that differs is left out


class Membership:
    def __init__(self, cfg: MembershipConfig, transport: Transport, healer: Healer, pacer: Pacer,
                 digest: Callable[[], str] = lambda: "", suspects: Suspects | None = None) -> None:
        self.cfg, self.t, self.healer, self.pacer = cfg, transport, healer, pacer
        self.suspects = suspects if suspects is not None else Suspects(transport.name)
        self.digest = digest  # of this cluster's anchor ("" before the local-SGD phase): what it claims to hold
        # a step-scheduled local-SGD run: every cluster ends at train.steps
        self.lockstep_sgd = pacer.lockstep and pacer.cfg.local_sgd
        self.incarnation = uuid.uuid4().hex[:12]
        self.sync_index = 0  # the anchor version this cluster holds
        self.healed_from: list[str] = []
        self.adopt_step: int | None = None  # set by a heal or an admission: continue from this step
        # restarted, resumed or joining (not one of the configured clusters), and not yet in a shared sync: the
        # federation may have begun or moved on without it, so it heals to a state only another member holds
        # (healing.py: ties keep what you have). A configured cluster's fresh start is not rejoining: the
        # federation's first anchor is the same on every cluster by construction (the seeded initialisation or
        # model.init_from, in the configuration fingerprint), so nobody heals at sync 1 on one member's word (a
        # resumed cluster is set rejoining by `SyncState.load`)
        self.rejoining = cfg.restarted or transport.name not in cfg.expected
        # what each member of a sync in flight claimed (its version, its anchor digest), by the version the sync
        # makes; once it commits here, `held`: what each member of the last committed sync held before it
        self._claims: dict[int, dict[str, tuple[int, str]]] = {}
        self.held: dict[str, tuple[int, str]] = {}
        self.rolled_back: set[str] = set()  # members of the quorum just admitted that rolled a sync back
        # a configured cluster's fresh start waits `join_timeout_s` for the configured clusters, then trains; until
        # its first shared sync (at most `quorum_timeout_s` after it started) a sync it would make alone is not
        # made: its anchor stays the federation's first (everyone's by construction), so a configured cluster that
        # comes later meets it at sync 0 with the same anchor and nobody heals (`holding_start`)
        self.fresh_start = not self.rejoining
        self.started_t = time.time()
        self.shared_once = False

    def start(self, local_steps: int) -> None:
        """Ask for this sync's quorum (in the background where the transport can)."""
        data = {"local_steps": local_steps, "incarnation": self.incarnation, "fp": self.cfg.fingerprint,
                "total_steps": self.pacer.total_steps, "anchor": self.digest() if self.t.federated else "",
                "refused": self._refused(), "missed": self.pacer.missed_since}
        self.t.form_start(self.sync_index, data, vet=self.vet)

    def _refused(self) -> str:
        """The heal sources this cluster refused lately, newest kept (at most 128 characters on the wire)."""
        out = ""
        for name in reversed(self.healer.refused):
            if len(out) + len(name) + 1 > 128:
                break
            out = f"{name},{out}" if out else name
        return out

    @property
    def terms(self) -> claims.Terms:
        """What this cluster takes the federation to be. Under a time schedule (A-EDiT) a fast cluster takes more
        than train.steps before the run's last sync: claims are bounded at `claims.time_bound`."""
        lockstep = self.pacer.lockstep
        return claims.Terms(self.cfg.fingerprint, self.pacer.cfg.total_steps, self.cfg.authoritative,
                            self.cfg.terms_source, slack=1 if lockstep else claims.SPEED_SPAN,
                            margin=0 if lockstep else claims.TIME_MARGIN)

    def vet(self, q: Quorum) -> Quorum:
        """The issued quorum less the members whose claims cannot be the federation's (each one line, once per
        cluster and reason); FederationRefused when this cluster is the odd one. On the leader, before the
        lanes connect."""
        kept, why = claims.vet(q, self.terms)
        for i, m in enumerate(q.members):
            if m.name in why:
                self.suspects.name(q, i, f"left out of the sync: it {why[m.name]}")
        return kept

    def poll(self, block: bool = False) -> tuple[bool, Quorum | None]:
        """(done, admitted quorum or None when cut off)."""
        done, q = self.t.form_poll(block)
        return done, (self.admit(q) if done else None)

    def form(self, local_steps: int) -> Quorum | None:
        self.start(local_steps)
        return self.poll(block=True)[1]

    def admit(self, q: Quorum | None) -> Quorum | None:
        """A vetted quorum: heal whoever is not at the agreed anchor, adopt the agreed step."""
        if q is None:
            return None
        agreed = self.agreed_steps(q)
        healed = self.healer.run(q, self.terms.max_steps, agreed, self.rejoining)
        if healed is not None:
            self.healed_from.append(healed)
        if q.shared:
            self.rejoining = False
            self.shared_once = True
            self._name_ahead_of_start(q)
            self._name_rolled_back(q)
        if self.lockstep_sgd and agreed > self.pacer.total_steps:
            self.adopt_step = self.pacer.adopt(agreed)
        return q

    def holding_start(self, q: Quorum) -> bool:
        """A fresh configured start not yet in a shared sync, within `quorum_timeout_s` of its start, whose quorum
        `q` lacks a configured cluster that no quorum holds or left out (one still on its way, or one that never
        asks): a sync it would make alone is not made — it keeps the federation's first anchor for them; after
        that it trains alone as before."""
        missing = set(self.cfg.expected) - {*q.names, *q.left_out}
        return self.fresh_start and not self.shared_once and bool(missing) and \
            time.time() < self.started_t + self.cfg.quorum_timeout_s

    def _name_ahead_of_start(self, q: Quorum) -> None:
        """Name a member that claims a sync past a start no one else has left: a strict majority of the quorum holds
        the first anchor (sync 0, the same on every cluster by construction) and it claims a newer one. Only a
        cluster that trained alone after the start-up wait (`quorum_timeout_s`) does this honestly; it is healed
        back to the federation's first anchor either way (`Quorum.agreed`)."""
        sync, digest = q.agreed
        holders = sum(1 for i in range(len(q.members)) if q.claim(i) == (sync, digest))
        if sync != 0 or 2 * holders <= len(q.members):
            return
        for i, m in enumerate(q.members):
            if i != q.me and m.sync > sync:
                self.suspects.name(q, i, f"claims sync {m.sync} where {holders} of {len(q.members)} members hold the "
                                   "federation's first anchor (sync 0): not followed", kind="ahead of start")

    def committed(self, sync: int) -> None:
        """The sync that made version `sync` committed here: what its members held before it is `held`."""
        claims = self._claims.pop(sync, None)
        self._claims = {v: c for v, c in self._claims.items() if v > sync}
        if claims is not None:
            self.held = claims

    def _name_rolled_back(self, q: Quorum) -> None:
        """Name a member that claims a newer version than it held at the last sync committed here, with the very
        anchor digest it held then: the sync it took part in moved every member's anchor (this cluster's too — else
        nobody is named), and an honest cluster on a device that rounds differently holds another digest than the
        others, never the one it held before. It voted to commit and rolled its own state back (issue 69). Only at
        the agreed version: a member at another one is healed from the agreed state anyway."""
        self.rolled_back = set()
        mine = self.held.get(self.t.name)
        if mine is None or mine[1] == "" or q.members[q.me].data.get("anchor") == mine[1]:
            return
        for i, m in enumerate(q.members):
            before = self.held.get(m.name)
            if i == q.me or before is None or before[1] == "":
                continue
            if q.agreed_sync == m.sync > before[0] and m.data.get("anchor") == before[1]:
                self.suspects.name(q, i, f"claims sync {m.sync} with the anchor it held at sync {before[0]} (digest "
                                   f"{before[1][:12]}): it rolled back a sync it took part in (its update counts for "
                                   "nothing in this sync)", kind="rolled back")
                self.rolled_back.add(m.name)

    # ------------------------------------------------------------ the one writer of `sync_index`
    def holds(self, sync: int) -> None:
        """The anchor version this cluster holds now (restored, or ddp's: its step)."""
        self.sync_index = sync

    def syncing(self, q: Quorum) -> None:
        """A sync of quorum `q` starts: the version it makes (the agreed one when nobody contributes)."""
        self.sync_index = q.agreed_sync + (1 if any(m.contributes for m in q.members) else 0)
        if self.sync_index > q.agreed_sync:
            self._claims[self.sync_index] = {m.name: (m.sync, str(m.data.get("anchor", ""))) for m in q.members}

    def aborted(self) -> None:
        """The sync that was to make the next version did not commit."""
        self.sync_index = max(self.sync_index - 1, 0)

    def agreed_steps(self, q: Quorum) -> int:
        """The step the quorum's claims agree on (`claims.agreed_steps`): bounded by the sync count under a step
        schedule; every claim bounded above by it is named."""
        sched = self.pacer.cfg.schedule
        agreed = claims.agreed_steps(q, sched.steps_at if self.lockstep_sgd else None)
        if self.lockstep_sgd:
            # a sync that was lost leaves everyone's steps past what the sync count implies: a claim is named only
            # past this cluster's own too (the honest all lost the same syncs)
            own = q.members[q.me].data.get("total_steps", 0)
            bound = max(sched.steps_at(q.agreed_sync + 1), own if isinstance(own, int) else 0)
            for i, m in enumerate(q.members):
                claim = m.data.get("total_steps", 0)
                if i != q.me and isinstance(claim, int) and claim > bound:
                    self.suspects.name(q, i, f"claims total_steps = {claim}, more than the {bound} that sync "
                                       f"{q.agreed_sync} implies (bounded)", kind="total_steps")
        return agreed

    def meet(self) -> Quorum | None:
        """Before the first step: the first quorum this cluster takes part in (None: training alone)."""
        deadline = time.time() + self.cfg.quorum_timeout_s
        regroup = time.time() + self.cfg.join_timeout_s  # a resumed cluster's grace window, a fresh one's join wait
        seen = [""]  # who the last quorum held, who it missed: the wait's progress lines say it
        regrouping = self.cfg.restarted or self.pacer.total_steps > 0  # the grace window, not the quorum timeout
        limit = self.cfg.join_timeout_s if regrouping else self.cfg.quorum_timeout_s
        wait = Wait(f"the federation (cluster {self.t.name} joining)", limit, detail=lambda: seen[0])
        while True:
            try:  # what a quorum asked again for adopts is bounded like any other (`agreed_steps`)
                q = self.form(0)
            except FederationRefused:
                raise
            except (FederationError, SyncAborted) as exc:
                self.t.abort()
                if STOP.is_set():  # a signal: the loop stops at its first step boundary
                    log.warning("cluster %s: not joining: %s", self.t.name, exc)
                    return None
                if time.time() >= deadline:
                    log.warning("cluster %s: could not join at start (%s); training alone until the next sync",
                                self.t.name, exc)
                    return None
                level = logging.WARNING if isinstance(exc, HealError) else logging.INFO  # a refused heal: said
                log.log(level, "cluster %s: joining: %s; trying again", self.t.name, exc)
                seen[0] = f"the last try: {exc}"
                wait.tick()
                continue
            if self._discard(q, deadline, regroup) and not STOP.is_set():
                self.t.abort()
                absent = sorted(set(self.cfg.expected) - {*q.names, *q.left_out}) if q is not None else []
                seen[0] = f"in the last quorum: {', '.join(q.names) if q else '-'}; missing: {', '.join(absent)}"
                wait.tick()
                time.sleep(0.1)
                continue
            if q is not None and len(q.names) > 1:
                wait.done(f"met {', '.join(q.names)}")
            elif wait.reported:
                wait.done("nobody else came: training alone until the next sync")
            return q

    def _discard(self, q: Quorum | None, deadline: float, regroup: float) -> bool:
        """Is this start-up quorum one to ask again for (a configured cluster is still missing)?"""
        total_steps = self.pacer.total_steps
        missing = q is not None and not set(self.cfg.expected) <= {*q.names, *q.left_out}
        # the federation has begun when a strict majority of the other configured clusters holds a newer anchor;
        # this cluster's own claim does not count (a solo quorum's agreed sync is its own: a transport claiming
        # ahead must not make it start alone), nor does one member's (a liar claiming sync 1 must not make a fresh
        # cluster start with it alone while a third configured cluster is still on its way)
        begun = q is not None and 2 * sum(m.sync > 0 for i, m in enumerate(q.members) if i != q.me) > self._others(q)
        # a fresh start waits the join wait for the configured clusters (a member that never asks holds nobody
        # longer), then trains: `holding_start` keeps its anchor the federation's first for those still coming
        fresh = q is not None and not begun and total_steps == 0 and not self.cfg.restarted \
            and time.time() < min(deadline, regroup)
        resumed = q is not None and (total_steps > 0 or self.cfg.restarted) and q.agreed_sync <= self.sync_index \
            and time.time() < regroup
        return missing and (fresh or resumed)

    def _others(self, q: Quorum) -> int:
        """How many other clusters the federation has: the configured ones, or (none configured) this quorum's."""
        configured = set(self.cfg.expected) - {self.t.name}
        return len(configured) if configured else len(q.members) - 1

    def take_adopted(self) -> int | None:
        """The step this cluster moved to (once): the loop continues from there."""
        step, self.adopt_step = self.adopt_step, None
        return step

