"""Clusters that share one host's cores (the local launcher: every rank a process with one thread): how long
their compute takes when more of them want a core than there are.

Processor sharing, as the kernel's scheduler gives it over a step's time scale: while the processes that want
the CPU demand D cores of C, each runs at min(1, C / D) of its speed. A rank slowed down s× (it sleeps s − 1
times its compute after every step) wants a core 1/s of the time, so it demands 1/s; a cluster blocked at a
sync sleeps and demands nothing — so when the fast clusters of a federation finish their interval and wait,
the slow one gets the cores they freed, and while a cluster is down the others run faster. Clusters that
start an interval together (every member of a quorum, right after the sync) share the cores as they go; the
intervals of others already under way (`ghosts`) take their share until they end.
"""

from __future__ import annotations

import numpy as np


def shared(d: np.ndarray, q: np.ndarray, cores: float, ghost_end: np.ndarray | None = None,
           ghost_q: np.ndarray | None = None) -> np.ndarray:
    """Wall seconds of work that takes `d` [rows, n] seconds alone, the n processes of a row starting together
    and wanting `q` [n] cores while they run, on `cores` cores; `ghost_end` / `ghost_q` [g]: others that keep
    wanting `ghost_q` cores until `ghost_end` seconds from now (their own times are not changed)."""
    d = np.atleast_2d(np.asarray(d, dtype=float))
    q = np.broadcast_to(np.asarray(q, dtype=float), d.shape[-1:])
    ge = np.asarray(ghost_end if ghost_end is not None else [], dtype=float)
    gq = np.asarray(ghost_q if ghost_q is not None else [], dtype=float)
    left, end = d.copy(), np.zeros_like(d)
    active = left > 0
    t = np.zeros(d.shape[0])
    while active.any():
        demand = (active * q).sum(axis=1) + ((ge[None, :] > t[:, None]) * gq).sum(axis=1)
        slow = np.maximum(1.0, demand / cores)  # seconds of wall per second of own work
        finish = np.where(active, left * slow[:, None], np.inf).min(axis=1)
        ghost = np.where(ge[None, :] > t[:, None], ge[None, :] - t[:, None], np.inf).min(axis=1, initial=np.inf)
        dt = np.minimum(finish, ghost)
        dt = np.where(np.isfinite(dt), dt, 0.0)
        left = np.where(active, left - (dt / slow)[:, None], left)
        t = t + dt
        done = active & (left <= 1e-12 * np.maximum(d, 1.0))
        end = np.where(done, t[:, None], end)
        active &= ~done
    return end
