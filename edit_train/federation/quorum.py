"""Membership per sync: a cluster's link to the federation's gate (`gate.py`: torchft's Lighthouse behind
an authenticating front).

Each cluster's leader (its rank 0) keeps a signed heartbeat going and, at every sync, asks for a quorum. The
Lighthouse issues one when at least `min_clusters` clusters have asked and every cluster that is
heartbeating has asked too, or when the join timeout (our grace window) has passed since the first one
asked. A cluster that died stops heartbeating and is left out after the heartbeat timeout; a cluster that is
merely late is waited for at most the join timeout. Only clusters holding the federation key get in, and
with a roster only under their own name (`signed.py`).

What each member tells the others rides in the request: its anchor version (`sync`), its rank count, where
its leader's store listens, and a small dict (`data`: config fingerprint, local steps, incarnation, total
steps, anchor digest, and with a roster the record's signature), each field checked on both sides. The
answer is tagged (and with a roster signed) by the gate and bound to the request it answers; its `nonce` is
fresh per quorum and unguessable, and namespaces (and authenticates) everything of that quorum. With a roster
each member record of the answer is checked against its cluster's key: one that does not verify is left out.
Nothing is pickled.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from dataclasses import replace
from typing import Any

from edit_train.federation import auth, gate, identity
from edit_train.federation.signed import Credentials
from edit_train.local_sgd.errors import FederationError, FederationRefused
from edit_train.local_sgd.protocols import Member, Quorum

log = logging.getLogger(__name__)

if not os.environ.get("RUST_LOG"):
    os.environ["RUST_LOG"] = "warn"  # torchft's Rust side logs every quorum at INFO otherwise


class QuorumClient:
    """The cluster leader's link to the gate: signed heartbeats in the background, a quorum per sync."""

    def __init__(self, lighthouse: str, name: str, key: bytes, connect_timeout_s: float = 10.0,
                 heartbeat_interval_s: float = 0.5, key_source: str = "federation.key_file",
                 refuse_after_s: float = 25.0, credentials: Credentials | None = None) -> None:
        self.lighthouse, self.name, self.key, self.credentials = lighthouse, name, key, credentials
        self._timeout = connect_timeout_s
        self.refusals = KeyRefusals(lighthouse, name, key, key_source, refuse_after_s)
        self._warned: set[tuple[str, str]] = set()
        check_reachable(lighthouse, connect_timeout_s)
        self._partitioned_until = 0.0
        self._stop = threading.Event()
        self._interval = heartbeat_interval_s
        self._beat: threading.Thread | None = None

    def start_heartbeat(self) -> None:
        """From now on the Lighthouse counts this cluster as alive (call when ready to join)."""
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat, name="edit-train-heartbeat", daemon=True)
            self._beat.start()

    # ------------------------------------------------------------ partition
    def partition(self, seconds: float) -> None:
        """Fault injection: this cluster cannot reach the others (nor the Lighthouse) for `seconds`."""
        self._partitioned_until = time.monotonic() + seconds
        log.warning("cluster %s: partitioned from the federation for %.0fs", self.name, seconds)

    @property
    def partitioned(self) -> bool:
        return time.monotonic() < self._partitioned_until

    def _heartbeat(self) -> None:
        identity.WHERE.background = True  # its signatures are counted apart: they are off every sync's path
        while not self._stop.wait(self._interval):
            if self.partitioned:
                continue
            try:
                gate.call(self.lighthouse, {"kind": "heartbeat", "name": self.name}, self.key, self._timeout,
                          self.credentials)
                self.refusals.verified()
            except FederationError as exc:  # keep beating; the quorum call reports for real
                log.debug("heartbeat to %s failed: %s", self.lighthouse, exc)

    def close(self) -> None:
        self._stop.set()

    # --------------------------------------------------------------- quorum
    def request(self, sync: int, size: int, store: str, data: dict[str, Any], timeout_s: float) -> Quorum | None:
        """Ask for this sync's quorum. None when partitioned (the cluster keeps training alone)."""
        if self.partitioned:
            return None
        self.start_heartbeat()
        member = {"name": self.name, "sync": sync, "size": size, "store": store, "data": data}
        if self.credentials is not None:
            member = self.credentials.sign_member(member)
        body = {"kind": "quorum", "name": self.name, "member": member, "timeout_s": timeout_s}
        while True:
            try:
                answer = gate.call(self.lighthouse, body, self.key, timeout_s + 30.0, self.credentials)
                break
            except gate.KeyRefused as exc:
                self.refusals.refused(kind=type(exc))
            except FederationError as exc:
                raise FederationError(f"cluster {self.name}: {exc}") from None
        self.refusals.verified()
        if answer.get("kind") == "error":
            raise FederationError(lighthouse_error(str(answer.get("error", "")), self.name, self.lighthouse,
                                                   timeout_s))
        return self._quorum(answer, data)

    def _quorum(self, answer: dict[str, Any], data: dict[str, Any]) -> Quorum:
        try:
            records = [gate.check_member(m) for m in answer.get("members", [])]
            qid, nonce = int(answer["quorum_id"]), str(answer["nonce"])
        except (gate.FrameError, KeyError, TypeError, ValueError) as exc:
            raise FederationError(f"cluster {self.name}: a malformed quorum from {self.lighthouse}: {exc}") from None
        left_out = [r["name"] for r in records if self._left_out(r)]
        members = [Member.from_json(r) for r in records if r["name"] not in left_out]
        # each record was checked against its roster key: that key names it, and the roster says its declared speed
        # (never the record's own say)
        roster = self.credentials.roster if self.credentials is not None else None
        members = [replace(m, signer=self.credentials.key_id(m.name) if self.credentials is not None else "",
                           speed=roster.speeds.get(m.name, 0.0) if roster is not None else 0.0) for m in members]
        members.sort(key=lambda m: m.name)
        me = next((i for i, m in enumerate(members) if m.name == self.name), -1)
        if me < 0:
            raise FederationError(f"cluster {self.name}: the Lighthouse issued a quorum without us")
        if members[me].data.get("incarnation") != data.get("incarnation"):
            # only key holders get in: another cluster with the key really runs under this name
            raise FederationRefused(f"two clusters are named {self.name!r}: cluster names must be unique "
                                    "(set a different EDIT_TRAIN_CLUSTER / cluster.only)")
        return Quorum(qid, nonce, members, me, sorted(left_out))

    def _left_out(self, record: dict[str, Any]) -> bool:
        """A member record that is not its cluster's (with a roster): left out, one line per cluster and reason."""
        why = self.credentials.member_why(record) if self.credentials is not None else None
        if why is not None and (record["name"], why) not in self._warned:
            self._warned.add((record["name"], why))
            log.warning("cluster %s: cluster %s left out of the sync: it %s", self.name, record["name"], why)
        return why is not None


