"""Who said it: Ed25519 signatures on what crosses the gate, checked against the operator's roster.

* a request to the gate (heartbeat, quorum, hello) is signed by the cluster it names: the gate forwards it
  only if that name is on its roster and the signature verifies under that name's key — a name cannot be
  taken, and a name not on the roster is a stranger (absent);
* the member record inside a quorum request (name, anchor version, ranks, store address, claims) carries its
  own signature in `data["sig"]`: every cluster checks each record of an issued quorum itself and leaves out
  one that does not verify, so not even the gate can put words in a cluster's mouth;
* the gate's answers are signed by the gate's identity (the roster names its key), and may carry a newer
  roster, which a cluster adopts only if the operator it trusts signed it.

The federation key's HMAC tag stays on every frame (strangers are dropped before anything is parsed or a
signature checked: docs/architecture.md, "Security model").
"""

from __future__ import annotations

import hashlib

import logging
import threading
from typing import Any

from edit_train.federation.identity import Identity, IdentityError, verify
from edit_train.federation.roster import Roster, parse

log = logging.getLogger(__name__)

REQUEST, MEMBER, ANSWER = "gate/request", "member", "gate/answer"


def unsigned(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "sig"}


def member_body(m: dict[str, Any]) -> dict[str, Any]:
    """What a member record's signature covers: the record, its data less the signature."""
    data = {k: v for k, v in (m.get("data") or {}).items() if k != "sig"}
    return {"name": m.get("name"), "sync": m.get("sync"), "size": m.get("size"), "store": m.get("store"), "data": data}


class Credentials:
    """An identity and the roster it trusts (a newer one, signed by the same operator, replaces it)."""

    def __init__(self, identity: Identity, roster: Roster) -> None:
        if roster.operator != identity.operator:
            raise IdentityError(f"the roster was signed by another operator than {identity.name!r}'s identity trusts")
        self.identity, self._roster = identity, roster
        self._lock = threading.Lock()

    @property
    def roster(self) -> Roster:
        with self._lock:
            return self._roster

    def adopt(self, doc: Any) -> bool:
        """A roster document from the gate: adopted when the operator signed it and it is newer."""
        try:
            newer = parse(doc, self.identity.operator, "a roster from the gate")
        except IdentityError as exc:
            log.warning("%s: %s; kept version %d", self.identity.name, exc, self.roster.version)
            return False
        with self._lock:
            if newer.version <= self._roster.version:
                return False
            self._roster = newer
        log.info("%s: roster version %d adopted (clusters %s)", self.identity.name, newer.version,
                 sorted(newer.clusters))
        return True

    # ------------------------------------------------------------------ a cluster's side
    def sign_request(self, body: dict[str, Any]) -> dict[str, Any]:
        body = {**body, "roster": self.roster.version}
        return {**body, "sig": self.identity.sign(REQUEST, body)}

    def sign_member(self, member: dict[str, Any]) -> dict[str, Any]:
        data = {k: v for k, v in member["data"].items() if k != "sig"}
        member = {**member, "data": data}
        return {**member, "data": {**data, "sig": self.identity.sign(MEMBER, member_body(member))}}

    def answer_ok(self, answer: dict[str, Any]) -> bool:
        """Is `answer` the gate's (signed by the roster's gate key)? A newer roster in it is adopted first."""
        if "roster" in answer:
            self.adopt(answer["roster"])
        gate = self.roster.gate
        return gate is not None and verify(gate, ANSWER, unsigned(answer), answer.get("sig"))

    def key_id(self, name: str) -> str:
        """The short public id of cluster `name`'s roster key ("" when it has none): what names a liar."""
        key = self.roster.key(name)
        return hashlib.sha256(b"edit-train roster key" + key).hexdigest()[:12] if key is not None else ""

    def member_why(self, m: dict[str, Any]) -> str | None:
        """Why a member record of an issued quorum is not its cluster's (None when it is)."""
        name = str(m.get("name"))
        key = self.roster.key(name)
        if key is None:
            return f"is not on the roster (version {self.roster.version}): a stranger"
        if not verify(key, MEMBER, member_body(m), (m.get("data") or {}).get("sig")):
            return "sent a record its roster key did not sign"
        return None

    # ------------------------------------------------------------------ the gate's side
    def request_why(self, body: dict[str, Any]) -> str | None:
        """Why a request is not from the cluster it names (None when it is)."""
        name = str(body.get("name"))
        key = self.roster.key(name)
        if key is None:
            return f"cluster {name} is not on the roster (version {self.roster.version}): a stranger"
        if not verify(key, REQUEST, unsigned(body), body.get("sig")):
            return f"not signed by cluster {name}'s roster key (a taken name, or another identity)"
        member = body.get("member")
        if isinstance(member, dict) and not verify(key, MEMBER, member_body(member), (member.get("data") or {}).get("sig")):
            return f"its member record is not signed by cluster {name}'s roster key"
        return None

    def sign_answer(self, answer: dict[str, Any], requester_version: Any) -> dict[str, Any]:
        roster = self.roster
        if isinstance(requester_version, int) and requester_version < roster.version:
            answer = {**answer, "roster": roster.doc}
        return {**answer, "sig": self.identity.sign(ANSWER, answer)}


def load_credentials(identity_file: str, roster_file: str, name: str, role: str = "cluster") -> Credentials | None:
    """The identity and roster named by the config (or $EDIT_TRAIN_IDENTITY_FILE / $EDIT_TRAIN_ROSTER_FILE),
    checked to belong together and to `name` (a cluster) or to the roster's gate; None when neither is set.
    IdentityError (one line naming the file and what to do) otherwise."""
    import os

    from edit_train.federation.identity import IDENTITY_ENV, load_identity
    from edit_train.federation.roster import ROSTER_ENV, load_roster

    identity_file = identity_file or os.environ.get(IDENTITY_ENV, "")
    roster_file = roster_file or os.environ.get(ROSTER_ENV, "")
    if not identity_file and not roster_file:
        return None
    if not identity_file or not roster_file:
        missing = "federation.identity_file" if not identity_file else "federation.roster_file"
        raise IdentityError(f"{missing} is not set (the other one is): a cluster needs both its identity and the "
                            "federation's roster (edit-train-keygen federation DIR makes them)")
    identity = load_identity(identity_file, role=role)
    roster = load_roster(roster_file, identity.operator)
    where = f"federation.identity_file: {identity_file}"
    if role == "gate":
        if roster.gate != identity.public:
            raise IdentityError(f"{where} is not the gate the roster {roster_file} names")
    elif identity.name != name:
        raise IdentityError(f"{where} is cluster {identity.name!r}'s identity, this is cluster {name!r}: give each "
                            "cluster its own file")
    elif roster.key(name) is None:
        raise IdentityError(f"cluster {name!r} is not on the roster {roster_file} (version {roster.version}): the "
                            f"operator adds it with `edit-train-keygen add DIR {name}`")
    elif roster.key(name) != identity.public:
        raise IdentityError(f"{where} is not the key the roster {roster_file} holds for cluster {name!r}")
    return Credentials(identity, roster)
