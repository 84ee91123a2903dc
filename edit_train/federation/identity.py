"""Per-cluster identities: Ed25519 keys (`cryptography`), the files that hold them, and signatures.

Each cluster, the gate and the operator hold one private key. An identity file is JSON in a file only its
owner can read (0600):

    {"kind": "edit-train-identity", "name": "c0", "role": "cluster" | "gate" | "operator",
     "key": "<64 hex: the Ed25519 private seed>", "operator": "<64 hex: the operator's public key>"}

The operator's public key in it is the pin every roster is checked against (`roster.py`): a cluster trusts a
roster because the operator who gave it its identity signed it, never because a peer sent it. Signatures are
over a context (what kind of record) and the record's canonical JSON, so a signature of one kind of record
is never valid as another.
"""

from __future__ import annotations

import json
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from edit_train.federation.auth import KeyFileError, canonical, write_private

KIND = "edit-train-identity"
ROLES = ("cluster", "gate", "operator")
IDENTITY_ENV = "EDIT_TRAIN_IDENTITY_FILE"
SIG_HEX = 128  # an Ed25519 signature, hex
MAX_FILE = 4096
SPENT = [0.0]  # seconds this process spent signing and verifying (with the anchor digests: summary trust_s)
BACKGROUND_SPENT = [0.0]  # the part of SPENT spent on a background thread (the leader's heartbeat), off any sync


class _Where(threading.local):
    background = False  # set by a thread whose signatures are off the sync path (quorum.py: the heartbeat)


WHERE = _Where()


def _spent(t0: float) -> None:
    dt = time.perf_counter() - t0
    SPENT[0] += dt
    if WHERE.background:
        BACKGROUND_SPENT[0] += dt


class IdentityError(KeyFileError):
    """An identity (or roster) file that cannot be used: the message names it and what to do."""


@dataclass(frozen=True)
class Identity:
    name: str
    role: str
    private: Ed25519PrivateKey
    operator: bytes  # the operator's public key: the pin a roster must be signed with

    @property
    def public(self) -> bytes:
        return raw(self.private.public_key())

    def sign(self, context: str, obj: Any) -> str:
        """The hex signature of `obj` (canonical JSON) under `context`."""
        t0 = time.perf_counter()
        out = self.private.sign(message(context, obj)).hex()
        _spent(t0)
        return out


def raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def message(context: str, obj: Any) -> bytes:
    return b"edit-train/" + context.encode() + b"\0" + canonical(obj)


def verify(public: bytes, context: str, obj: Any, sig: Any) -> bool:
    """Does `sig` (hex) sign `obj` under `context` with the key `public` (32 raw bytes)?"""
    if not (isinstance(sig, str) and len(sig) == SIG_HEX):
        return False
    t0 = time.perf_counter()
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(bytes.fromhex(sig), message(context, obj))
        return True
    except (InvalidSignature, ValueError):
        return False
    finally:
        _spent(t0)


def new_identity(path: str | Path, name: str, role: str, operator: bytes | None = None) -> Identity:
    """Write a fresh identity to `path` (mode 0600; refuses to overwrite). `operator`: the operator's public
    key (None: this is the operator's own identity, its pin is itself)."""
    assert role in ROLES, role
    key = Ed25519PrivateKey.generate()
    ident = Identity(name, role, key, operator if operator is not None else raw(key.public_key()))
    doc = {"kind": KIND, "name": name, "role": role, "key": key.private_bytes_raw().hex(), "operator": ident.operator.hex()}
    try:
        write_private(path, json.dumps(doc, indent=1) + "\n", "an identity")
    except KeyFileError as exc:
        raise IdentityError(str(exc)) from None
    return ident


def read_file(path: Path, field: str, what: str, max_bytes: int, private: bool) -> bytes:
    """The bytes of a regular file of at most `max_bytes` that others may not read (`private`) or not write
    (IdentityError naming `field` and the fix otherwise)."""
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            raise IdentityError(f"{field}: {path} is not a regular file")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise IdentityError(f"{field}: cannot read {path} ({exc.strerror}); {what}") from None
    if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(f"{field}: {path} is open to others (mode {oct(mode & 0o777)}); run `chmod 600 {path}`")
    if not private and mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise IdentityError(f"{field}: {path} is writable by others (mode {oct(mode & 0o777)}); run `chmod 644 {path}`")
    if len(data) > max_bytes:
        raise IdentityError(f"{field}: {path} is larger than {max_bytes} bytes: not an edit-train file")
    return data


def load_identity(path: str | Path, field: str = "federation.identity_file", role: str | None = None) -> Identity:
    """The identity in `path` (IdentityError, one line naming `field`, otherwise)."""
    path = Path(path)
    make = "make one with `edit-train-keygen federation DIR` (or ask the federation's operator)"
    text = read_file(path, field, make, MAX_FILE, private=True)
    try:
        doc = json.loads(text.decode("utf-8", "replace"))
        ok = isinstance(doc, dict) and doc.get("kind") == KIND and doc.get("role") in ROLES \
            and isinstance(doc.get("name"), str) and 0 < len(doc["name"]) <= 64
        key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(doc["key"])) if ok else None
        operator = bytes.fromhex(doc["operator"]) if ok else b""
    except (ValueError, TypeError, KeyError):
        ok, key, operator = False, None, b""
    if not ok or key is None or len(operator) != 32:
        raise IdentityError(f"{field}: {path} is not an edit-train identity file; {make}")
    if role is not None and doc["role"] != role:
        raise IdentityError(f"{field}: {path} is the identity of a {doc['role']} ({doc['name']!r}), not of a {role}")
    return Identity(doc["name"], doc["role"], key, operator)
