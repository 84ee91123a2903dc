"""The federation's front door: torchft's Lighthouse behind an authenticating gate.

torchft's Lighthouse (its quorum rules are what we use: the grace window, the minimum size, heartbeat
timeouts) has no authentication: anyone who reaches it could join a quorum under any name, take an honest
cluster's name, or stall every quorum by heartbeating under names that never ask. So the Lighthouse runs in
a network namespace only the gate reaches (`inner.py`; 127.0.0.1 of its host where the kernel allows no user
namespaces), and the clusters talk to the *gate*: a small TCP server on the address the
operator names, that forwards a heartbeat or a quorum request only when it is signed with the federation
key, fresh, and not a replay; and signs its answers, bound to the request they answer. A record that does
not verify never reaches the Lighthouse, and a heartbeat reaches it only for a name whose signed quorum
request is recent (`ASK_WINDOW_S`: a member that never asks is not waited for): it is absent (logged once per name and address), never a reason to
refuse, stop, heal or send state, never counted in a quorum, never waited for. Of a name that asked, heartbeats
are forwarded only while its request is pending or it is a member of the latest quorum the gate answered (it is
training between two syncs): one that asked once and then only heartbeats is waited for at most once — by the
next quorum to form, as torchft waits for a member of the previous quorum — and one whose request was never
answered with a quorum (it asked before anyone else came, with a short timeout) not at all (issue 69 item 7:
it held the honest clusters' first quorum the whole grace window). torchft's dashboard and its
`POST /replica/:id/kill` are on the loopback interface with the Lighthouse.

With a roster (`signed.py`) the gate also knows who is speaking: a request is forwarded only when the name
it claims is on the operator's roster and that name's Ed25519 key signed it (a name cannot be taken; a name
not on the roster is a stranger), and the gate signs its answers with its own identity. Freshness binds a
request to this gate's lifetime: a timestamp before the gate started (a request recorded before a restart,
replayed) or not a finite number is refused, and within the lifetime a nonce is accepted once. Clients track
the gate's clock from its answers, so a host whose clock lags is told "stale" once and asks again.

Wire format (both ways): 4-byte big-endian length ‖ 32-byte tag ‖ the body's canonical JSON, at most
`MAX_FRAME` bytes; the tag is HMAC-SHA256 (auth.tag) over exactly those JSON bytes, with the context
"gate/request" or "gate/response", and is checked before anything is parsed. Every field of a body is
checked (type, range, size) before use.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Any

from edit_train.federation import auth
# the wire format lives in frames.py; its names stay reachable as gate.X (quorum.py, tests)
from edit_train.federation.frames import (DATA_KEYS, MAX_FRAME, NAME_RE, UNKNOWN_IDENTITY_FRAME, UNKNOWN_KEY,  # noqa: F401
                                          UNKNOWN_KEY_FRAME, FrameError, TagError, check_member, claimed_name, pack,
                                          read_frame, unpack, valid_name)
from edit_train.federation.inner import InnerError, InnerLighthouse
from edit_train.federation.roster import RosterFile
from edit_train.federation.signed import Credentials
from edit_train.fsutil import atomic_write_json
from edit_train.local_sgd.errors import FederationError

log = logging.getLogger(__name__)

MAX_WARNED = 1024  # distinct (name, host) pairs of unauthenticated records logged one by one
MAX_RUNS = 16  # runs whose finished clusters the gate keeps (`<roster_file>.finished.json`), the newest
ASK_WINDOW_S = 600.0  # a heartbeat is forwarded only for a name whose signed quorum request is this recent
MAX_SKEW_S = 300.0  # a request more than this far from the gate's clock is stale (or from the future)
_OFFSETS: dict[str, float] = {}  # gate address -> its clock minus ours (from its verified answers)


class Stale(FrameError):
    """A verified request whose timestamp is outside this gate's window (answered with the gate's clock)."""


class KeyRefused(FederationError):
    """The gate answered that this request's tag does not verify: it holds another federation key."""

    what = "federation key"


