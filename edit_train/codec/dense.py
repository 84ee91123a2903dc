"""Compression of pseudo-gradients for the cross-cluster link, and error feedback. Pure tensor math.

Formats (a *payload* is one flat ``uint8`` tensor, the only thing that crosses the link):

* ``none`` — fp32 values, ``4·n`` bytes (sent with a SUM all-reduce, never packed).
* ``bf16`` — bf16 values, ``2·n`` bytes.
* ``int8`` — blockwise absmax: per block of ``block_size`` values (the last block may be partial) a scale
  ``s = absmax / 127`` and values ``round(x / s)`` in [-127, 127]; ``|x − x̂| ≤ absmax / 254`` per block.
* ``fp8`` — blockwise scaled ``float8_e4m3fn``: ``s = absmax / 448``, values ``x / s`` cast (round to
  nearest even; 3 mantissa bits, so ``|x − x̂| ≤ |x|·2⁻⁴`` plus a subnormal floor of ``s·2⁻¹⁰``).
* ``topk`` — sparse: per chunk of ``block_size`` values the ``round(topk_density·block_size)`` largest, each a
  ``bits``-bit code and its index inside the chunk, one scale per chunk (:mod:`edit_train.codec.sparse`
  has the wire format). A sparse payload is gathered and summed by every receiver, never SUM-all-reduced.

Payload layout for the blockwise formats: ``[scales | values]``, scales first so both views are aligned.
``wire_bytes(n, cfg) = n·value_bytes + ceil(n / block_size)·scale_bytes`` (value bytes: 1 for int8/fp8,
2 for bf16, 4 for none; scale bytes: 4 for fp32 scales, 2 for bf16 scales, 0 for none/bf16). Scales stored
in bf16 are rounded *up*, so ``|x / s| ≤ qmax`` still holds and the bound grows by at most 2⁻⁷ relative.

Quantization is deterministic: the same payload dequantizes to the bit-identical fp32 tensor on every
rank. A non-finite value turns its whole block into NaN after the round trip (never silently finite).

:class:`ErrorFeedback` keeps, per key, the residual that quantization dropped from this rank's own
(weighted) contribution; the next contribution is compensated with it, so over many syncs the sum of
what was sent tracks the sum of what was meant (bounded drift instead of a random walk). With
``sync.unsent=keep`` (top-k only) the sync takes the residual out instead (``take_unsent`` of the transport)
and leaves it in the cluster's own parameters, θ ← θ̄_new − e: the next Δ carries it (docs/compression.md).
No ``torch.distributed`` here; the collective lives in :mod:`edit_train.federation.compressed_reduce`.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from edit_train.codec.sparse_format import TOPK_BITS, TOPK_DENSITY, TOPK_GROUP, error_feedback_decay
from edit_train.codec.sparse import (PayloadError, SparseFormat, decode, encode, encode_own, format_error,
                                     sparse_bytes)

__all__ = [
    "SCHEMES",
    "CompressionConfig",
    "ErrorFeedback",
    "fp8_supported",
    "wire_bytes",
    "quantize",
    "dequantize",
    "roundtrip",
    "quantize_blockwise",
    "dequantize_blockwise",
    "PayloadError",
]

log = logging.getLogger(__name__)

SCHEMES = ("none", "bf16", "int8", "fp8", "topk")
SCALE_DTYPES = ("fp32", "bf16")
UNSENT = ("resend", "keep")
_PREFIX = "sync"  # where the keys live in the Hydra tree (for error messages)
_QMAX = {"int8": 127.0, "fp8": 448.0}
_SCALE_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fp8_supported() -> bool:
    """Does this torch build have ``float8_e4m3fn`` with working casts (on CPU)?"""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        return False
    try:
        back = torch.tensor([1.5, -448.0], dtype=torch.float32).to(dtype).view(torch.uint8).view(dtype).float()
    except (RuntimeError, TypeError):
        return False
    return back.tolist() == [1.5, -448.0]


@dataclass
class CompressionConfig:
    """How pseudo-gradients are encoded on the cross-cluster link (``sync.compression`` & co.)."""

    scheme: str = "none"  # sync.compression: none | bf16 | int8 | fp8 | topk
    block_size: int = 256  # sync.block_size: values per scale (int8 / fp8), per chunk (topk)
    scale_dtype: str = "fp32"  # sync.scale_dtype: fp32 | bf16
    error_feedback: bool = True  # sync.error_feedback
    topk_density: float = 0.01  # sync.topk_density: share of each chunk kept (topk)
    bits: int = 2  # sync.bits: bits per kept value (topk): 1, 2, 4 or 8
    unsent: str = "resend"  # sync.unsent (topk): resend (error feedback) | keep (in the cluster's own parameters)
    topk_group: int = 1  # sync.topk_group: values selected together (topk)
    error_feedback_decay: float = 1.0  # sync.error_feedback_decay β: residual ← β·residual before each send

    @staticmethod
    def of(sync: object) -> CompressionConfig:
        """From a ``sync`` config section (``SyncConfig`` or its OmegaConf node)."""
        scheme, feedback = str(getattr(sync, "compression")), getattr(sync, "error_feedback")
        unsent = str(getattr(sync, "unsent", "resend"))
        decay = error_feedback_decay(scheme, feedback, getattr(sync, "error_feedback_decay", None), unsent)
        return CompressionConfig(scheme, getattr(sync, "block_size"), str(getattr(sync, "scale_dtype")), feedback,
                                 getattr(sync, "topk_density", TOPK_DENSITY), getattr(sync, "bits", TOPK_BITS),
                                 unsent, getattr(sync, "topk_group", TOPK_GROUP),
                                 float(decay))

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending key."""
        if self.scheme not in SCHEMES:
            raise ValueError(f"{_PREFIX}.compression must be one of {SCHEMES}, got {self.scheme!r}")
        if self.scheme == "fp8" and not fp8_supported():
            raise ValueError(f"{_PREFIX}.compression=fp8 needs torch.float8_e4m3fn, which this torch build "
                             f"({torch.__version__}) lacks; use int8")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"{_PREFIX}.block_size must be an integer >= 1, got {self.block_size!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"{_PREFIX}.scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"{_PREFIX}.error_feedback must be true or false, got {self.error_feedback!r}")
        if not (isinstance(self.error_feedback_decay, (int, float)) and 0.0 < self.error_feedback_decay <= 1.0):
            raise ValueError(f"{_PREFIX}.error_feedback_decay must be in (0, 1], got {self.error_feedback_decay!r}")
        if self.error_feedback_decay != 1.0 and not self.error_feedback:
            raise ValueError(f"{_PREFIX}.error_feedback_decay < 1 needs {_PREFIX}.error_feedback=true")
        if self.unsent not in UNSENT:
            raise ValueError(f"{_PREFIX}.unsent must be one of {UNSENT}, got {self.unsent!r}")
        if self.unsent == "keep" and not (self.sparse and self.error_feedback):
            raise ValueError(f"{_PREFIX}.unsent=keep needs {_PREFIX}.compression=topk and "
                             f"{_PREFIX}.error_feedback=true (it keeps what top-k left out)")
        if self.sparse:
            self._validate_sparse()

    def _validate_sparse(self) -> None:
        why = format_error(self.topk_density, self.bits, self.block_size, self.topk_group)
        if why is not None:
            raise ValueError(why)

    @property
    def keeps_unsent(self) -> bool:
        return self.unsent == "keep" and self.sparse and self.error_feedback

    @property
    def sparse(self) -> bool:
        return self.scheme == "topk"

    @property
    def format(self) -> SparseFormat:
        """The sparse wire format (``topk``)."""
        return SparseFormat.of(self.block_size, float(self.topk_density), int(self.bits), self.scale_dtype,
                               int(self.topk_group))

    @property
    def blockwise(self) -> bool:
        return self.scheme in _QMAX

    @property
    def lossy(self) -> bool:
        return self.scheme != "none"

    @property
    def payload_error(self) -> float:
        """A bound on how far a SUM of these payloads may lie from the sum of what the clusters handed over,
        relative to the sum of their norms — quantization, the residual error feedback carries between syncs,
        the re-quantized partial sums of `rs_ag` — that the sketched check tolerates (0: exact)."""
        return {"none": 0.0, "bf16": 0.02, "int8": 0.1, "fp8": 0.25}.get(self.scheme, math.inf)

    @property
    def value_bytes(self) -> int:
        return {"none": 4, "bf16": 2, "int8": 1, "fp8": 1, "topk": 0}[self.scheme]

    @property
    def scale_bytes(self) -> int:
        return (4 if self.scale_dtype == "fp32" else 2) if self.blockwise else 0


