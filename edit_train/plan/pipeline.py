"""A sync's units on their way across the link, as edit-train moves them (`local_sgd/sync/drivers.py`,
`federation/modules.py`, `federation/link.py`).

* **One unit at a time, the next one prefetched.** The blocking modes (layer-wise and at_end alike: at_end is
  `BlockingDriver.flush`, the layer-wise hooks called in a row) launch unit u and u + 1, wait for u to land
  from every participant, apply it (clip, outer step, re-base: the `sync` bucket, on the training thread), then
  move on; layer-wise runs unit u's share of the forward in between. Overlap launches every unit at once.
* **Two clocks per transfer.** A launched unit's software work — tags, the codec, the gloo collective — runs on
  its lane's own thread, one unit after another (`BackgroundReducer`); edit-train's *simulated* link queues the
  unit's bytes on the rank's link clock at the launch (`LinkClock.account`: latency + bytes / bandwidth) and
  `Pending.wait` returns when *both* are done. So on the simulated link a unit lands at
  max(link queue + latency, software queue): work shorter than the link hides behind it. On a *real* link the
  bytes are the collective's own: work and wire add up in one queue, then the latency.
* **A collective lands when its slowest participant's part has** (the maximum over the members).

Arrays are `[..., members, units]` (leading axes batch independent cases: the calibration's grid of costs).
"""

from __future__ import annotations

import numpy as np


def _launch(wire: np.ndarray, work: np.ndarray, at: np.ndarray, free_l: np.ndarray, free_w: np.ndarray,
            lat: float, simulated: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One unit launched at `at` on both queues: (its ready time per member, link queue free, work queue free)."""
    if simulated:
        free_l = np.maximum(at, free_l) + wire
        free_w = np.maximum(at, free_w) + work
        return np.maximum(free_l + lat, free_w), free_l, free_w
    free_w = np.maximum(at, free_w) + work + wire
    return free_w + lat, free_l, free_w


def blocking(wire: np.ndarray, work: np.ndarray, lat: float, between: np.ndarray, simulated: bool,
             prefetch: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(seconds each member waits, seconds each member takes) for the units of one blocking sync:
    `wire`, `work` — link and software seconds of each unit; `between` — the training thread's own seconds
    after a unit landed (its apply, and under layer-wise the next unit's forward)."""
    wire, work, between = np.broadcast_arrays(np.asarray(wire, float), np.asarray(work, float),
                                              np.asarray(between, float))
    units = wire.shape[-1]
    shape = wire.shape[:-1]
    now, waited = np.zeros(shape), np.zeros(shape)
    free_l, free_w = np.zeros(shape), np.zeros(shape)
    ready = np.zeros(wire.shape)
    launched = 0

    def launch(u: int) -> None:
        nonlocal free_l, free_w, launched
        ready[..., u], free_l, free_w = _launch(wire[..., u], work[..., u], now, free_l, free_w, lat, simulated)
        launched = u + 1

    for u in range(units):
        if launched <= u:
            launch(u)
        if prefetch and u + 1 < units and launched <= u + 1:
            launch(u + 1)
        landed = ready[..., u].max(axis=-1, keepdims=True)  # from every participant
        wait = np.maximum(landed - now, 0.0)
        waited += wait
        now = now + wait + between[..., u]
    return waited, now


def at_once(wire: np.ndarray, work: np.ndarray, lat: float, simulated: bool) -> np.ndarray:
    """Seconds until every unit launched at once (overlap) has landed everywhere (the same for every member)."""
    wire, work = np.asarray(wire, float), np.asarray(work, float)
    if simulated:
        mine = np.maximum(wire.sum(axis=-1) + lat, work.sum(axis=-1))
    else:
        mine = (wire + work).sum(axis=-1) + lat
    return np.broadcast_to(mine.max(axis=-1, keepdims=True), mine.shape)


def small(lat: float, work: float, simulated: bool) -> float:
    """A small all-gather (the norm exchange, the vote): its latency and its software, as above."""
    return max(lat, work) if simulated else lat + work
