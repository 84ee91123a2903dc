"""Tags on what one quorum's lanes carry: every row of a small exchange, every piece of a gathered
contribution and every heal payload is followed by its tag (auth.seal_tag: Poly1305 under a one-time key
derived with HMAC-SHA256), bound to the quorum's
nonce (fresh per quorum, issued by the gate), to the sender's position and to a sequence number of the
operation (every member issues the same operations in the same order), so a message cannot be altered,
replayed into another quorum or passed off as another member's. A plain SUM all-reduce mixes the
contributions on the way and cannot be authenticated this way; docs/architecture.md says what that needs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from edit_train.federation import auth

TAG = auth.SEAL_TAG_BYTES


class Seal:
    def __init__(self, key: bytes, nonce: str) -> None:
        self.key, self.nonce, self.seq = key, nonce, 0

    def context(self, what: str) -> str:
        """The context of the next operation (call once per operation, on every member)."""
        self.seq += 1
        return f"{self.nonce}/{self.seq}/{what}"

    def tag(self, context: str, sender: int, data: bytes | memoryview) -> bytes:
        return auth.seal_tag(self.key, context, str(sender).encode(), data)

    def ok(self, context: str, sender: int, data: bytes | memoryview, mac: bytes) -> bool:
        return auth.seal_valid(self.key, context, str(sender).encode(), data, mac)

    # ------------------------------------------------------------ tensors
    def wrap(self, t: Tensor, context: str, sender: int) -> Tensor:
        """`t` (flat, contiguous, CPU) followed by its tag, in `t`'s dtype (the tag's raw bytes)."""
        t = t.detach().contiguous()
        out = torch.empty(t.numel() + TAG // t.element_size(), dtype=t.dtype)
        out[:t.numel()].copy_(t)
        raw = out.view(torch.uint8)
        mac = self.tag(context, sender, _bytes(raw[:-TAG]))  # hashed in place (no copy)
        raw[-TAG:].copy_(torch.frombuffer(bytearray(mac), dtype=torch.uint8))
        return out

    def unwrap(self, got: Tensor, context: str, sender: int) -> Tensor | None:
        """The payload of a wrapped tensor from `sender`, or None when its tag does not verify."""
        got = got.contiguous()
        raw = got.view(torch.uint8)
        if not self.ok(context, sender, _bytes(raw[:-TAG]), bytes(_bytes(raw[-TAG:]))):
            return None
        return got[:-(TAG // got.element_size())]


def _bytes(t: Tensor) -> memoryview:
    """A uint8 CPU tensor's bytes, without copying them (hashlib reads the buffer directly)."""
    return memoryview(t.numpy()).cast("B")
