"""What one cluster may claim in a quorum, and what the federation takes from the claims of many.

Every member of an issued quorum described itself when it asked (`Member`: its anchor version, its steps so
far, its configuration fingerprint, the digest of its anchor). No claim one member makes is adopted where the
others' view exists:

* `vet` runs on the issued quorum before any lane connects: a member whose claims cannot be the federation's
  — another configuration, more steps or syncs than the federation runs, a malformed value — is left out,
  alone, with one line naming it and what was wrong. Every honest member leaves out the same members (the
  same records, the same rules), and the others connect among themselves under a nonce derived from who is
  left (`nonce_of`), so the one left out cannot join their lanes. A refusal never makes an honest cluster
  refuse itself: what the federation is comes from the operator's roster (`Terms.authoritative`), which each
  cluster checked its own configuration against at start. Without a roster, a cluster refuses itself only
  when a strict majority of the others runs one other configuration; in a tie each side leaves the other out.
* `Quorum.agreed` (protocols.py) is the state everyone continues from, and the heal source holds it: the
  (sync, anchor digest) most members hold.
* `agreed_steps`: the step a cluster that is behind adopts is the lower median of every member's claim, its
  own counted, each bounded by what the agreed sync count implies (a liar can hold a joiner back by an
  interval at most, never send it — or anyone — to the end of the run).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from edit_train.local_sgd.errors import FederationRefused
from edit_train.local_sgd.protocols import Member, Quorum

DIGEST_RE = re.compile(r"[0-9a-f]{32}")
# Under a time schedule (A-EDiT) the run is a number of syncs every cluster counts itself (`pacer.run_syncs`):
# a fast cluster takes more steps than train.steps meanwhile, up to its speed ratio to a cluster taking
# algo.interval steps per interval (12 x on the namespace-hosts recipe), and with short steps many more (a 4-step
# test run took 10). Claims are bounded at SPEED_SPAN times train.steps plus TIME_MARGIN (`time_bound`): an
# honest cluster up to SPEED_SPAN times as fast is never left out, and a lie of 2^40 or 2^53 steps is still far out.
SPEED_SPAN = 64
TIME_MARGIN = 4096
_COUNTS = ("sync", "local_steps", "total_steps")


@dataclass(frozen=True)
class Terms:
    """What the federation is: the configuration every member runs and the steps it runs for (0: no bound)."""

    fingerprint: str
    total_steps: int = 0
    authoritative: bool = False  # from the operator's signed roster (checked at start), not this cluster's view
    source: str = "this cluster's configuration"  # where the terms come from, for the refusal lines
    slack: int = 1  # a time schedule's fast clusters train on until most reached total_steps: SPEED_SPAN
    margin: int = 0  # ... and pass the stop by an interval's steps, however many a fast cluster takes (TIME_MARGIN)

    @property
    def max_steps(self) -> int:
        """The most steps (and syncs) a member may claim; 0: no bound."""
        return self.total_steps * self.slack + self.margin if self.total_steps > 0 else 0

    def bound(self) -> str:
        whose = f"{self.total_steps} steps of the federation ({self.source})"
        if self.slack == 1 and self.margin == 0:
            return f"the {whose}"
        return f"{self.max_steps}, {self.slack} times the {whose} and {self.margin} more"


def time_bound(total_steps: int) -> int:
    """The most steps a cluster under a time schedule claims, or takes (it stops there on its own: the others
    would leave it out past it); 0: no bound."""
    return total_steps * SPEED_SPAN + TIME_MARGIN if total_steps > 0 else 0


def wrong(m: Member, terms: Terms) -> str | None:
    """Why member `m`'s claims cannot be the federation's (None when they can), configuration aside."""
    values = {"sync": m.sync, **{k: m.data.get(k, 0) for k in _COUNTS[1:]}}
    for k, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"claims {k} = {v!r}, not a count"
        if terms.max_steps > 0 and v > terms.max_steps:
            return f"claims {k} = {v}, more than {terms.bound()}"
    digest = m.data.get("anchor", "")
    if not isinstance(digest, str) or (digest and not DIGEST_RE.fullmatch(digest)):
        return "claims an anchor digest that is not 32 hex digits"
    return None


def vet(q: Quorum, terms: Terms) -> tuple[Quorum, dict[str, str]]:
    """The members of `q` whose claims can be the federation's, and why each other one was left out.
    FederationRefused only when the terms are this cluster's own view and a strict majority of the others runs
    one other configuration. A cluster whose own claims are out of bounds (which the honest never are) keeps
    training alone: it leaves everyone out, as they leave it out."""
    me = q.members[q.me]
    why = {m.name: w for m in q.members if (w := wrong(m, terms)) is not None}
    rest = [m for m in q.members if m.name not in why]
    fps = Counter(str(m.data.get("fp", "")) for m in rest if m.name != me.name)
    top, count = fps.most_common(1)[0] if fps else ("", 0)
    if not terms.authoritative and top != terms.fingerprint and 2 * count > len(rest):
        raise FederationRefused(f"cluster {me.name} runs another configuration than the federation ({count} of "
                                f"{len(rest)} clusters differ: {differences(terms.fingerprint, top)}): start it "
                                "with the federation's config")
    for m in rest:
        fp = str(m.data.get("fp", ""))
        if fp != terms.fingerprint:
            why[m.name] = (f"runs another configuration ({differences(fp, terms.fingerprint, 'there')}; the "
                           f"federation's is from {terms.source})")
    if not why:
        return q, {}
    if me.name in why:
        why = {m.name: f"is not followed by cluster {me.name}, whose own claims are out of bounds: it {why[me.name]}"
               for m in q.members if m.name != me.name}
    keep = [m for m in q.members if m.name not in why]
    return Quorum(q.quorum_id, nonce_of(q.nonce, keep), keep, keep.index(me), [*q.left_out, *sorted(why)]), why


def differences(mine: str, agreed: str, here: str = "here") -> str:
    """The parts of two fingerprints (`part=value` words, train/build.py) that differ, each with both values
    (`tokenizer: hf-1a2b here, byte in the federation`); a fingerprint that is one opaque word: what it covers."""
    words = (mine + " " + agreed).split()
    if not words or not all("=" in w for w in words):
        return "model, algorithm, sync.mode or federation.chunks differ"
    ours, theirs = (dict(w.partition("=")[::2] for w in fp.split()) for fp in (mine, agreed))
    return "; ".join(f"{k}: {str(ours.get(k, '-'))[:24]} {here}, {str(theirs.get(k, '-'))[:24]} in the federation"
                     for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k))


def nonce_of(nonce: str, members: list[Member]) -> str:
    """The nonce of what is left of a quorum: the same for every member that left out the same others, and
    another namespace for the lanes than the issued quorum's (the one left out never meets them there)."""
    names = ",".join(m.name for m in members)
    return hashlib.sha256(f"{nonce}|{names}".encode()).hexdigest()[:32]


