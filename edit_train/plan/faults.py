"""Failures over a long horizon: a `heapq` timeline of interruptions and restarts laid over a candidate's
failure-free steady state (`sim.py` / `simddp.py`).

Each cluster is interrupted as a Poisson process of rate `ranks / mtbf_h_per_accelerator + 1 /
mtbf_h_per_cluster` (per hour), plus any scheduled `kills` with `at_s`. An interruption costs, as edit-train
handles it (docs/architecture.md §3, "What happens when…"):

* the cluster itself: the compute no sync had committed (uniform over its sync period: `interval` steps,
  τ for A-EDiT, one step for ddp), `restart_s` down, the grace window on its way back (it meets the others
  mid-interval), a heal transfer (anchor + outer momentum) at its next joint sync;
* the others: a blocking quorum (ddp, step schedules, A-EDiT without overlap) waits for the dead cluster
  until its heartbeat expires or the grace window ends; a sync in flight when it dies is rolled back on every
  survivor (the chance of that is the sync's share of the period; what it wasted is redone);
* while it is down its tokens are not trained (a step schedule adopts the step when it returns).

Two clusters down at once are handled event by event (the timeline is simulated, not summed), but the
survivors' speed is the failure-free one: a synchronous algorithm does not speed up when its slowest
cluster is the one that died (conservative).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import numpy as np

from edit_train.plan.costs import Fed
from edit_train.plan.simbase import SimResult
from edit_train.plan.spec import Candidate, FailurePlan


@dataclass
class FailureStats:
    interruptions: int = 0
    lost_tokens: float = 0.0
    lost_useful_s: float = 0.0
    extra_blocked_s: float = 0.0
    down_s: float = 0.0


def rates_per_s(fed: Fed, plan: FailurePlan) -> np.ndarray:
    per_h = np.zeros(fed.n)
    if plan.mtbf_h_per_accelerator > 0:
        per_h += fed.ranks / plan.mtbf_h_per_accelerator
    if plan.mtbf_h_per_cluster > 0:
        per_h += 1.0 / plan.mtbf_h_per_cluster
    return per_h / 3600.0


def apply(fed: Fed, cand: Candidate, res: SimResult, plan: FailurePlan, horizon_s: float,
          seed: int = 0) -> tuple[SimResult, FailureStats]:
    """`res` (failure-free, over `horizon_s`) with the failure timeline's costs taken off."""
    lam = rates_per_s(fed, plan)
    kills = [(fed.names.index(str(k["cluster"])) if str(k["cluster"]) in fed.names else int(k["cluster"]),
              float(k["at_s"])) for k in plan.kills if "at_s" in k]
    stats = FailureStats()
    if not lam.any() and not kills:
        return res, stats
    rng = np.random.default_rng(seed + 7919)
    wall = max(res.wall_s, 1e-9)
    tokens_rate = res.steps * fed.tokens_per_step / wall  # per cluster, failure-free
    compute_rate = res.buckets["compute"] / wall
    period = _period(fed, cand)
    sync_share = np.clip(res.buckets["blocked"] / wall, 0.0, 1.0)
    blocking = not cand.local_sgd or not (cand.timed and cand.mode == "overlap")
    wait = min(fed.scenario.join_timeout_s, fed.scenario.heartbeat_timeout_s)
    heap: list[tuple[float, int, int]] = []
    for c in range(fed.n):
        if lam[c] > 0:
            heapq.heappush(heap, (float(rng.exponential(1 / lam[c])), 0, c))
    for c, at in kills:
        heapq.heappush(heap, (at, 0, c))
    down_until = np.zeros(fed.n)
    lost_tokens, lost_useful, blocked, down = np.zeros(fed.n), np.zeros(fed.n), np.zeros(fed.n), np.zeros(fed.n)
    while heap:
        t, kind, c = heapq.heappop(heap)
        if t >= horizon_s:
            continue
        if kind == 0:
            if t < down_until[c]:
                continue  # already down
            stats.interruptions += 1
            gone = float(rng.uniform(0, period[c]))  # uncommitted work since the last sync
            out = min(fed.scenario.join_timeout_s + plan.restart_s, horizon_s - t)
            down_until[c] = t + out
            down[c] += out
            lost_tokens[c] += tokens_rate[c] * (out + gone)
            lost_useful[c] += compute_rate[c] * (out + gone)
            blocked[c] += fed.heal_s(c)
            others = np.arange(fed.n) != c
            if blocking:
                blocked[others] += wait
                lost_tokens[others] += tokens_rate[others] * wait
                lost_useful[others] += compute_rate[others] * wait
            if rng.random() < float(sync_share[others].mean()) if others.any() else False:
                redo = float(np.median(res.round_s)) * float(sync_share[others].mean()) if res.round_s else 0.0
                blocked[others] += redo
            if lam[c] > 0:
                heapq.heappush(heap, (t + out + float(rng.exponential(1 / lam[c])), 0, c))
    out = replace(res)
    out.buckets = {k: v.copy() for k, v in res.buckets.items()}
    out.steps = res.steps - lost_tokens / np.maximum(fed.tokens_per_step, 1)
    out.tokens = float(max(res.tokens - lost_tokens.sum(), 0.0))
    out.useful = np.maximum(res.useful - lost_useful, 0.0)
    out.buckets["blocked"] = res.buckets["blocked"] + blocked
    out.buckets["down"] = res.buckets["down"] + down
    out.bytes = res.bytes * (1 - lost_tokens / np.maximum(res.steps * fed.tokens_per_step, 1e-9))
    out.restarts = res.restarts + stats.interruptions
    stats.lost_tokens, stats.lost_useful_s = float(lost_tokens.sum()), float(lost_useful.sum())
    stats.extra_blocked_s, stats.down_s = float(blocked.sum()), float(down.sum())
    return out, stats


def _period(fed: Fed, cand: Candidate) -> np.ndarray:
    """Seconds of compute between two commits, per cluster."""
    if not cand.local_sgd:
        return fed.mean_step.copy()
    if cand.timed:
        return np.full(fed.n, cand.sync_time_s)
    return cand.interval * fed.mean_step
