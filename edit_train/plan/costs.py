"""A scenario resolved for simulation (`Fed`): per-cluster step-time tables, links, bytes; and the cost of a
sync in each mode as edit-train runs it.

* **at_end** — after the quorum: the norm exchange (one small all-gather), every unit's transfer at once,
  the commit vote: the cluster is blocked for all of it.
* **layerwise** — the exchange blocks; unit u's reduction is launched when the next forward reaches unit u−1
  (prefetch) and must have landed — from every participant — before unit u's forward runs: a unit-by-unit
  recursion per cluster (`layerwise`), the link queueing transfers (latency paid after the queue).
* **overlap** — nothing blocks but the quorum (step schedules) or nothing at all (A-EDiT); the round lands
  in the background after exchange + transfers + vote, each phase advanced at a step boundary; a sync point
  reached while the previous round is in flight waits for it (flush).
* **ddp** — a quorum and one fp32 gradient all-reduce every step.
* **backward overlap** (`Scenario.backward_overlap`, off: edit-train reduces after the step) — a unit's
  reduction is launched the moment its backward is done (reverse unit order, PyTorch DDP's buckets; what the
  published simulations of DiLoCo-style training assume), the link queueing them; only what is still in
  flight when the step ends blocks (`after_backward`). Applies to ddp's every step and to an at_end sync.

A transfer takes `latency + bytes / lanes / bandwidth` on the cluster's link (each lane its own queue, as
edit-train's simulated link; a real site link is one lane) plus the calibrated software cost
`n_ops · per_op_s + bytes / sw_bytes_per_s`; clusters behind a shared uplink divide its bandwidth. A
collective completes when its slowest participant's transfer does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from edit_train.plan import hardware, traffic
from edit_train.plan.dist import StepDist
from edit_train.plan.profile import Profile
from edit_train.plan.spec import Candidate, Scenario

FWD_FRACTION = 1.0 / 3.0  # forward share of a step (backward ≈ 2× forward)
EXACT = 8  # up to this many steps are drawn one by one
MAX_GROUPS = 16  # layer-wise recursion: consecutive units merged into at most this many groups


@dataclass
class Fed:
    """The federation as the simulator sees it (arrays indexed by cluster)."""

    scenario: Scenario
    profile: Profile
    facts: hardware.ModelFacts
    names: list[str]
    ranks: np.ndarray
    dists: list[StepDist]  # one rank, slowdown included
    tokens_per_step: np.ndarray
    bw: np.ndarray  # bytes/s per lane (inf: unlimited)
    lat: np.ndarray  # seconds
    uplink: np.ndarray  # index of the shared uplink or -1
    uplink_bw: list[float]
    mean_step: np.ndarray  # mean cluster step (slowest rank) + per-step overhead
    std_step: np.ndarray

    @property
    def n(self) -> int:
        return len(self.names)

    # ------------------------------------------------------------------ steps
    def draw_sums(self, rng: np.random.Generator, idx: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Seconds of `steps[i]` consecutive steps of cluster `idx[i]`: exact draws of the slowest rank for
        short stretches, the sum's normal limit (mean, variance × steps) beyond `EXACT` steps."""
        steps = np.asarray(steps, dtype=float)
        out = steps * self.mean_step[idx] + np.sqrt(steps) * self.std_step[idx] * rng.standard_normal(len(idx))
        out = np.maximum(out, 0.5 * steps * self.mean_step[idx])
        for i in np.nonzero((steps > 0) & (steps <= EXACT))[0]:
            c, h = int(idx[i]), int(steps[i])
            out[i] = float(self.dists[c].sample_max(rng, int(self.ranks[c]), h).sum()) + h * self.profile.other_step_s
        return out

    # ------------------------------------------------------------------ bytes
    def paired(self, members: np.ndarray) -> bool:
        return len(set(int(self.ranks[m]) for m in members)) <= 1

    def lanes(self, c: int, paired: bool) -> int:
        lk = self.scenario.link_of(self.names[c])
        if lk.lanes > 0:
            return lk.lanes
        return traffic.lanes(int(self.ranks[c]), paired, self.scenario.chunks) if self.scenario.simulated_link else 1

    def unit_bytes(self, c: int, world: int, paired: bool, scheme: str) -> np.ndarray:
        return _unit_bytes(tuple(self.facts.unit_sizes), world, scheme, int(self.ranks[c]), paired,
                           self.scenario.chunks, self.scenario.gather_max)

    def wire_s(self, members: np.ndarray, nbytes: np.ndarray, paired: bool) -> np.ndarray:
        """Link seconds of each member's `nbytes` (no latency), shared uplinks divided."""
        lanes = np.array([self.lanes(int(c), paired) for c in members], dtype=float)
        own = nbytes / lanes / self.bw[members]
        up = self.uplink[members]
        for u in set(int(x) for x in up if x >= 0):
            on = up == u
            own[on] = np.maximum(own[on], nbytes[on].sum() / self.uplink_bw[u])
        return own

    # ------------------------------------------------------------------ one sync
    def sync_cost(self, members: np.ndarray, cand: Candidate) -> dict[str, np.ndarray | float]:
        """What a sync among `members` costs each of them (seconds, bytes), by mode."""
        p = self.profile
        world, paired = len(members), self.paired(members)
        per_unit = np.array([self.unit_bytes(int(c), world, paired, cand.compression) for c in members])
        nbytes = per_unit.sum(axis=1)
        units = per_unit.shape[1]
        lat = float(self.lat[members].max())
        small = lat + p.per_op_s if world > 1 else 0.0  # the exchange, the vote
        sw = np.array([p.sync_software_s(units, b) for b in nbytes])
        wire = self.wire_s(members, nbytes.astype(float), paired)
        xfer = float((wire + sw).max()) + lat if world > 1 else 0.0
        work = p.work_s(self.facts.total_params) + (p.probe_s if cand.algo in ("edit", "a_edit") else 0.0)
        out: dict[str, np.ndarray | float] = {"bytes": nbytes, "exchange": small, "vote": small, "xfer": xfer,
                                               "work": work}
        # overlap: the per-unit software work (reductions, decoding, tags) runs on the lanes' own threads
        # while the cluster trains, so only the wire and the latency delay the round's landing
        out["xfer_background"] = float(wire.max()) + lat if world > 1 else 0.0
        if cand.mode == "layerwise" and world > 1:
            out["layerwise"] = self.layerwise(members, per_unit, wire / np.maximum(nbytes, 1), sw, lat)
        if self.scenario.backward_overlap and world > 1:
            out["after_backward"] = self.after_backward(members, per_unit, wire / np.maximum(nbytes, 1), sw, lat)
        return out

    def _layer_share(self, idx: list[int] | np.ndarray) -> float:
        return float(sum(self.facts.unit_sizes[i] for i in idx if self.facts.units[i][0].startswith("layers")))

    def after_backward(self, members: np.ndarray, per_unit: np.ndarray, s_per_byte: np.ndarray, sw: np.ndarray,
                       lat: float) -> np.ndarray:
        """Seconds each member waits after its step for reductions launched during the backward: unit u's
        transfer starts when the backward (last unit first, compute ∝ the unit's layer parameters) has passed
        it and the link is free; the step waits for the last to land."""
        units = per_unit.shape[1]
        share = np.array([self._layer_share([u]) for u in range(units)])
        share = share / max(share.sum(), 1.0)
        step = self.mean_step[members]
        bwd = (1.0 - FWD_FRACTION) * step
        x = per_unit * s_per_byte[:, None] + (sw / max(units, 1))[:, None]
        free = np.zeros(len(members))
        done = FWD_FRACTION * step  # the backward starts at the last unit
        for u in reversed(range(units)):
            done = done + bwd * share[u]
            free = np.maximum(done, free) + x[:, u]
        return np.maximum(free + lat - step, 0.0)

    def layerwise(self, members: np.ndarray, per_unit: np.ndarray, s_per_byte: np.ndarray, sw: np.ndarray,
                  lat: float) -> np.ndarray:
        """Extra seconds the next forward of each member takes because units wait for their reduction."""
        groups = np.array_split(np.arange(per_unit.shape[1]), min(MAX_GROUPS, per_unit.shape[1]))
        gbytes = np.stack([per_unit[:, g].sum(axis=1) for g in groups], axis=1)
        share = np.array([self._layer_share(g) for g in groups], dtype=float)
        share = share / max(share.sum(), 1.0)
        fwd = np.outer(FWD_FRACTION * self.mean_step[members], share)
        x = gbytes * s_per_byte[:, None] + (sw / len(groups))[:, None]
        now = np.zeros(len(members))
        free = np.zeros(len(members))
        ready = np.zeros(gbytes.shape)

        def launch(g: int, at: np.ndarray) -> None:
            nonlocal free
            start = np.maximum(at, free)
            free = start + x[:, g]
            ready[:, g] = free + lat

        launch(0, now)
        for g in range(len(groups)):
            if g + 1 < len(groups):
                launch(g + 1, now)
            now = np.maximum(now, ready[:, g].max()) + fwd[:, g]
        return now - fwd.sum(axis=1)

    def ddp_step_comm(self, members: np.ndarray, scheme: str = "none") -> tuple[float, np.ndarray]:
        """(seconds every member waits for the gradient all-reduce after the quorum, bytes each sends);
        gradients in fp32 (edit-train's ddp) or `scheme`'s value width (bf16: the published settings)."""
        world = len(members)
        if world <= 1:
            return self.profile.quorum_s, np.zeros(world)
        width = traffic.VALUE_BYTES.get(scheme, 4)
        nbytes = np.full(world, float(traffic.ddp_bytes(self.facts.total_params, world, width)))
        wire = self.wire_s(members, nbytes, self.paired(members))
        sw = np.array([self.profile.sync_software_s(2, b) for b in nbytes])
        lat = float(self.lat[members].max())
        if self.scenario.backward_overlap:
            per_unit = np.outer(nbytes, np.array(self.facts.unit_sizes, dtype=float) / self.facts.total_params)
            wait = self.after_backward(members, per_unit, wire / np.maximum(nbytes, 1), sw, lat)
            return self.profile.quorum_s + float(wait.max()), nbytes
        return self.profile.quorum_s + float(lat + (wire + sw).max()), nbytes

    def heal_s(self, healer: int) -> float:
        nbytes = traffic.heal_bytes(self.facts.total_params)
        return float(self.lat[healer] + nbytes / self.bw[healer] + self.profile.sync_software_s(2, nbytes))


