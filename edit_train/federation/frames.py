"""The gate's wire format: frames (length ‖ HMAC-SHA256 tag ‖ canonical JSON), parsed totally, and the checks
on a member record. Nothing unauthenticated is parsed; every field is checked (type, range, size) before use.
"""

from __future__ import annotations

import json
import re
import socket
import struct
from typing import Any

from edit_train.federation import auth

MAX_FRAME = 64 * 1024
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*")  # fullmatch; no "..", at most 64
DATA_KEYS = {"local_steps": int, "incarnation": str, "fp": str, "total_steps": int, "anchor": str, "sig": str,
             "refused": str, "missed": int}
# The gate's answer to a request whose tag does not verify: untagged (the gate cannot sign for a key it does
# not hold) and always the same bytes, so a stranger learns only what a closed connection already told it
# (this is a gate, and its key is not theirs). A cluster holding another key can then say so instead of
# training alone; since anyone on the path could forge these bytes, a cluster acts on them only after a
# bounded wait in which nothing verified arrived (quorum.QuorumClient).
UNKNOWN_KEY = b'{"kind":"unknown_key"}'
UNKNOWN_KEY_FRAME = struct.pack(">I", auth.TAG_BYTES + len(UNKNOWN_KEY)) + bytes(auth.TAG_BYTES) + UNKNOWN_KEY
# ... and to a request with the key whose name is not on the roster or not signed by that name's key
UNKNOWN_IDENTITY = b'{"kind":"unknown_identity"}'
UNKNOWN_IDENTITY_FRAME = struct.pack(">I", auth.TAG_BYTES + len(UNKNOWN_IDENTITY)) + bytes(auth.TAG_BYTES) + \
    UNKNOWN_IDENTITY

class FrameError(ValueError):
    """Bytes that are not a well-formed, bounded frame (the message says why)."""


class TagError(FrameError):
    """A frame whose tag does not verify: signed with another key, or altered."""



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
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FrameError("not JSON (or NaN / Infinity in it)") from None
    if not isinstance(body, dict):
        raise FrameError("not a JSON object")
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


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