class IdentityRefused(KeyRefused):
    """The gate answered that this request is not signed by a cluster on its roster."""

    what = "identity"


class GateUnsigned(KeyRefused):
    """The gate's answer verifies with the federation key but is not signed by the gate this cluster's roster
    names (a gate started without the roster, or someone else answering)."""

    what = "roster (its answers are not signed by the roster's gate)"


# ----------------------------------------------------------------------------------- the gate
class Gate:
    """torchft's Lighthouse on 127.0.0.1, and the authenticating front on `bind` (host:port)."""

    def __init__(self, bind: str, key: bytes, min_clusters: int, join_timeout_s: float,
                 heartbeat_timeout_s: float, credentials: Credentials | None = None, roster_file: str = "",
                 isolate: bool = True) -> None:
        self.key, self.credentials = key, credentials  # credentials: the gate's identity and the roster
        self.roster_file = RosterFile(roster_file, credentials.identity.operator) if credentials and roster_file \
            else None
        self.started = time.time()  # a request signed before this is a replay across a restart
        # torchft's Lighthouse in a child process and network namespace of its own: only this gate reaches it
        self._inner = InnerLighthouse(min_clusters, join_timeout_s, heartbeat_timeout_s, isolate)
        if not self._inner.isolated:
            log.warning("gate: torchft's Lighthouse listens on this host's loopback (%s): %s; a local user could "
                        "heartbeat names into it and hold back quorums", self._inner.address, self._inner.why)
        self._loopback = self._inner.address
        self.ask_window_s = max(ASK_WINDOW_S, 4 * join_timeout_s)
        self._seen: dict[tuple[str, str], float] = {}  # (name, nonce) -> when (replays inside the skew window)
        self._warned: set[tuple[str, str]] = set()
        self._signed: dict[str, tuple[str, float]] = {}  # name -> (store address, when) of signed quorum requests
        self._pending: dict[str, int] = {}  # name -> its quorum requests in flight
        self._member_of: dict[str, int] = {}  # name -> the id of the latest quorum it was answered as a member of
        self._latest = -1  # the latest quorum id answered
        self._lock = threading.Lock()
        # roster names that said (each in its own signed request) they finished the run, keyed by the run's
        # configuration fingerprint (the request's `fp`): told to a cluster of that run that starts, so one
        # relaunched after its peers finished exits instead of training alone; a new run (another fingerprint)
        # with the same roster file starts clean. Kept beside the roster, so a restarted gate still knows.
        self._finished_file = (Path(roster_file + ".finished.json").expanduser() if self.roster_file is not None
                               else None)
        self._finished: dict[str, dict[str, int]] = _load_finished(self._finished_file)
        host, _, port = bind.rpartition(":")
        handler = type("Handler", (_Handler,), {"gate": self})
        host = host.strip("[]")
        self._server = _Server((host, int(port)), handler, bind_and_activate=False)
        if ":" in host:
            self._server.address_family = socket.AF_INET6
            self._server.socket = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            self._server.server_bind()
            self._server.server_activate()
        except OSError:
            self._server.server_close()
            self._inner.shutdown()
            raise
        threading.Thread(target=self._server.serve_forever, name="edit-train-gate", daemon=True).start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    @property
    def isolated(self) -> bool:
        """Is torchft's Lighthouse in a network namespace only this gate reaches?"""
        return self._inner.isolated

    @property
    def dashboard(self) -> str:
        """torchft's own Lighthouse (and its dashboard): on this host's loopback only."""
        return self._loopback

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._inner.shutdown()

    # ------------------------------------------------------------------ requests
    def absent(self, peer: str, why: str, name: str = "?") -> None:
        """Log a record that did not verify, once per (claimed name, host); past MAX_WARNED of them, once."""
        with self._lock:
            first = (name, peer) not in self._warned and len(self._warned) < MAX_WARNED
            if first:
                self._warned.add((name, peer))
            flood = not first and len(self._warned) == MAX_WARNED
            if flood:
                self._warned.add(("", ""))  # past the cap: said once
        if first:
            log.warning("unauthenticated record from %s (name %r): %s; ignored", peer, name, why)
        elif flood:
            log.warning("more than %d unauthenticated names/hosts: no longer logging each", MAX_WARNED - 1)

    def who(self, body: dict[str, Any]) -> str | None:
        """Why a request is not from the cluster it names (None: it is, or this gate has no roster)."""
        if self.credentials is None:
            return None
        newer = self.roster_file.newer() if self.roster_file is not None else None
        if newer is not None and self.credentials.adopt(newer.doc):
            log.warning("gate: roster version %d in use (clusters %s)", newer.version, sorted(newer.clusters))
        return self.credentials.request_why(body)

    def fresh(self, body: dict[str, Any]) -> None:
        ts, nonce, name = body.get("ts"), body.get("nonce"), body.get("name")
        if not (isinstance(nonce, str) and 16 <= len(nonce) <= 64):
            raise FrameError("bad nonce")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
            raise FrameError(f"timestamp {ts!r} is not a finite number")
        now = time.time()
        if ts < self.started:
            raise Stale("timestamp before this gate started (a request recorded before a restart, replayed?)")
        if abs(now - ts) > MAX_SKEW_S:
            raise Stale(f"timestamp {now - ts:+.0f} s off this gate's clock")
        with self._lock:
            self._seen = {k: t for k, t in self._seen.items() if now - t < 2 * MAX_SKEW_S}
            if (str(name), nonce) in self._seen:
                raise FrameError("a replay")
            self._seen[(str(name), nonce)] = now

    def asked(self, name: str) -> bool:
        """Has `name` sent a signed quorum request within `ask_window_s` (pending ones included)?"""
        with self._lock:
            signed = self._signed.get(name)
        return signed is not None and signed[1] > time.time() - self.ask_window_s

    def taking_part(self, name: str) -> bool:
        """Is `name` asking for a quorum now, or a member of the latest quorum answered (training toward the next
        sync)? Only then are its heartbeats forwarded: torchft waits the grace window for a heartbeating name."""
        with self._lock:
            return self._pending.get(name, 0) > 0 or self._member_of.get(name, -2) == self._latest

    def unasked(self, name: str) -> None:
        """A signed heartbeat from a name without a recent quorum request: not forwarded, said once per name."""
        with self._lock:
            first = ("heartbeat", name) not in self._warned and len(self._warned) < MAX_WARNED
            if first:
                self._warned.add(("heartbeat", name))
        if first:
            signer = f"signed by roster key {name}" if self.credentials is not None else "signed with the key"
            log.warning("gate: heartbeats of cluster %s (%s) not forwarded: it has not asked for a quorum in the "
                        "last %.0f s, and a name that never asks would hold back every quorum", name, signer,
                        self.ask_window_s)

    def serve(self, body: dict[str, Any]) -> dict[str, Any]:
        kind = body.get("kind")
        name = body.get("name")
        if not (isinstance(name, str) and valid_name(name)):
            raise FrameError("bad cluster name")
        if kind == "heartbeat":
            if not self.asked(name):  # a name that never asks must not count as alive: it would hold back quorums
                self.unasked(name)
            elif self.taking_part(name):  # else: it asked, and since then a quorum formed without it (silently:
                self._inner.heartbeat(name)  # an honest cluster that missed one is in this state until it asks)
            return {"kind": "ok", "re": body["nonce"]}
        if kind == "hello":  # a key check before a cluster starts: answered here, the Lighthouse never sees it
            fp = _run_fp(body.get("fp", ""))
            with self._lock:
                finished = dict(self._finished.get(fp, {})) if fp else {}
            return {"kind": "ok", "re": body["nonce"], "finished": finished}
        if kind == "finished":  # `name` (its own signature: who() checked it) finished run `fp` at `steps`
            steps, fp = body.get("steps"), _run_fp(body.get("fp"))
            if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps < 2 ** 53:
                raise FrameError("bad steps")
            if not fp:
                raise FrameError("bad fp (the run's configuration fingerprint)")
            if self.credentials is None:  # without a roster a name is not proven: never a reason to stop anyone
                return {"kind": "ok", "re": body["nonce"]}
            with self._lock:
                runs = {f: r for f, r in self._finished.items() if f != fp}
                # the newest runs only (a roster file reused run after run must not grow the file without end)
                self._finished = {**dict(list(runs.items())[-(MAX_RUNS - 1):]),
                                  fp: {**self._finished.get(fp, {}), name: steps}}
                finished = {"runs": {f: dict(r) for f, r in self._finished.items()}}
            if self._finished_file is not None:
                try:
                    atomic_write_json(self._finished_file, finished)
                except OSError as exc:
                    log.warning("gate: cannot write %s: %s (finished clusters kept in memory)", self._finished_file,
                                exc)
            return {"kind": "ok", "re": body["nonce"]}
        if kind != "quorum":
            raise FrameError(f"unknown request {kind!r}")
        me = check_member(body.get("member"))
        if me["name"] != name:
            raise FrameError("member name differs from the requester's")
        timeout = body.get("timeout_s")
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise FrameError("bad timeout")
        with self._lock:
            self._signed[name] = (me["store"], time.time() + timeout)
            self._pending[name] = self._pending.get(name, 0) + 1
        try:
            q = self._inner.quorum(name, me["store"], me["sync"], me["size"], me["data"], timeout)
        except BaseException as exc:
            with self._lock:
                self._pending[name] -= 1
            if isinstance(exc, InnerError):  # torchft reports a timeout as a RuntimeError
                return {"kind": "error", "re": body["nonce"], "error": str(exc)[:300]}
            raise
        members = []
        for m in q["participants"]:  # only members whose own signed request is pending (where torchft's
            with self._lock:            # Lighthouse is not isolated, a process on this host could reach it)
                signed = self._signed.get(m["replica_id"])
            if signed is None or signed[0] != m["store_address"] or signed[1] < time.time() - 60:
                self.absent("127.0.0.1 (the Lighthouse directly)", "in a quorum without a signed request",
                            str(m["replica_id"])[:64])
                continue
            members.append({"name": m["replica_id"], "sync": int(m["step"]), "size": int(m["world_size"]),
                            "store": m["store_address"], "data": dict(m["data"] or {})})
        with self._lock:  # a member of this quorum before this request stops being pending (its beats go on)
            qid = int(q["quorum_id"])
            self._latest = max(self._latest, qid)
            for m in members:
                self._member_of[m["name"]] = max(self._member_of.get(m["name"], -2), qid)
            self._pending[name] -= 1
        stamp = f"{q['created'][0]}.{q['created'][1]}"
        # the same for every member of this quorum, and unguessable without the key: it namespaces the
        # quorum's lanes and binds every tag of its messages (auth.tag contexts)
        nonce = auth.tag(self.key, "gate/quorum", str(q["quorum_id"]).encode(), stamp.encode()).hex()[:32]
        return {"kind": "quorum", "re": body["nonce"], "quorum_id": int(q["quorum_id"]), "nonce": nonce,
                "members": members}


    def answer(self, answer: dict[str, Any], body: dict[str, Any]) -> bytes:
        """An answer to `body` as a frame: with this gate's clock, signed by its identity when it has one."""
        answer = {**answer, "now": time.time()}
        if self.credentials is not None:
            answer = self.credentials.sign_answer(answer, body.get("roster"))
        return pack(answer, self.key, "gate/response")