@lru_cache(maxsize=4096)
def _unit_bytes(units: tuple[int, ...], world: int, scheme: str, ranks: int, paired: bool, chunks: int,
                gather_max: int) -> np.ndarray:
    return np.array([traffic.sync_bytes([u], world, scheme, ranks=ranks, paired=paired, chunks=chunks,
                                        gather_max=gather_max) for u in units], dtype=float)


def resolve(scn: Scenario, profile: Profile, facts: hardware.ModelFacts | None = None) -> Fed:
    """The scenario's clusters with step-time distributions (calibrated, measured or from FLOPs), links."""
    facts = facts or hardware.model_facts(scn.model)
    dists, tps, bw, lat, up = [], [], [], [], []
    uplinks = {name: i for i, u in enumerate(scn.uplinks) for name in u.clusters}
    for c in scn.clusters:
        batch = c.batch_size or scn.batch_size
        dists.append(rank_dist(c, profile, facts, batch, scn.seq_len))
        tps.append(c.ranks * batch * scn.seq_len)
        lk = scn.link_of(c.name)
        bw.append(lk.bandwidth_mbps * 1e6 / 8 if lk.bandwidth_mbps > 0 else math.inf)
        lat.append(lk.latency_ms / 1000.0)
        up.append(uplinks.get(c.name, -1))
    ranks = np.array([c.ranks for c in scn.clusters])
    means = np.array([d.mean_max(int(r)) for d, r in zip(dists, ranks)]) + profile.other_step_s
    stds = np.array([d.std_max(int(r)) for d, r in zip(dists, ranks)])
    return Fed(scn, profile, facts, [c.name for c in scn.clusters], ranks, dists, np.array(tps, dtype=float),
               np.array(bw), np.array(lat), np.array(up), [u.bandwidth_mbps * 1e6 / 8 for u in scn.uplinks],
               means, stds)


def rank_dist(c, profile: Profile, facts: hardware.ModelFacts, batch: int, seq_len: int) -> StepDist:
    """One rank's step time of plan cluster `c`: its measured step_s, else its calibrated twin (same name and
    ranks), else the pooled calibrated rank (same workload), else FLOPs / (peak × MFU) of its accelerator."""
    cal = profile.clusters.get(c.name)
    same_work = profile.model in ("", facts.name) and profile.batch_size in (0, batch) and profile.seq_len in (0, seq_len)
    if c.step_s > 0:
        base = StepDist(c.step_s, c.step_cv, c.p_slow, c.slow_factor)
    elif cal is not None and same_work:
        base = cal.dist.scaled(1.0 / max(cal.slowdown, 1e-9))
    elif profile.rank_step is not None and same_work and not c.accelerator:
        base = profile.rank_step
    else:
        seconds = hardware.step_seconds(facts, c.accelerator, batch * seq_len, seq_len, c.mfu or hardware.DEFAULT_MFU)
        base = StepDist(seconds, c.step_cv, c.p_slow, c.slow_factor)
    return base.scaled(c.slowdown)