class KeyRefusals:
    """A gate's "unknown key" answers to one cluster. Those bytes are unauthenticated and a Lighthouse may be
    coming back with the federation's key, so one refusal proves nothing: the cluster asks again, a second
    apart, and only when every answer for `refuse_after_s` was a refusal (nothing verified in between) does
    it stop, with one line naming its key, instead of training alone forever."""

    def __init__(self, lighthouse: str, name: str, key: bytes, key_source: str, refuse_after_s: float) -> None:
        self.lighthouse, self.name, self.key = lighthouse, name, key
        self.key_source, self.refuse_after_s = key_source, refuse_after_s
        self.since: float | None = None

    def verified(self) -> None:
        self.since = None

    def refused(self, count: bool = True, kind: type[gate.KeyRefused] = gate.KeyRefused) -> None:
        """One more refusal (or, `count=False`, no answer after one): FederationRefused once refusals have
        lasted refuse_after_s with nothing verified, else wait a second. `kind`: what the gate refused — the
        federation key, this cluster's identity, or (an unsigned answer) the roster this cluster holds."""
        now = time.monotonic()
        if self.since is None and count:
            self.since = now
            source = self.key_source if kind is gate.KeyRefused else "federation.identity_file, federation.roster_file"
            log.warning("cluster %s: the Lighthouse at %s does not accept this cluster's %s (%s); asking again for "
                        "up to %.0fs", self.name, self.lighthouse, kind.what, source, self.refuse_after_s)
        if self.since is not None and now - self.since >= self.refuse_after_s:
            raise FederationRefused(self._final(kind)) from None
        time.sleep(1.0)

    def _final(self, kind: type[gate.KeyRefused]) -> str:
        head, after = f"cluster {self.name}: the Lighthouse at {self.lighthouse}", f"{self.refuse_after_s:.0f}s"
        if kind is gate.IdentityRefused:
            return (f"{head} does not accept this cluster's identity (federation.identity_file) for {after}: is "
                    f"{self.name!r} on the roster the gate reads (federation.roster_file; the operator adds it with "
                    "`edit-train-keygen add`)?")
        if kind is gate.GateUnsigned:
            return (f"{head} answered without the signature of the gate this cluster's roster names for {after}: "
                    "start it with that roster and its gate.identity (federation.roster_file, "
                    "federation.identity_file)")
        return (f"{head} holds another federation key than this cluster's ({self.key_source}, key id "
                f"{auth.fingerprint(self.key)}): every request for {after} was refused; give every cluster and the "
                "Lighthouse the same key file")


