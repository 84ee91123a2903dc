"""The federation key and message authentication (HMAC-SHA256; Poly1305 for bulk tensors).

A federation key is 32 random bytes written hex-encoded to a file only its owner can read (0600). Every
message that crosses hosts — membership records and quorums (`gate.py`), the small exchanges and the
gathered contributions (`transport.py`), heal payloads (`heal.py`) — carries an HMAC-SHA256 tag over a
*context* (what kind of message, and the quorum / sync it belongs to, so a message cannot be replayed into
another one) and its bytes. A message whose tag does not verify is treated as absent: never a reason to
refuse, stop, heal or send state.

Bulk tensors (gathered contributions, heal payloads: megabytes per sync) are tagged with `seal_tag`: Poly1305
(from `cryptography`, OpenSSL's vectorised code, ~4x faster than HMAC-SHA256 here) under a one-time key
derived per message as HMAC-SHA256(federation key, context, sender) — the construction ChaCha20-Poly1305 uses
(a fresh Poly1305 key per message, from a PRF of the key and a unique nonce). Contexts are unique: the quorum's
fresh nonce, the operation's sequence number and the sender (`seal.py`), so no one-time key tags two messages.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any

TAG_BYTES = 32
SEAL_TAG_BYTES = 16  # Poly1305
KEY_ENV = "EDIT_TRAIN_FEDERATION_KEY_FILE"
# The key of a federation that runs without one (`federation.insecure=true`): public, so it authenticates
# nothing; messages still carry tags so that one code path serves both.
INSECURE = b"edit-train insecure federation: no key"


class KeyFileError(ValueError):
    """A key file that cannot be used (the message names it and what to do)."""


def new_key(path: str | Path) -> Path:
    """Write a fresh key to `path` (mode 0600); refuses to overwrite an existing file."""
    return write_private(path, secrets.token_hex(32) + "\n", "a federation key")


def write_private(path: str | Path, text: str, what: str) -> Path:
    """Create `path` with `text`, readable by its owner only (0600); never overwrites (KeyFileError)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{path} already exists: {what} is never overwritten (delete it first, or pick another "
                           "path)") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def load_key(path: str | Path) -> bytes:
    """The key in `path`: 64 hex characters, in a file no one but its owner may read or write."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise KeyFileError(f"federation.key_file: cannot read {path} ({exc.strerror}); make one with "
                        "`edit-train-keygen PATH`") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"federation.key_file: {path} is readable by others (mode {oct(mode & 0o777)}); "
                        f"run `chmod 600 {path}`")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise KeyFileError(f"federation.key_file: {path} does not hold a key (64 hex characters); make one with "
                        "`edit-train-keygen PATH`")
    return key


def canonical(obj: Any) -> bytes:
    """The bytes a JSON object is signed as (sorted keys, no whitespace, no NaN)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


SPENT = [0.0]  # seconds this process spent computing tags (the cost of authentication, in the summary)


def tag(key: bytes, context: str, *parts: bytes | memoryview) -> bytes:
    """HMAC-SHA256 over the context and the parts (each length-prefixed: no two splits collide)."""
    t0 = time.perf_counter()
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (context.encode(), *parts):
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    out = mac.digest()
    SPENT[0] += time.perf_counter() - t0
    return out


def valid(key: bytes, context: str, mac: bytes, *parts: bytes | memoryview) -> bool:
    return len(mac) == TAG_BYTES and hmac.compare_digest(mac, tag(key, context, *parts))


def seal_tag(key: bytes, context: str, sender: bytes, data: bytes | memoryview) -> bytes:
    """The 16-byte tag of one bulk message: Poly1305 over `data` under the one-time key
    HMAC-SHA256(key, "seal", context, sender)."""
    from cryptography.hazmat.primitives.poly1305 import Poly1305  # only a federated process loads OpenSSL's

    t0 = time.perf_counter()
    one_time = tag(key, "seal/" + context, sender)
    out = Poly1305.generate_tag(one_time, data)
    SPENT[0] += time.perf_counter() - t0
    return out


def seal_valid(key: bytes, context: str, sender: bytes, data: bytes | memoryview, mac: bytes) -> bool:
    return len(mac) == SEAL_TAG_BYTES and hmac.compare_digest(mac, seal_tag(key, context, sender, data))


def fingerprint(key: bytes) -> str:
    """A short public name of a key (to tell two keys apart in logs without showing either)."""
    return hashlib.sha256(b"edit-train key id" + key).hexdigest()[:12]


def loopback(host: str) -> bool:
    """Is `host` (a name or an address, optionally with :port) this machine's loopback?"""
    import ipaddress

    host = host.split("://", 1)[-1]
    if host.count(":") == 1 or (host.startswith("[") and "]:" in host):
        host = host.rpartition(":")[0]
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve(key_file: str, insecure: bool, hosts: list[str]) -> bytes:
    """The federation key: `key_file` (or $EDIT_TRAIN_FEDERATION_KEY_FILE); without one, the public insecure
    key — allowed when every address involved is this machine's loopback, or with `federation.insecure`."""
    path = key_file or os.environ.get(KEY_ENV, "")
    if path:
        return load_key(path)
    if insecure or all(loopback(h) for h in hosts if h):
        return INSECURE
    raise KeyFileError("federation.key_file: a federation across hosts needs a key, so that only its members "
                       "can join, steer or read it — make one with `edit-train-keygen PATH` and give every "
                       "cluster and the Lighthouse the same file (or set federation.insecure=true to run "
                       "without: anyone who reaches the Lighthouse could then join)")