class _Server(socketserver.ThreadingTCPServer):
    """The gate's listening socket. SO_REUSEADDR: a Lighthouse restarted where it was rebinds its port at
    once instead of failing for the minute its old connections spend in TIME-WAIT."""

    allow_reuse_address = True
    daemon_threads = True


class _Handler(socketserver.BaseRequestHandler):
    gate: Gate

    def handle(self) -> None:
        sock, peer = self.request, str(self.client_address[0])  # the host: logged once per (name, host)
        sock.settimeout(10.0)
        name = "?"
        try:
            raw = read_frame(sock)
            name = claimed_name(raw)
            try:
                body = unpack(raw, self.gate.key, "gate/request")
            except TagError:
                sock.sendall(UNKNOWN_KEY_FRAME)
                raise
            why = self.gate.who(body)
            if why is not None:
                sock.sendall(UNKNOWN_IDENTITY_FRAME)
                raise FrameError(why)
            try:
                self.gate.fresh(body)
            except Stale:
                sock.sendall(self.gate.answer({"kind": "stale", "re": body["nonce"]}, body))
                raise
            sock.settimeout(None)
            sock.sendall(self.gate.answer(self.gate.serve(body), body))
        except FrameError as exc:
            if str(exc).startswith("connection closed after 0 "):  # a reachability probe, or nothing at all
                log.debug("connection from %s closed without a request", peer)
                return
            self.gate.absent(peer, str(exc), name)
        except OSError as exc:
            self.gate.absent(peer, str(exc), name)