def check_key(lighthouse: str, name: str, key: bytes, key_source: str, refuse_after_s: float,
              timeout_s: float = 10.0, credentials: Credentials | None = None) -> bool:
    """Before a cluster job starts its ranks: does the gate at `lighthouse` hold our key? True when it
    answered a signed hello, False when it could not be reached (the job starts and waits for it as usual);
    FederationRefused when it refused the key for `refuse_after_s` (then no rank starts, and no launcher
    restarts a job that cannot get in)."""
    refusals = KeyRefusals(lighthouse, name, key, key_source, refuse_after_s)
    while True:
        try:
            gate.call(lighthouse, {"kind": "hello", "name": name}, key, timeout_s, credentials)
            return True
        except gate.KeyRefused as exc:
            refusals.refused(kind=type(exc))
        except FederationError as exc:
            if refusals.since is None:
                log.debug("key check: %s", exc)
                return False
            refusals.refused(count=False)  # refused before, unreachable now (a restart?): not a verified answer


def check_reachable(lighthouse: str, timeout_s: float) -> None:
    """A plain TCP connect: a heartbeat would already count this cluster as present (and make the others
    wait for it) before it is ready to join."""
    host, _, port = lighthouse.split("://", 1)[-1].rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise FederationError(f"cannot reach the Lighthouse at {lighthouse} (federation.lighthouse): "
                              f"{_first_line(exc)}; start one (edit-train starts it for local runs, or "
                              "`edit-train-lighthouse --bind HOST:29510`) or fix the address") from None


# how torchft's Lighthouse client says that no quorum came in time: its own words, and gRPC's status text
# (`status: Cancelled, message: "Timeout expired", details: [], metadata: MetadataMap { headers: {} }`)
_TIMEOUT_WORDS = ("timed out", "deadline", "timeout expired", "status: cancelled", "deadlineexceeded")


def lighthouse_error(raw: str, name: str, lighthouse: str, timeout_s: float) -> str:
    """The one plain line for an error torchft's Lighthouse answered a quorum request with: its raw status text
    (gRPC's `status: Cancelled, … MetadataMap …`) never reaches the user."""
    low = raw.lower()
    if any(w in low for w in _TIMEOUT_WORDS):
        return (f"cluster {name}: no quorum within {timeout_s:.0f} s (federation.quorum_timeout_s) from the "
                f"Lighthouse at {lighthouse}: no other cluster asked in that time (are they running, or has the "
                "federation finished?)")
    status = re.search(r'message: "([^"]*)"', raw)  # a gRPC status: its message, not the record around it
    text = status.group(1) if status else raw.strip().splitlines()[0] if raw.strip() else "no reason given"
    return f"cluster {name}: the Lighthouse at {lighthouse} failed: {text}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Lighthouse(gate.Gate):
    """The federation's Lighthouse as edit-train runs it: torchft's, behind the authenticating gate."""


def tell_finished(lighthouse: str, name: str, steps: int, key: bytes, credentials: Credentials | None,
                  timeout_s: float = 10.0) -> bool:
    """Tell the gate, in a request signed by `name`'s roster identity, that this cluster finished the run at
    `steps` (False when the gate could not be told: a cluster relaunched later then trains as before). The run is
    the roster's configuration fingerprint (this cluster's own, checked at start): the gate keeps the finished
    clusters per run, so a new run with the same roster file starts clean."""
    if credentials is None:  # without a roster a name is not proven: the gate keeps nothing
        return False
    body = {"kind": "finished", "name": name, "steps": int(steps), "fp": credentials.roster.fingerprint}
    try:
        gate.call(lighthouse, body, key, timeout_s, credentials)
        return True
    except FederationError as exc:
        log.warning("could not tell the Lighthouse gate at %s that cluster %s finished: %s", lighthouse, name, exc)
        return False


def finished_peers(lighthouse: str, name: str, key: bytes, credentials: Credentials | None,
                   timeout_s: float = 10.0) -> dict[str, int]:
    """The roster names the gate says finished this run (the roster's configuration fingerprint; each by its own
    signed request), with their steps; {} when the gate cannot be asked or has no roster (`credentials` None: a
    name is then not proven)."""
    if credentials is None:
        return {}
    body = {"kind": "hello", "name": name, "fp": credentials.roster.fingerprint}
    try:
        answer = gate.call(lighthouse, body, key, timeout_s, credentials)
    except FederationError as exc:
        log.debug("finished peers: %s", exc)
        return {}
    done = answer.get("finished")
    if not isinstance(done, dict):
        return {}
    return {n: s for n, s in done.items() if isinstance(n, str) and isinstance(s, int) and not isinstance(s, bool)}
