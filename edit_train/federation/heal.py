"""Healing payloads: what a live cluster sends a restarted, late or returning one.

The payload is `8-byte little-endian length ‖ JSON metadata ‖ safetensors bytes`. Decoding never
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

from edit_train.local_sgd.errors import HealError

MAGIC = "edit-train-heal"
VERSION = 1

def encode(meta: dict[str, Any], tensors: dict[str, Tensor]) -> bytes:
    from safetensors.torch import save

    head = json.dumps({"kind": MAGIC, "version": VERSION, **meta}).encode()
    body = save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}) if tensors else b""
    return struct.pack("<Q", len(head)) + head + body


def decode(payload: bytes, peer: str = "peer") -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Parse a payload; raise `HealError` naming the peer for anything that is not a healing payload."""
    if len(payload) >= 2 and payload[0] == 0x80 and 2 <= payload[1] <= 5:
        raise HealError(f"healing payload from {peer} is a Python pickle: refused, nothing was unpickled "
                        "(edit-train peers send safetensors + JSON; is that peer running foreign code?)")
    if len(payload) < 8:
        raise HealError(f"healing payload from {peer} is truncated ({len(payload)} bytes)")
    (n,) = struct.unpack("<Q", payload[:8])
    if n > len(payload) - 8:
        raise HealError(f"healing payload from {peer} is not an edit-train payload (bad header length)")
    try:
        meta = json.loads(payload[8:8 + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HealError(f"healing payload from {peer} has no JSON metadata: refused") from None
    if not isinstance(meta, dict) or meta.get("kind") != MAGIC or meta.get("version") != VERSION:
        raise HealError(f"healing payload from {peer} is not an edit-train v{VERSION} payload: refused")
    body = payload[8 + n:]
    if not body:
        return meta, {}
    from safetensors.torch import load

    try:
        tensors = load(bytes(body))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise HealError(f"healing payload from {peer}: tensors are not valid safetensors ({exc})") from None
    return meta, tensors
