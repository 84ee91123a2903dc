"""The federation's front door: torchft's Lighthouse behind an authenticating gate.

torchft's Lighthouse (its quorum rules are what we use: the grace window, the minimum size, heartbeat
timeouts) has no authentication: anyone who reaches it could join a quorum under any name, take an honest
cluster's name, or stall every quorum by heartbeating under names that never ask. So the Lighthouse listens
on 127.0.0.1 of its host only, and the clusters talk to the *gate*: a small TCP server on the address the
operator names, that forwards a heartbeat or a quorum request only when it is signed with the federation
key, fresh, and not a replay; and signs its answers, bound to the request they answer. A record that does
not verify never reaches the Lighthouse: it is absent (logged once per name and address), never a reason to
refuse, stop, heal or send state, never counted in a quorum, never waited for. torchft's dashboard and its
`POST /replica/:id/kill` are on the loopback interface with the Lighthouse.

Wire format (both ways): 4-byte big-endian length ‖ 32-byte tag ‖ the body's canonical JSON, at most
`MAX_FRAME` bytes; the tag is HMAC-SHA256 (auth.tag) over exactly those JSON bytes, with the context
"gate/request" or "gate/response", and is checked before anything is parsed. Every field of a body is
checked (type, range, size) before use.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import socket
import socketserver
import struct
import threading
import time
from typing import Any

from edit_train.federation import auth
from edit_train.local_sgd.errors import FederationError

log = logging.getLogger(__name__)

MAX_FRAME = 64 * 1024
MAX_WARNED = 1024  # distinct (name, host) pairs of unauthenticated records logged one by one
MAX_SKEW_S = 300.0  # a request more than this far from the gate's clock is stale (or from the future)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*")  # fullmatch; no "..", at most 64
DATA_KEYS = {"local_steps": int, "incarnation": str, "fp": str, "total_steps": int}
# The gate's answer to a request whose tag does not verify: untagged (the gate cannot sign for a key it does
# not hold) and always the same bytes, so a stranger learns only what a closed connection already told it
# (this is a gate, and its key is not theirs). A cluster holding another key can then say so instead of
# training alone; since anyone on the path could forge these bytes, a cluster acts on them only after a
# bounded wait in which nothing verified arrived (quorum.QuorumClient).
UNKNOWN_KEY = b'{"kind":"unknown_key"}'
UNKNOWN_KEY_FRAME = struct.pack(">I", auth.TAG_BYTES + len(UNKNOWN_KEY)) + bytes(auth.TAG_BYTES) + UNKNOWN_KEY


class FrameError(ValueError):
    """Bytes that are not a well-formed, bounded frame (the message says why)."""


class TagError(FrameError):
    """A frame whose tag does not verify: signed with another key, or altered."""


class KeyRefused(FederationError):
    """The gate answered that this request's tag does not verify: it holds another federation key."""


# ----------------------------------------------------------------------------------- frames
def pack(body: dict[str, Any], key: bytes, context: str) -> bytes:
    raw = auth.canonical(body)
    if len(raw) + auth.TAG_BYTES > MAX_FRAME:
        raise FrameError(f"frame of {len(raw) + auth.TAG_BYTES} bytes exceeds {MAX_FRAME}")
    return struct.pack(">I", auth.TAG_BYTES + len(raw)) + auth.tag(key, context, raw) + raw


def read_frame(sock: socket.socket) -> bytes:
    head = _read(sock, 4)
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise FrameError(f"frame length {n} exceeds {MAX_FRAME}")
    return _read(sock, n)


