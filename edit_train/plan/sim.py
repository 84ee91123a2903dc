"""The event-level simulator at cluster-step granularity: local SGD (post_local_sgd, diloco, edit, a_edit)
here, ddp step by step in `simddp.py`, failures over long horizons in `faults.py`.

**A `heapq` event loop, not SimPy.** A federation's events are few: a cluster reaches its sync point (asks
the Lighthouse), the grace window of a forming quorum ends, a dead cluster's heartbeat expires, the quorum is
issued, a cluster dies or comes back. Between two of its sync points a cluster's steps interact with nobody,
so they are drawn in one go (each step the slowest of the cluster's ranks, `dist.py`) and the next event is
its next ask; an issued quorum's members are handled together as numpy vectors (`_sync`). That keeps the
per-event cost at a few microseconds, which a 64-cluster, 150-candidate plan needs on one core; SimPy (not
installed here; pure Python, MIT) would run the same events as generator processes at several times the
cost per event and add a dependency for nothing the ~40 lines of loop below do not already express.

Semantics followed (docs/architecture.md §3–4, `local_sgd/sync/pacer.py`, `drivers.py`, `membership.py`):
* a quorum is issued as torchft's Lighthouse issues it (`_check`): at once when the previous quorum's members
  all asked again; else with at least `min_clusters` and more than half of the heartbeating clusters, when all
  of them asked or `join_timeout_s` after the first ask; a dead cluster heartbeats until
  `heartbeat_timeout_s` after its death;
* step schedules sync every `interval` steps with a blocking quorum and the lockstep step adoption (whoever
  is behind jumps to the federation's step); A-EDiT plans `H = ⌊τ / own s/step⌋` from its last interval (the
  first ends once τ is spent); with `overlap` its quorum forms in the background: it keeps stepping and the
  sync starts at the first step boundary after the issue; an overlapped round in flight is flushed (waited
  for) at the next sync point;
* a killed cluster loses the compute no sync committed, is back `restart_s` later, meets (the grace window),
  trains from scratch and heals + adopts the step at its next joint sync;
* a fixed run ends at `steps` (step schedules: each cluster; A-EDiT: everyone at the first sync at which
  any has reached it — the one that reaches it syncs right there), the last sync blocking, then the final
  eval. A horizon run stops simulating once the throughput has converged and scales the steady state to the
  horizon (`extrapolated`).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from edit_train.codec import compiled
from edit_train.codec.sparse_format import SparseFormat
from edit_train.plan import contention
from edit_train.plan.costs import Fed
from edit_train.plan.simbase import BUCKETS, SimOptions, SimResult
from edit_train.plan.spec import Candidate

ASK, TIMEOUT, EXPIRE, DEATH, REVIVE = range(5)


class _State:
    """Per-cluster vectors of a run in progress, and the event queue."""

    def __init__(self, fed: Fed, opt: SimOptions, cand: Candidate) -> None:
        n = fed.n
        self.fed, self.opt, self.cand = fed, opt, cand
        self.rng = np.random.default_rng(opt.seed)
        self.b = {k: np.zeros(n) for k in BUCKETS}
        self.t = np.zeros(n)  # each cluster's clock (the end of what has been scheduled for it)
        self.steps = np.zeros(n)  # the step counter (adoption moves it)
        self.trained = np.zeros(n)
        self.uncommitted = np.zeros(n)
        self.useful = np.zeros(n)
        self.bytes = np.zeros(n)
        self.alive = np.ones(n, dtype=bool)
        self.done = np.zeros(n, dtype=bool)
        self.dead_at = np.full(n, -math.inf)
        self.behind = np.zeros(n, dtype=bool)
        self.pending = np.full(n, -math.inf)  # overlap: when the round in flight lands
        self.busy_until = np.full(n, -math.inf)  # when each cluster's compute scheduled so far ends
        self.step_s = fed.mean_step.copy()  # each cluster's seconds per step in its last interval
        self.restarts = np.zeros(n, dtype=int)
        self.planned = np.full(n, max(cand.interval, 1))
        if cand.timed:
            self.planned = np.ceil(cand.sync_time_s / fed.mean_step).astype(int).clip(1)
        self.kills = list(opt.kills)
        self.asking: dict[int, float] = {}
        self.prev: set[int] = set()  # the members of the last quorum issued
        self.qid = 0
        self.stopping = False
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = self.events = self.missed = 0
        self.issues: list[tuple[float, float]] = []  # (time, tokens so far)
        self.checked = -1
        self.steps_simulated = 0  # cluster-steps drawn (each the slowest of the cluster's ranks)

    def push(self, t: float, kind: int, c: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, c))

    def spend(self, bucket: str, idx: np.ndarray, seconds: np.ndarray | float) -> None:
        self.b[bucket][idx] += seconds
        self.t[idx] += seconds

    def live(self, now: float) -> np.ndarray:
        return ~self.done & (self.alive | (self.dead_at + self.fed.scenario.heartbeat_timeout_s > now))


def compile_wall(fed: Fed, cand: Candidate) -> np.ndarray | float:
    """Start-up seconds each cluster spends compiling the top-k kernels of a format this host has not compiled
    yet (`scenario.compiled`, else this host's record: `codec/compiled.py`): every rank compiles at once, `profile.codec_compile_s` CPU seconds each, sharing
    a shared host's cores (contention.py); 0 for any other compression, a compiled format or no numba."""
    codec = cand.codec(fed.scenario)
    cost = fed.profile.codec_compile_s
    if not codec.sparse or cost <= 0 or not compiled.available():
        return 0.0
    f = SparseFormat.of(codec.block_size, codec.density, codec.bits, codec.scale_dtype, codec.group)
    done = fed.scenario.compiled if fed.scenario.compiled is not None else compiled.compiled()
    if compiled.key(f) in done:
        return 0.0
    if fed.scenario.host_cores <= 0:
        return cost
    return contention.shared(np.full((1, fed.n), cost), fed.ranks.astype(float), fed.scenario.host_cores)[0]


def run_local(fed: Fed, cand: Candidate, opt: SimOptions) -> SimResult:
    """Simulate one local-SGD candidate on a resolved federation."""
    s = _State(fed, opt, cand)
    every = np.arange(fed.n)
    if opt.startup:
        s.spend("startup", every, fed.profile.startup_s + compile_wall(fed, cand))
        s.spend("eval", every, fed.profile.eval_s)  # the step-0 evaluation
    t_start = s.t.copy()
    base = {**{k: v.copy() for k, v in s.b.items()}, "trained": s.trained.copy(), "useful": s.useful.copy(),
            "bytes": s.bytes.copy()}
    _start_intervals(s, every)
    while s.heap:
        t, _, kind, c = heapq.heappop(s.heap)
        s.events += 1
        if kind == ASK:
            _ask(s, c, t)
        elif kind == TIMEOUT and c == s.qid:
            _check(s, t)
        elif kind == EXPIRE:
            _check(s, t)
        elif kind == DEATH:
            _death(s, c, t)
        elif kind == REVIVE:
            _revive(s, c, t)
        if not opt.steps and len(s.issues) != s.checked and _converged(s, t):
            break
    if opt.steps:
        s.spend("eval", np.nonzero(s.alive)[0], fed.profile.eval_s)  # the final evaluation
    first = np.zeros(fed.n)
    res = SimResult(fed.names, float(s.t.max() - first.min()), float(s.trained @ fed.tokens_per_step), s.b,
                    s.trained, s.bytes, s.useful, s.t - first, syncs=len(s.issues), missed=s.missed,
                    restarts=int(s.restarts.sum()), events=s.events, cluster_steps=s.steps_simulated)
    times = [x for x, _ in s.issues]
    res.round_s = list(np.diff(times)) if len(times) > 1 else []
    if not opt.steps:
        _extrapolate(res, s, base, t_start, opt.horizon_s)
    return res


def _start_intervals(s: _State, idx: np.ndarray) -> None:
    """Members (or starters) train their next interval: draw it, apply kills and evals, schedule the ask."""
    fed, opt = s.fed, s.opt
    idx = idx[s.alive[idx] & ~s.done[idx]]
    if not len(idx):
        return
    h = s.planned[idx].copy()
    if opt.steps and not s.cand.timed:
        h = np.maximum(np.minimum(h, opt.steps - s.steps[idx]), 0).astype(int)
    elif opt.steps:  # A-EDiT: a cluster reaching `steps` syncs there with its stop vote (local_sgd/sync/pacer.py)
        h = np.where(s.steps[idx] < opt.steps, np.minimum(h, opt.steps - s.steps[idx]), h).astype(int)
    dur = fed.draw_sums(s.rng, idx, h)
    if fed.scenario.host_cores > 0:  # one shared host: the cores go to whoever computes (contention.py)
        others = np.setdiff1d(np.nonzero(s.alive & (s.busy_until > s.t[idx].min()))[0], idx)
        dur = contention.shared(dur[None, :], fed.demand[idx], fed.scenario.host_cores,
                                s.busy_until[others] - s.t[idx].min(), fed.demand[others])[0]
    start, before = s.t[idx].copy(), s.steps[idx].copy()
    for i, c in enumerate(idx):
        killed = _kill_in(s, int(c), float(start[i]), float(before[i]), int(h[i]), float(dur[i]))
        if killed is not None:
            frac = killed
            s.spend("compute", np.array([c]), frac * dur[i])
            s.trained[c] += round(frac * h[i])
            s.push(float(s.t[c]), DEATH, int(c))
            h[i], dur[i] = -1, 0.0
    ok = h >= 0
    idx, h, dur, before = idx[ok], h[ok], dur[ok], before[ok]
    s.steps_simulated += int(h.sum())
    s.spend("compute", idx, dur)
    s.busy_until[idx] = s.t[idx]
    s.step_s[idx] = np.where(h > 0, dur / np.maximum(h, 1), s.step_s[idx])
    s.trained[idx] += h
    s.steps[idx] += h
    s.uncommitted[idx] += dur
    if s.cand.timed:  # A-EDiT: the next plan from this interval's own seconds per step
        secs = dur / np.maximum(h, 1)
        s.planned[idx] = np.maximum(fed.scenario.min_steps, np.floor(s.cand.sync_time_s / np.maximum(secs, 1e-9)
                                                                     + 1e-9)).astype(int)
    _evals(s, idx, before)
    flush = np.maximum(s.pending[idx] - s.t[idx], 0.0)  # the overlapped round in flight must land first
    s.spend("blocked", idx, flush)
    for c in idx:
        s.push(float(s.t[c]), ASK, int(c))


def _kill_in(s: _State, c: int, start: float, before: float, h: int, dur: float) -> float | None:
    """The fraction of this interval cluster `c` trains before a scheduled kill inside it, if any."""
    for k, (kc, at_step, at_s) in enumerate(s.kills):
        if kc != c or s.restarts[c] >= s.opt.max_restarts:
            continue
        frac = None
        if at_step >= 0 and before <= at_step < before + max(h, 1):
            frac = (at_step - before) / max(h, 1)
        elif at_s >= 0 and start <= at_s < start + dur:
            frac = (at_s - start) / max(dur, 1e-9)
        if frac is not None:
            s.kills.pop(k)
            return frac
    return None


def _evals(s: _State, idx: np.ndarray, before: np.ndarray) -> None:
    scn, prof, total = s.fed.scenario, s.fed.profile, s.opt.steps
    after = s.steps[idx]
    if scn.eval_every > 0:
        crossed = np.floor(after / scn.eval_every) - np.floor(before / scn.eval_every)
        if total:
            crossed -= (after >= total) & (after % scn.eval_every == 0)  # the final eval is the run's own
        s.spend("eval", idx, crossed.clip(0) * prof.eval_s)
    if scn.checkpoint_every > 0:
        crossed = np.floor(after / scn.checkpoint_every) - np.floor(before / scn.checkpoint_every)
        s.spend("checkpoint", idx, crossed.clip(0) * prof.checkpoint_s)


def _ask(s: _State, c: int, t: float) -> None:
    if not s.alive[c]:
        return
    if not s.asking:
        s.qid += 1
        s.push(t + s.fed.scenario.join_timeout_s, TIMEOUT, s.qid)
    s.asking[c] = t
    _check(s, t)


def _check(s: _State, now: float) -> None:
    """Issue the forming quorum as torchft's Lighthouse does: at once when every member of the previous quorum
    has asked again (its fast quorum); otherwise only with at least `min_clusters` and *more than half* of the
    heartbeating clusters asking (its guard against a split brain: two clusters always wait for each other
    while both heartbeat), then when every heartbeating cluster has asked or the grace window since the first
    ask has passed."""
    n = len(s.asking)  # who asks is alive (a death takes its ask back), so heartbeating
    if not n:
        return
    if s.prev and n >= len(s.prev) and s.prev.issubset(s.asking.keys()):
        _issue(s, now)
        return
    live = int(s.live(now).sum())
    if n < s.fed.scenario.min_clusters or n <= live // 2:
        return
    if n >= live or now >= min(s.asking.values()) + s.fed.scenario.join_timeout_s - 1e-12:
        _issue(s, now)


def _issue(s: _State, now: float) -> None:
    members = np.array(sorted(s.asking), dtype=int)
    ask = np.array([s.asking[int(c)] for c in members])
    s.asking, s.qid, s.prev = {}, s.qid + 1, set(int(c) for c in members)
    if len(s.issues) and s.issues[-1][0] < now and len(members) < int(s.live(now).sum()):
        s.missed += int(s.live(now).sum()) - len(members)
    total = s.opt.steps
    final = bool(total) and (s.stopping or bool((s.steps[members] >= total).any() if s.cand.timed
                                                  else (s.steps[members] >= total).all()))
    _sync(s, members, ask, now, final)
    s.issues.append((now, float(s.trained @ s.fed.tokens_per_step)))
    if total and s.cand.timed and final:
        s.stopping = True
    if total:
        s.done[members] |= final | (s.steps[members] >= total if not s.cand.timed else False)
    _start_intervals(s, members)


def _sync(s: _State, members: np.ndarray, ask: np.ndarray, issue: float, final: bool) -> None:
    """One sync among `members` (asked at `ask`, issued at `issue`): buckets, clocks, bytes, commits."""
    fed, cand, prof = s.fed, s.cand, s.fed.profile
    cost = fed.sync_cost(members, cand)
    heal = max((fed.heal_s(int(c)) for c in members if s.behind[c]), default=0.0) if len(members) > 1 else 0.0
    if len(members) > 1:
        s.behind[members] = False
    work = float(cost["work"]) if len(members) > 1 else float(cost["work"]) * 0.5
    s.t[members] = ask  # the ask was the cluster's clock; waiting starts there
    mode = "at_end" if final else cand.mode
    if mode == "overlap":
        if cand.timed and not final:  # background quorum: keep stepping until the first boundary after the issue
            step = s.step_s[members]
            more = np.ceil(np.maximum(issue - ask, 0.0) / step + s.rng.random(len(members)) - 0.5)
            more = more.clip(0)
            s.spend("compute", members, more * step)
            s.uncommitted[members] += more * step
            s.steps_simulated += int(more.sum())
            s.trained[members] += more
            s.steps[members] += more
        else:
            s.spend("blocked", members, issue - ask)
        s.spend("blocked", members, prof.quorum_s)
        polls = 1.5 * s.step_s[members]  # exchange, reductions, vote: each advanced at a step boundary
        s.pending[members] = s.t[members] + float(cost["exchange"]) + heal + float(cost["background"]) \
            + float(cost["vote"]) + polls
    else:
        if mode == "layerwise" and "layerwise" in cost:
            body = np.asarray(cost["layerwise"])
        elif mode == "at_end" and "after_backward" in cost:  # launched during the last step's backward
            body = np.asarray(cost["after_backward"])
        else:
            body = np.asarray(cost["at_end"])
        s.spend("blocked", members, issue - ask + prof.quorum_s + float(cost["exchange"]) + heal + body
                + float(cost["vote"]))
    s.spend("sync", members, work)
    s.uncommitted[members] += work  # the trainer's useful time is a step's wall less its blocked time
    s.bytes[members] += np.asarray(cost["bytes"])
    s.useful[members] += s.uncommitted[members]  # a committed sync makes the compute before it useful
    s.uncommitted[members] = 0.0
    if not cand.timed and len(members) > 1:  # lockstep: whoever is behind adopts the federation's step
        s.steps[members] = s.steps[members].max()


def _death(s: _State, c: int, t: float) -> None:
    fed = s.fed
    s.alive[c], s.dead_at[c] = False, t
    s.busy_until[c] = -math.inf
    s.uncommitted[c] = 0.0  # nothing since the last commit survives
    s.pending[c] = -math.inf
    s.restarts[c] += 1
    s.asking.pop(c, None)
    s.push(t + fed.scenario.heartbeat_timeout_s, EXPIRE, c)
    if s.restarts[c] <= s.opt.max_restarts:
        s.push(t + s.opt.restart_s, REVIVE, c)
    _check(s, t)


def _revive(s: _State, c: int, t: float) -> None:
    """Back after a restart: meet (wait the grace window: the others are mid-interval), train from scratch,
    heal and adopt the federation's step at the next joint sync."""
    s.alive[c] = True
    s.b["down"][c] += t - s.dead_at[c]
    s.t[c] = t
    s.spend("startup", np.array([c]), s.fed.scenario.join_timeout_s)
    s.behind[c] = True
    s.steps[c] = 0
    _start_intervals(s, np.array([c]))


def _converged(s: _State, now: float) -> bool:
    opt = s.opt
    n = len(s.issues)
    if now >= opt.horizon_s or n >= opt.max_issues:
        return True
    s.checked = n
    if n < opt.min_issues or n % 8:
        return False
    half = s.issues[n // 2:]
    t = np.array([x for x, _ in half])
    k = np.array([y for _, y in half])
    if t[-1] <= t[0]:
        return False
    rate = (k[-1] - k[0]) / (t[-1] - t[0])
    parts = np.array_split(np.arange(len(t)), 4)
    means = [(k[p[-1]] - k[p[0]]) / max(t[p[-1]] - t[p[0]], 1e-12) for p in parts if len(p) > 1]
    return len(means) == 4 and float(np.std(means, ddof=1)) / 2 / max(rate, 1e-12) < opt.tol


def _extrapolate(res: SimResult, s: _State, base: dict[str, np.ndarray], t_start: np.ndarray, horizon: float) -> None:
    """Scale each cluster's simulated steady state (everything after start-up) to the horizon."""
    span = np.maximum(s.t - t_start, 1e-9)
    f = np.maximum(horizon - t_start, 0.0) / span
    for k in BUCKETS:
        res.buckets[k] = base[k] + (s.b[k] - base[k]) * f
    res.steps = base["trained"] + (s.trained - base["trained"]) * f
    res.useful = base["useful"] + (s.useful - base["useful"]) * f
    res.bytes = base["bytes"] + (s.bytes - base["bytes"]) * f
    res.tokens = float(res.steps @ s.fed.tokens_per_step)
    res.reserved = np.full(len(res.steps), float(horizon))
    res.wall_s = float(horizon)
    res.extrapolated = bool((f > 1.0 + 1e-9).any())
