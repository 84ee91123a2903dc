"""The sync's software cost, fitted from runs: each blocking sync's measured wait (the smaller of the
participants' `blocked_s`: the other one also waited for the slower cluster) against what the simulator
charges for it (`pipeline.py`: the norm exchange and the vote, each an op, around the units moved one at a
time with the next prefetched, each unit's software `per_op_s + bytes / sw_bytes_per_s` + the codec's timed
cost beside the run's link, its apply — the run's own `sync` bucket per sync, by parameters — and under
layer-wise its forward between). Least squares over a grid of the two costs (the model is not linear in them:
work that the link or the apply covers costs nothing), so what is fitted is exactly what the simulator uses.
Needs at least two message sizes; a run on a fast or no simulated link shows the software best.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from edit_train.plan import pipeline

PER_OP = np.concatenate([[0.0], np.logspace(-5, -1, 61)])  # seconds per op
PER_BYTE = np.concatenate([[0.0], np.logspace(-12, -7, 76)])  # seconds per byte


@dataclass
class SyncSample:
    """One blocking sync of one run, as the simulator would see it (arrays over the sync's units)."""

    nbytes: np.ndarray  # this cluster's bytes of each unit
    wire: np.ndarray  # seconds each unit's bytes take on the run's simulated link (0: none)
    codec: np.ndarray  # the codec's timed seconds for each unit
    between: np.ndarray  # the training thread's seconds after each unit (apply, + forward under layer-wise)
    lat: float
    simulated: bool
    blocked_s: float  # measured


def predict(samples: list[SyncSample], per_op: np.ndarray, per_byte: np.ndarray) -> np.ndarray:
    """[len(per_op), len(samples)]: each sample's modelled wait for every (per_op, per_byte) pair given."""
    per_op, per_byte = np.asarray(per_op, float)[:, None, None], np.asarray(per_byte, float)[:, None, None]
    out = []
    for s in samples:
        work = per_op + s.nbytes[None, None, :] * per_byte + s.codec[None, None, :]
        waited, _ = pipeline.blocking(s.wire[None, None, :], work, s.lat, s.between[None, None, :], s.simulated)
        small = np.maximum(s.lat, per_op[:, 0, 0]) if s.simulated else s.lat + per_op[:, 0, 0]
        out.append(waited[:, 0] + 2 * small)
    return np.stack(out, axis=1)


def fit(samples: list[SyncSample]) -> tuple[float, float, dict[str, Any]]:
    """(per_op_s, seconds per byte, fit record) minimising the squared error over the grid."""
    ops, bytes_ = np.meshgrid(PER_OP, PER_BYTE, indexing="ij")
    ops, bytes_ = ops.ravel(), bytes_.ravel()
    y = np.array([s.blocked_s for s in samples])
    pred = predict(samples, ops, bytes_)
    err = ((pred - y[None, :]) ** 2).mean(axis=1)
    best = int(np.argmin(err))
    flat = err <= err[best] * 1.05 + 1e-12  # the costs the data cannot tell apart from the best
    per_op, per_byte, mse = _refine(samples, y, float(ops[best]), float(bytes_[best]), float(err[best]))
    return per_op, per_byte, {"samples": len(samples), "per_op_s": per_op, "seconds_per_byte": per_byte,
                              "rms_residual_s": float(np.sqrt(mse)),
                              "per_op_range_s": [float(ops[flat].min()), float(ops[flat].max())],
                              "seconds_per_byte_range": [float(bytes_[flat].min()), float(bytes_[flat].max())]}


def _refine(samples: list[SyncSample], y: np.ndarray, per_op: float, per_byte: float,
            mse: float) -> tuple[float, float, float]:
    """A pattern search in log space from the grid's best (a cost at 0 stays 0): steps of a grid cell, halved
    until a thousandth of one."""
    logs = [np.log10(per_op) if per_op > 0 else None, np.log10(per_byte) if per_byte > 0 else None]
    step = 4.0 / 60
    while step > 1e-3 * 4.0 / 60:
        moved = False
        for i in (0, 1):
            if logs[i] is None:
                continue
            for d in (-step, step):
                trial = list(logs)
                trial[i] = logs[i] + d
                a, b = (10.0 ** v if v is not None else 0.0 for v in trial)
                e = float(((predict(samples, [a], [b])[0] - y) ** 2).mean())
                if e < mse:
                    logs, mse, moved = trial, e, True
        if not moved:
            step /= 2
    a, b = (10.0 ** v if v is not None else 0.0 for v in logs)
    return a, b, mse