def _run_fp(v: Any) -> str:
    """A request's run fingerprint (its configuration's, train/build.py `fingerprint`), "" when it is not one."""
    return v if isinstance(v, str) and 0 < len(v) <= 128 else ""


def _load_finished(path: Path | None) -> dict[str, dict[str, int]]:
    """The finished roster names a gate kept beside its roster, per run fingerprint ({} when none, or the file is
    not one: a file of the format before runs were told apart, {name: steps}, is an unknown run's, ignored)."""
    if path is None:
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    runs = doc.get("runs") if isinstance(doc, dict) else None
    if not isinstance(runs, dict):
        return {}
    return {fp: {n: s for n, s in r.items() if valid_name(n) and isinstance(s, int) and not isinstance(s, bool)}
            for fp, r in list(runs.items())[-MAX_RUNS:] if _run_fp(fp) and isinstance(r, dict)}


# ----------------------------------------------------------------------------------- clients
def call(address: str, body: dict[str, Any], key: bytes, timeout_s: float,
         credentials: Credentials | None = None) -> dict[str, Any]:
    """One signed request to the gate and its verified answer (FederationError otherwise). A "stale" answer
    (this host's clock is off the gate's, or the gate restarted) sets the clock offset and asks once more."""
    for _ in range(2):
        answer = _call_once(address, body, key, timeout_s, credentials)
        if answer.get("kind") != "stale":
            return answer
    raise FederationError(f"the Lighthouse gate at {address} calls every request of this cluster stale: is this "
                          "host's clock jumping?")


