"""ddp in the simulator: a quorum and an fp32 gradient all-reduce every step, over the clusters present.

Every step waits for the slowest rank of the slowest cluster (the order statistic of all ranks of the
federation), then for the all-reduce. Steps are drawn in blocks of up to `CHUNK` per cluster (a matrix:
steps × clusters, the row maximum is the step); a kill splits a block, the dead cluster is waited for until
its heartbeat expires (or the grace window, whichever is shorter, when the others are more than half of the
heartbeating clusters: torchft's guard against a split brain), the others go on without it, and it
rejoins after its restart by copying the replica from a peer (a heal) and adopting the step.
"""

from __future__ import annotations

import math

import numpy as np

from edit_train.plan import contention
from edit_train.plan.costs import Fed
from edit_train.plan.simbase import BUCKETS, SimOptions, SimResult
from edit_train.plan.spec import Candidate

CHUNK = 256
HORIZON_STEPS = 4096  # a horizon run simulates this many steps of the steady state, then scales


def run_ddp(fed: Fed, cand: Candidate, opt: SimOptions) -> SimResult:
    scn, prof = fed.scenario, fed.profile
    rng = np.random.default_rng(opt.seed)
    n = fed.n
    b = {k: np.zeros(n) for k in BUCKETS}
    trained, nbytes = np.zeros(n), np.zeros(n)
    alive = np.ones(n, dtype=bool)
    back_at = np.full(n, math.inf)
    restarts = np.zeros(n, dtype=int)
    kills = sorted((k for k in opt.kills), key=lambda k: (k[1] if k[1] >= 0 else math.inf, k[2]))
    t = prof.startup_s + prof.eval_s if opt.startup else 0.0
    if opt.startup:
        b["startup"] += prof.startup_s
        b["eval"] += prof.eval_s
    t0, step, events = t, 0, 0
    total = opt.steps or HORIZON_STEPS
    every = scn.eval_every
    while step < total:
        for c in np.nonzero(~alive & (back_at <= t))[0]:  # back from a restart: meet, heal, adopt the step
            alive[c], back_at[c] = True, math.inf
            b["startup"][c] += scn.join_timeout_s
            heal = fed.heal_s(int(c))
            b["blocked"][alive] += heal
            t += heal
        members = np.nonzero(alive)[0]
        k = min(CHUNK, total - step)
        due = [kk for kk in kills if kk[1] >= 0 and kk[1] >= step and restarts[kk[0]] < opt.max_restarts]
        if due:
            k = max(min(k, due[0][1] - step), 0)
        if k > 0 and len(members):
            draws = np.stack([fed.dists[c].sample_max(rng, int(fed.ranks[c]), k) for c in members], axis=1)
            draws += prof.other_step_s
            if scn.host_cores > 0:  # one shared host: the members' steps share its cores (contention.py)
                draws = contention.shared(draws, fed.demand[members], scn.host_cores)
            row = draws.max(axis=1)
            comm, sent = fed.ddp_step_comm(members, cand.compression)
            b["compute"][members] += draws.sum(axis=0)
            b["blocked"][members] += (row[:, None] - draws).sum(axis=0) + k * comm
            trained[members] += k
            nbytes[members] += k * sent
            t += float(row.sum()) + k * comm
            if every > 0:
                evals = (step + k) // every - step // every - int(opt.steps and (step + k) >= total
                                                                  and total % every == 0)
                b["eval"][members] += max(evals, 0) * prof.eval_s
                t += max(evals, 0) * prof.eval_s
            step += k
            events += k
        for kk in list(kills):
            if kk[1] == step and restarts[kk[0]] < opt.max_restarts and alive[kk[0]]:
                c = kk[0]
                kills.remove(kk)
                alive[c] = False
                restarts[c] += 1
                back_at[c] = t + opt.restart_s
                b["down"][c] += opt.restart_s
                # the next quorum waits for it: until its heartbeat expires, or the grace window when the others
                # are more than half of the heartbeating clusters (torchft's guard against a split brain)
                majority = int(alive.sum()) > (int(alive.sum()) + 1) // 2
                wait = min(scn.join_timeout_s, scn.heartbeat_timeout_s) if majority else scn.heartbeat_timeout_s
                b["blocked"][alive] += wait
                t += wait
        if not len(members) and not alive.any():
            t = float(back_at.min())
    if opt.steps:
        b["eval"] += prof.eval_s
        t += prof.eval_s
    useful = b["compute"] + b["sync"]  # ddp commits every step (useful: a step's wall less blocked time)
    res = SimResult(fed.names, t, float(trained @ fed.tokens_per_step), b, trained, nbytes, useful,
                    np.full(n, t), syncs=step, restarts=int(restarts.sum()), events=events,
                    cluster_steps=int(trained.sum()))
    if not opt.steps and t < opt.horizon_s:
        f = (opt.horizon_s - t0) / max(t - t0, 1e-9)
        for key in BUCKETS:
            if key != "startup":
                res.buckets[key] = res.buckets[key] * f
        res.steps, res.bytes, res.useful = trained * f, nbytes * f, useful * f
        res.tokens = float(res.steps @ fed.tokens_per_step)
        res.wall_s = float(opt.horizon_s)
        res.reserved = np.full(n, float(opt.horizon_s))
        res.extrapolated = True
    return res