def agreed_steps(q: Quorum, steps_at: Callable[[int], int] | None = None) -> int:
    """The step a member behind takes: the lower median of every member's claim, this cluster's own counted,
    each bounded by what the agreed sync count implies. Under a step schedule (`steps_at(S)`: the total steps
    once S syncs are done, `ScheduleConfig.steps_at`) a member asking with the agreed anchor S has taken at most
    steps_at(S + 1) steps, and a member behind that heals to S has at least steps_at(S) (its own claim is raised
    to that). So a liar can hold a joiner back by an interval at most, never send it to the end of the run;
    with two clusters the joiner keeps what the sync count implies (a tie keeps what you have).
    `steps_at` None (no sync count to bound by: a time schedule, ddp, where the sync index is the step): the
    lower median of the others' claims, its own if alone (`Terms.max_steps` bounds them)."""
    me = q.members[q.me]
    own = int(me.data.get("total_steps", 0))
    if steps_at is None:
        claims = [int(m.data.get("total_steps", 0)) for i, m in enumerate(q.members) if i != q.me] or [own]
    else:
        sync = q.agreed_sync
        bound = steps_at(sync + 1)
        if me.sync != sync:
            own = max(own, steps_at(sync))
        claims = [min(own if i == q.me else int(m.data.get("total_steps", 0)), bound)
                  for i, m in enumerate(q.members)]
    claims.sort()
    return claims[(len(claims) - 1) // 2]