def _read(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise FrameError(f"connection closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def unpack(frame: bytes, key: bytes, context: str) -> dict[str, Any]:
    """The verified body of a frame (tag ‖ JSON), or FrameError. The tag is checked over the exact bytes
    first: nothing unauthenticated is parsed, and no byte can change without the tag failing."""
    mac, raw = frame[:auth.TAG_BYTES], frame[auth.TAG_BYTES:]
    if not auth.valid(key, context, mac, raw):
        raise TagError("tag does not verify (another key, or altered)")
    if raw.count(b"[") + raw.count(b"{") > 256:
        raise FrameError("too deeply nested")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FrameError("not JSON") from None
    if not isinstance(body, dict):
        raise FrameError("not a JSON object")
    return body


def check_member(d: Any) -> dict[str, Any]:
    """A member record as a cluster sends it: name, anchor version, ranks, store address, data."""
    if not isinstance(d, dict):
        raise FrameError("member record is not an object")
    name, sync, size, store, data = d.get("name"), d.get("sync"), d.get("size"), d.get("store"), d.get("data")
    if not (isinstance(name, str) and valid_name(name)):
        raise FrameError("bad cluster name")
    if not (_int(sync) and 0 <= sync < 1 << 53 and _int(size) and 1 <= size <= 1 << 20):
        raise FrameError("bad sync or size")
    if not (isinstance(store, str) and len(store) <= 256):
        raise FrameError("bad store address")
    if not isinstance(data, dict) or set(data) - set(DATA_KEYS):
        raise FrameError("bad data")
    for k, v in data.items():
        if not isinstance(v, DATA_KEYS[k]) or isinstance(v, bool) or (isinstance(v, int) and not 0 <= v < 1 << 53) \
                or (isinstance(v, str) and len(v) > 128):
            raise FrameError(f"bad data.{k}")
    return {"name": name, "sync": sync, "size": size, "store": store, "data": data}


def valid_name(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 64 and NAME_RE.fullmatch(v) is not None


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------------- the gate
class Gate:
    """torchft's Lighthouse on 127.0.0.1, and the authenticating front on `bind` (host:port)."""

    def __init__(self, bind: str, key: bytes, min_clusters: int, join_timeout_s: float,
                 heartbeat_timeout_s: float) -> None:
        from torchft.coordination import LighthouseClient, LighthouseServer

        self.key = key
        self._inner = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_clusters,
                                       join_timeout_ms=int(join_timeout_s * 1000), quorum_tick_ms=50,
                                       heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
        import datetime

        # torchft's address() names this host by its hostname, which resolves to the host's LAN address
        # (or Debian's 127.0.1.1) on a real node, where nothing listens: dial the loopback it is bound to
        self._loopback = f"127.0.0.1:{str(self._inner.address()).rpartition(':')[2]}"
        self._client = LighthouseClient(f"http://{self._loopback}", datetime.timedelta(seconds=10))
        self._seen: dict[tuple[str, str], float] = {}  # (name, nonce) -> when (replays inside the skew window)
        self._warned: set[tuple[str, str]] = set()
        self._signed: dict[str, tuple[str, float]] = {}  # name -> (store address, when) of signed quorum requests
        self._lock = threading.Lock()
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

    def fresh(self, body: dict[str, Any]) -> None:
        ts, nonce, name = body.get("ts"), body.get("nonce"), body.get("name")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or abs(time.time() - ts) > MAX_SKEW_S:
            raise FrameError("stale or future timestamp")
        if not (isinstance(nonce, str) and 16 <= len(nonce) <= 64):
            raise FrameError("bad nonce")
        now = time.time()
        with self._lock:
            self._seen = {k: t for k, t in self._seen.items() if now - t < 2 * MAX_SKEW_S}
            if (str(name), nonce) in self._seen:
                raise FrameError("a replay")
            self._seen[(str(name), nonce)] = now

    def serve(self, body: dict[str, Any]) -> dict[str, Any]:
        kind = body.get("kind")
        name = body.get("name")
        if not (isinstance(name, str) and valid_name(name)):
            raise FrameError("bad cluster name")
        if kind == "heartbeat":
            self._client.heartbeat(name)
            return {"kind": "ok", "re": body["nonce"]}
        if kind == "hello":  # a key check before a cluster starts: answered here, the Lighthouse never sees it
            return {"kind": "ok", "re": body["nonce"]}
        if kind != "quorum":
            raise FrameError(f"unknown request {kind!r}")
        me = check_member(body.get("member"))
        if me["name"] != name:
            raise FrameError("member name differs from the requester's")
        timeout = body.get("timeout_s")
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise FrameError("bad timeout")
        import datetime

        with self._lock:
            self._signed[name] = (me["store"], time.time() + timeout)
        try:
            q = self._client.quorum(replica_id=name, timeout=datetime.timedelta(seconds=timeout), address=name,
                                    store_address=me["store"], step=me["sync"], world_size=me["size"],
                                    shrink_only=False, data=me["data"])
        except Exception as exc:  # noqa: BLE001 - torchft reports a timeout as a RuntimeError
            return {"kind": "error", "re": body["nonce"], "error": str(exc).strip().splitlines()[0][:300]}
        members = []
        for m in q.participants:  # only members whose own signed request is pending: torchft's Lighthouse is
            with self._lock:      # on loopback, but a process on this host could still reach it directly
                signed = self._signed.get(m.replica_id)
            if signed is None or signed[0] != m.store_address or signed[1] < time.time() - 60:
                self.absent("127.0.0.1 (the Lighthouse directly)", "in a quorum without a signed request",
                            str(m.replica_id)[:64])
                continue
            members.append({"name": m.replica_id, "sync": int(m.step), "size": int(m.world_size),
                            "store": m.store_address, "data": dict(m.data or {})})
        created = getattr(q, "created", None)
        stamp = f"{getattr(created, 'seconds', 0)}.{getattr(created, 'nanos', 0)}"
        # the same for every member of this quorum, and unguessable without the key: it namespaces the
        # quorum's lanes and binds every tag of its messages (auth.tag contexts)
        nonce = auth.tag(self.key, "gate/quorum", str(q.quorum_id).encode(), stamp.encode()).hex()[:32]
        return {"kind": "quorum", "re": body["nonce"], "quorum_id": int(q.quorum_id), "nonce": nonce,
                "members": members}


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
            self.gate.fresh(body)
            sock.settimeout(None)
            sock.sendall(pack(self.gate.serve(body), self.gate.key, "gate/response"))
        except FrameError as exc:
            if str(exc).startswith("connection closed after 0 "):  # a reachability probe, or nothing at all
                log.debug("connection from %s closed without a request", peer)
                return
            self.gate.absent(peer, str(exc), name)
        except OSError as exc:
            self.gate.absent(peer, str(exc), name)


def claimed_name(frame: bytes) -> str:
    """The name an unverified (bounded) frame claims, for the log only; "?" when there is none."""
    raw = frame[auth.TAG_BYTES:]
    if raw.count(b"[") + raw.count(b"{") > 256:
        return "?"
    try:
        body = json.loads(raw.decode("utf-8"))
        name = body.get("name") if isinstance(body, dict) else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "?"
    return name[:64] if isinstance(name, str) else "?"


# ----------------------------------------------------------------------------------- clients
def call(address: str, body: dict[str, Any], key: bytes, timeout_s: float) -> dict[str, Any]:
    """One signed request to the gate and its verified answer (FederationError otherwise)."""
    body = {**body, "ts": time.time(), "nonce": secrets.token_hex(16)}
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 10.0)) as sock:
            sock.sendall(pack(body, key, "gate/request"))
            sock.settimeout(timeout_s)
            frame = read_frame(sock)
            if frame == UNKNOWN_KEY_FRAME[4:]:
                raise KeyRefused(f"the Lighthouse gate at {address} does not accept this cluster's federation key")
            answer = unpack(frame, key, "gate/response")
    except (OSError, ValueError) as exc:
        raise FederationError(f"the Lighthouse gate at {address}: {exc}") from None
    if answer.get("re") != body["nonce"]:
        raise FederationError(f"the Lighthouse gate at {address} answered another request")
    return answer