def _call_once(address: str, body: dict[str, Any], key: bytes, timeout_s: float,
               credentials: Credentials | None) -> dict[str, Any]:
    body = {**body, "ts": time.time() + _OFFSETS.get(address, 0.0), "nonce": secrets.token_hex(16)}
    if credentials is not None:
        body = credentials.sign_request(body)
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 10.0)) as sock:
            sock.sendall(pack(body, key, "gate/request"))
            sock.settimeout(timeout_s)
            frame = read_frame(sock)
            if frame == UNKNOWN_KEY_FRAME[4:]:
                raise KeyRefused(f"the Lighthouse gate at {address} does not accept this cluster's federation key")
            if frame == UNKNOWN_IDENTITY_FRAME[4:]:
                raise IdentityRefused(f"the Lighthouse gate at {address} does not accept this cluster's identity")
            answer = unpack(frame, key, "gate/response")
    except (OSError, ValueError) as exc:
        raise FederationError(f"the Lighthouse gate at {address}: {exc}") from None
    if answer.get("re") != body["nonce"]:
        raise FederationError(f"the Lighthouse gate at {address} answered another request")
    if credentials is not None and not credentials.answer_ok(answer):
        raise GateUnsigned(f"the Lighthouse gate at {address} answered without the signature of the roster's gate")
    now = answer.get("now")
    if isinstance(now, (int, float)) and not isinstance(now, bool) and math.isfinite(now):
        _OFFSETS[address] = now - time.time()
    return answer
