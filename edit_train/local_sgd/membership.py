"""This cluster's place in the federation: a quorum per sync (admission, healing, step adoption) and the
meeting before the first step.

A quorum is admitted when our configuration fingerprint is the one most members run (else
`FederationRefused`: retrying cannot help; a lone misconfigured member refuses itself, never the others)
and the source runs it too (else the sync is skipped); then whoever is behind heals from the source
(`healing.py`). Under a step schedule
every cluster ends at `train.steps`, so a cluster that fell behind (joined late, lost a quorum race)
adopts the federation's step rather than syncing one interval late forever.

Joining (`meet`): a fresh federation starts together (ask again until every configured cluster is in the
quorum, bounded by `start_timeout_s`); a resumed one regroups within the grace window `regroup_s`, so the
first cluster back does not sync alone; a cluster restarting while the others run finds them within that
window, or heals at its next sync.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from edit_train.local_sgd.errors import FederationError, FederationRefused, SyncAborted
from edit_train.local_sgd.healing import Healer
from edit_train.local_sgd.pacer import Pacer
from edit_train.local_sgd.protocols import Quorum, Transport

log = logging.getLogger(__name__)


@dataclass
class MembershipConfig:
    fingerprint: str = ""  # what must agree across clusters: `part=value` words (train/build.py) or one hash
    expected: tuple[str, ...] = ()  # the configured clusters: a fresh start waits (bounded) until all met
    start_timeout_s: float = 60.0
    regroup_s: float = 5.0  # a resumed cluster waits this long (the grace window) for the others to resume


class Membership:
    def __init__(self, cfg: MembershipConfig, transport: Transport, healer: Healer, pacer: Pacer) -> None:
        self.cfg, self.t, self.healer, self.pacer = cfg, transport, healer, pacer
        # a step-scheduled local-SGD run: every cluster ends at train.steps
        self.lockstep_sgd = pacer.lockstep and pacer.cfg.local_sgd
        self.incarnation = uuid.uuid4().hex[:12]
        self.sync_index = 0  # the anchor version this cluster holds
        self.healed_from: list[str] = []
        self.adopt_step: int | None = None  # set by a heal or an admission: continue from this step

    def start(self, local_steps: int) -> None:
        """Ask for this sync's quorum (in the background where the transport can)."""
        data = {"local_steps": local_steps, "incarnation": self.incarnation, "fp": self.cfg.fingerprint,
                "total_steps": self.pacer.total_steps}
        self.t.form_start(self.sync_index, data)

    def poll(self, block: bool = False) -> tuple[bool, Quorum | None]:
        """(done, admitted quorum or None when cut off)."""
        done, q = self.t.form_poll(block)
        return done, (self.admit(q) if done else None)

    def form(self, local_steps: int) -> Quorum | None:
        self.start(local_steps)
        return self.poll(block=True)[1]

    def admit(self, q: Quorum | None) -> Quorum | None:
        """An issued quorum: check the configurations agree, heal whoever is behind, adopt the step."""
        if q is None:
            return None
        src = q.members[q.source]
        agreed = federation_fingerprint(q)
        if self.cfg.fingerprint != agreed:
            raise FederationRefused(f"cluster {self.t.name} runs another configuration than the federation "
                                    f"({differences(self.cfg.fingerprint, agreed)}); start it with the federation's "
                                    "config")
        if src.data.get("fp") != agreed:  # the one ahead is the misconfigured one: it leaves, nobody heals from it
            raise FederationError(f"cluster {src.name} runs another configuration than the federation "
                                  f"({differences(str(src.data.get('fp', '')), agreed)}): this sync is skipped")
        healed = self.healer.run(q)
        if healed is not None:
            self.healed_from.append(healed)
        if self.lockstep_sgd:
            top = max(int(m.data.get("total_steps", 0)) for m in q.members)
            if top > self.pacer.total_steps:
                self.adopt_step = self.pacer.total_steps = top
        return q

    def meet(self) -> Quorum | None:
        """Before the first step: the first quorum this cluster takes part in (None: training alone)."""
        deadline = time.time() + self.cfg.start_timeout_s
        regroup = time.time() + self.cfg.regroup_s
        while True:
            try:
                q = self.form(0)
            except FederationRefused:
                raise
            except (FederationError, SyncAborted) as exc:
                self.t.abort()
                if time.time() >= deadline:
                    log.warning("cluster %s: could not join at start (%s); training alone until the next sync",
                                self.t.name, exc)
                    return None
                log.info("cluster %s: joining: %s; trying again", self.t.name, exc)
                continue
            total_steps = self.pacer.total_steps
            missing = q is not None and not set(self.cfg.expected) <= set(q.names)
            fresh = q is not None and q.max_sync == 0 and total_steps == 0 and time.time() < deadline
            resumed = q is not None and total_steps > 0 and q.max_sync <= self.sync_index \
                and time.time() < regroup
            if missing and (fresh or resumed):
                self.t.abort()
                time.sleep(0.1)
                continue
            return q

    def take_adopted(self) -> int | None:
        """The step this cluster moved to (once): the loop continues from there."""
        step, self.adopt_step = self.adopt_step, None
        return step


def differences(mine: str, agreed: str) -> str:
    """The parts of two fingerprints that differ, each with both values (`tokenizer: hf-1a2b here, byte in the
    federation`); a fingerprint that is one opaque word: what it covers."""
    if not all("=" in w for w in (mine + " " + agreed).split()):
        return "model, algorithm or federation.chunks differ"
    ours, theirs = (dict(w.partition("=")[::2] for w in fp.split()) for fp in (mine, agreed))
    return "; ".join(f"{k}: {ours.get(k, '-')} here, {theirs.get(k, '-')} in the federation"
                     for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k))


def federation_fingerprint(q: Quorum) -> str:
    """The configuration most members of `q` run (a tie: the heal source's, if it is among the most
    common): a single misconfigured member refuses itself instead of stopping everyone else."""
    counts = Counter(str(m.data.get("fp", "")) for m in q.members)
    top = max(counts.values())
    src = str(q.members[q.source].data.get("fp", ""))
    return src if counts[src] == top else min(f for f, c in counts.items() if c == top)