def wire_bytes(numel: int, cfg: CompressionConfig) -> int:
    """Exact bytes of one payload of ``numel`` values: values + scales (topk: + indices + header)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if cfg.sparse:
        return sparse_bytes(numel, cfg.format)
    blocks = math.ceil(numel / cfg.block_size) if cfg.blockwise else 0
    return numel * cfg.value_bytes + blocks * cfg.scale_bytes


def _round_scale_up(scale: Tensor, scale_dtype: str) -> Tensor:
    """Store the scale in its wire dtype, rounded up so that ``|x| / stored ≤ qmax`` still holds."""
    stored = scale.to(_SCALE_TORCH[scale_dtype])
    if scale_dtype == "bf16":
        low = stored.float() < scale  # positive finite scales only: the next bf16 up is bits + 1
        bumped = (stored.view(torch.int16) + 1).view(torch.bfloat16)
        stored = torch.where(low, bumped, stored)
    return stored


def quantize_blockwise(x: Tensor, scheme: str, block_size: int, scale_dtype: str = "fp32") -> tuple[Tensor, Tensor]:
    """Flat fp32 ``x`` -> (values: int8 or float8_e4m3fn [n], scales: fp32/bf16 [ceil(n/block_size)])."""
    qmax = _QMAX[scheme]
    x = x.reshape(-1).float()
    n = x.numel()
    blocks = math.ceil(n / block_size)
    padded = torch.nn.functional.pad(x, (0, blocks * block_size - n)).view(blocks, block_size)
    absmax = padded.abs().amax(dim=1) if n else padded.new_zeros(0)
    stored = _round_scale_up(absmax / qmax, scale_dtype)
    scale = stored.float()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(1)
    scaled = (padded / safe).clamp(-qmax, qmax)
    if scheme == "int8":
        values = torch.nan_to_num(scaled.round(), nan=0.0).to(torch.int8)
    else:
        values = scaled.to(torch.float8_e4m3fn)
    return values.reshape(-1)[:n], stored


def dequantize_blockwise(values: Tensor, scales: Tensor, block_size: int) -> Tensor:
    """Inverse of :func:`quantize_blockwise` -> flat fp32 (a NaN/inf scale makes its block NaN)."""
    n = values.numel()
    blocks = scales.numel()
    v = torch.nn.functional.pad(values.float(), (0, blocks * block_size - n)).view(blocks, block_size)
    s = scales.float()
    out = v * s.unsqueeze(1)
    bad = ~torch.isfinite(s)
    if bool(bad.any()):
        out[bad] = float("nan")
    return out.reshape(-1)[:n]


def quantize(x: Tensor, cfg: CompressionConfig) -> Tensor:
    """Flat fp32 ``x`` -> one ``uint8`` payload of exactly ``wire_bytes(x.numel(), cfg)`` bytes."""
    x = x.reshape(-1)
    if cfg.scheme == "none":
        return x.float().contiguous().view(torch.uint8)
    if cfg.scheme == "bf16":
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)
    if cfg.sparse:
        return encode(x, cfg.format)
    values, scales = quantize_blockwise(x, cfg.scheme, cfg.block_size, cfg.scale_dtype)
    return torch.cat([scales.contiguous().view(torch.uint8), values.contiguous().view(torch.uint8)])


def dequantize(payload: Tensor, numel: int, cfg: CompressionConfig) -> Tensor:
    """A payload of ``numel`` values (from :func:`quantize`, possibly from another rank) -> flat fp32
    (a sparse payload that does not decode: :class:`PayloadError`, a ``ValueError``)."""
    if cfg.sparse:
        return decode(payload, numel, cfg.format)
    expected = wire_bytes(numel, cfg)
    if payload.dtype != torch.uint8 or payload.numel() != expected:
        raise ValueError(f"payload of {payload.numel()} {payload.dtype} does not hold {numel} values "
                         f"of {cfg.scheme} ({expected} bytes expected)")
    payload = payload.contiguous()
    if payload.storage_offset() % 4:  # a slice of a received buffer: re-align before viewing it as scales
        payload = payload.clone()
    if cfg.scheme == "none":
        return payload.view(torch.float32).clone()
    if cfg.scheme == "bf16":
        return payload.view(torch.bfloat16).float()
    split = wire_bytes(numel, cfg) - numel
    scales = payload[:split].view(_SCALE_TORCH[cfg.scale_dtype])
    vdtype = torch.int8 if cfg.scheme == "int8" else torch.float8_e4m3fn
    values = payload[split:].view(vdtype)
    return dequantize_blockwise(values, scales, cfg.block_size)


def quantize_own(x: Tensor, cfg: CompressionConfig) -> tuple[Tensor, Tensor]:
    """(``quantize(x)``, what every receiver decodes it to): a sparse sender has its own tensor from the codes
    it just made (:func:`~edit_train.codec.sparse.encode_own`, bit-identical to decoding its bytes)."""
    if cfg.sparse:
        return encode_own(x.reshape(-1), cfg.format)
    payload = quantize(x, cfg)
    return payload, dequantize(payload, x.numel(), cfg)


def roundtrip(x: Tensor, cfg: CompressionConfig) -> Tensor:
    """What the receivers see of ``x``: ``dequantize(quantize(x))`` (fp32, flat)."""
    return quantize_own(x, cfg)[1]


class ErrorFeedback:
    """Per-key residuals of lossy sends (thread-safe; one instance per rank).

    ``send = compensate(key, intended)``; after quantizing ``send`` into what receivers will see
    (``sent``), ``update(key, sent, send)`` stores ``send − sent``. The residual is part of the
    checkpoint (:meth:`state_dict`, plain fp32 tensors, safetensors-ready) and is cleared where a cluster
    re-bases on an anchor it did not help build (:meth:`clear`). Keys are the caller's (module / chunk);
    :mod:`compressed_reduce` also stores the chunk-owner's residual of the re-quantized sum under
    ``key + AGG_SUFFIX`` (cleared together with ``key``).
    """

    AGG_SUFFIX = "::agg"

    def __init__(self, decay: float = 1.0) -> None:
        # decay β < 1: error feedback as outer momentum (SparseLoCo, arXiv 2603.08163): the sender sends the
        # compressed e = β·residual + Δ and keeps e − sent, so the residual is a momentum buffer of the
        # pseudo-gradients less what was sent (docs/sync_math.md); the chunk owner's sum residual is not decayed
        self.decay = float(decay)
        self._res: dict[str, Tensor] = {}
        self._mark: dict[str, Tensor] | None = None
        self._lock = threading.RLock()
        self._gen = 0  # bumped whenever the residuals are replaced wholesale (restore, clear(), load)

    def pinned(self) -> ErrorFeedback:
        """A view for one sync's sends: its writes are dropped once these residuals were replaced wholesale
        (:meth:`restore` after a rollback, :meth:`clear`, :meth:`load_state_dict`), so a send still in flight
        on a background thread cannot bring back what a rollback undid."""
        return _Pinned(self, self._gen)

    def _put(self, key: str, res: Tensor) -> None:
        with self._lock:
            self._res[key] = res

    def residual(self, key: str) -> Tensor | None:
        with self._lock:
            return self._res.get(key)

    def compensate(self, key: str, x: Tensor) -> Tensor:
        """``x + β·residual`` (a new tensor; ``x`` itself when there is no residual for ``key``)."""
        r = self.residual(key)
        if r is None:
            return x
        if r.shape != x.shape:
            raise ValueError(f"error-feedback residual {key!r} has shape {tuple(r.shape)} but the tensor has "
                             f"{tuple(x.shape)}: clear the residuals when the chunking changes")
        r = r.to(device=x.device, dtype=x.dtype)
        return x + (r if self.decay == 1.0 or key.endswith(self.AGG_SUFFIX) else self.decay * r)

    def update(self, key: str, sent: Tensor, intended: Tensor) -> None:
        """Remember ``intended − sent``; a non-finite residual is dropped (that send was anomalous)."""
        res = (intended.float() - sent.float()).detach()
        if not bool(torch.isfinite(res).all()):
            log.warning("error feedback: non-finite residual for %s dropped", key)
            res = torch.zeros_like(res)
        self._put(key, res)

    def set_residual(self, key: str, res: Tensor) -> None:
        self._put(key, res)

    def clear(self, key: str | None = None) -> None:
        """Forget every residual (``key=None``) or those of ``key`` (its chunk-owner residual too)."""
        with self._lock:
            if key is None:
                self._res.clear()
                self._mark, self._gen = None, self._gen + 1
            else:
                for held in (self._res, self._mark or {}):
                    held.pop(key, None)
                    held.pop(key + self.AGG_SUFFIX, None)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._res)

    def mark(self) -> None:
        """Remember the residuals as they are (a sync starts); :meth:`restore` goes back to them."""
        with self._lock:
            self._mark = dict(self._res)  # residuals are replaced, never changed in place: a shallow copy

    def restore(self) -> None:
        """Back to the last :meth:`mark` (a sync rolled back: what it sent was never applied, so the debt is
        what it was; keeping the new residual would send the dropped part of that Δ twice)."""
        with self._lock:
            if self._mark is not None:
                self._res = dict(self._mark)
            self._gen += 1

    def state_dict(self) -> dict[str, Tensor]:
        """``{key: fp32 CPU tensor}`` — plain tensors, safe to write with safetensors."""
        with self._lock:
            return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in self._res.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Replace all residuals with ``state`` (e.g. from a checkpoint or a healing peer)."""
        loaded: dict[str, Tensor] = {}
        for k, v in state.items():
            if not isinstance(v, Tensor) or not v.is_floating_point():
                raise ValueError(f"error-feedback state {k!r} must be a floating-point tensor, got {type(v).__name__}")
            loaded[k] = v.detach().to(torch.float32).clone()
        with self._lock:
            self._res, self._mark, self._gen = loaded, None, self._gen + 1


class _Pinned(ErrorFeedback):
    """:meth:`ErrorFeedback.pinned`: reads go to the owner; writes only while its generation is unchanged."""

    def __init__(self, owner: ErrorFeedback, gen: int) -> None:  # no residuals of its own
        self._owner, self._at, self.decay = owner, gen, owner.decay

    def residual(self, key: str) -> Tensor | None:
        return self._owner.residual(key)

    def _put(self, key: str, res: Tensor) -> None:
        with self._owner._lock:
            if self._owner._gen == self._at:
                self._owner._res[key] = res

    def clear(self, key: str | None = None) -> None:
        with self._owner._lock:
            if self._owner._gen == self._at:
                self._owner.clear(key)

    def keys(self) -> list[str]:
        return self._owner.keys()

    def state_dict(self) -> dict[str, Tensor]:
        return self._owner.state_dict()

    def pinned(self) -> ErrorFeedback:
        return self

    def mark(self) -> None:
        raise TypeError("mark/restore/load the ErrorFeedback itself, not a pinned view of it")

    restore = mark

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.mark()
