"""Healing payloads: what a live cluster sends a restarted, late or returning one.

The payload is `8-byte little-endian length ‖ JSON metadata ‖ safetensors bytes` (metadata: an object of
at most `MAX_HEADER` bytes nested at most `MAX_DEPTH` deep, checked before it is parsed). Decoding never
unpickles: safetensors parses a JSON header and raw buffers, and anything else is refused with one line.
(torchft's own checkpoint transports unpickle what a peer sends — HTTP with `weights_only=False`, the PG
transport unpickles the bytes it receives — which would let any peer run code on every cluster; we do not use them.)
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from torch import Tensor

from edit_train import safejson
from edit_train.local_sgd.errors import HealError

MAGIC = "edit-train-heal"
VERSION = 1
MAX_HEADER = 1 << 20  # the JSON metadata: a few hundred bytes in practice
MAX_DEPTH = safejson.MAX_DEPTH  # its nesting (a user rule's state is the deepest part, a few levels)

def encode(meta: dict[str, Any], tensors: dict[str, Tensor]) -> bytes:
    from safetensors.torch import save

    head = json.dumps({"kind": MAGIC, "version": VERSION, **meta}).encode()
    body = save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}) if tensors else b""
    return struct.pack("<Q", len(head)) + head + body


def decode(payload: bytes, peer: str = "peer") -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Parse a payload; raise `HealError` (one line naming the peer) for anything that is not a healing payload.

    Total: the header length is checked against `MAX_HEADER` and the payload before anything is sliced, the
    header's nesting depth before it is parsed (`safejson`), and any other failure of any input is a HealError.
    The payload's own length was capped by the transport before it was received."""
    try:
        return _decode(payload, peer)
    except HealError:
        raise
    except Exception as exc:  # noqa: BLE001 - a backstop: no input may escape as another error
        raise HealError(f"healing payload from {peer}: malformed ({_why(exc)}): refused") from None


def _why(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _framed(payload: bytes) -> bool:
    """Does `payload` start like one of ours: a header length that fits, then a JSON object?"""
    if len(payload) < 9:
        return False
    (n,) = struct.unpack("<Q", payload[:8])
    return 0 < n <= min(MAX_HEADER, len(payload) - 8) and payload[8] == ord("{")


def _decode(payload: bytes, peer: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    if not isinstance(payload, bytes):
        payload = bytes(payload)  # a bytearray / memoryview from a transport (bytes are not copied)
    # a pickle starts with PROTO 2..5; one of ours can too (a header of 640 bytes: 80 02 00 ...), so only
    # what does not also frame like ours is called a pickle (neither is ever unpickled)
    if len(payload) >= 2 and payload[0] == 0x80 and 2 <= payload[1] <= 5 and not _framed(payload):
        raise HealError(f"healing payload from {peer} is a Python pickle: refused, nothing was unpickled "
                        "(edit-train peers send safetensors + JSON; is that peer running foreign code?)")
    if len(payload) < 8:
        raise HealError(f"healing payload from {peer} is truncated ({len(payload)} bytes)")
    (n,) = struct.unpack("<Q", payload[:8])
    if n > MAX_HEADER:
        raise HealError(f"healing payload from {peer}: header length {n} exceeds {MAX_HEADER} bytes: refused")
    if n > len(payload) - 8:
        raise HealError(f"healing payload from {peer} is not an edit-train payload (bad header length)")
    try:
        meta = safejson.loads(payload[8:8 + n], MAX_HEADER, MAX_DEPTH)
    except ValueError as exc:
        raise HealError(f"healing payload from {peer} has no JSON metadata ({_why(exc)}): refused") from None
    version = meta.get("version") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("kind") != MAGIC or type(version) is not int or version != VERSION:
        raise HealError(f"healing payload from {peer} is not an edit-train v{VERSION} payload: refused")
    body = payload[8 + n:]
    if not body:
        return meta, {}
    from safetensors.torch import load

    try:
        tensors = load(body)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise HealError(f"healing payload from {peer}: tensors are not valid safetensors ({_why(exc)})") from None
    return meta, tensors
