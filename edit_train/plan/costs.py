"""A scenario resolved for simulation (`Fed`): per-cluster step-time tables, links, bytes; and the cost of a
sync in each mode as edit-train runs it.

* **at_end** — after the quorum: the norm exchange (one small all-gather), then the units one at a time with
  the next one prefetched, each applied (the `sync` bucket) as it lands — `BlockingDriver.flush` — then the
  commit vote: the cluster waits for whatever its own apply does not cover (`pipeline.blocking`).
* **layerwise** — the exchange blocks; unit u's reduction is launched when the next forward reaches unit u−1
  (prefetch) and must have landed — from every participant — before unit u's forward runs: the same
  unit-by-unit pipeline with the forward's share between the units.
* **overlap** — nothing blocks but the quorum (step schedules) or nothing at all (A-EDiT); every unit is
  launched at once and the round lands in the background after exchange + transfers + vote, each phase
  advanced at a step boundary; a sync point reached while the previous round is in flight waits for it.
* **ddp** — a quorum and one fp32 gradient all-reduce every step.
* **backward overlap** (`Scenario.backward_overlap`, off: edit-train reduces after the step) — a unit's
  reduction is launched the moment its backward is done (reverse unit order, PyTorch DDP's buckets; what the
  published simulations of DiLoCo-style training assume), the link queueing them; only what is still in
  flight when the step ends blocks (`after_backward`). Applies to ddp's every step and to an at_end sync.

A unit's transfer takes `latency + bytes / lanes / bandwidth` on the cluster's link (each lane its own queue,
as edit-train's simulated link; a real site link is one lane), and its software `per_op_s + bytes /
sw_bytes_per_s` + the codec's measured time on the lanes' threads; on the simulated link the two run side by
side (the link is a clock, `Pending.wait` waits for both), on a real one they add up (`pipeline.py`). Clusters
behind a shared uplink divide its bandwidth. A collective completes when its slowest participant's part does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from edit_train.plan import hardware, pipeline, subsets, traffic
from edit_train.plan.dist import StepDist
from edit_train.plan.profile import Profile
from edit_train.plan.spec import Candidate, PlanError, Scenario

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
    demand: np.ndarray  # cores each cluster wants while it trains (ranks / slowdown; contention.py)
    # expert subsets (the scenario's `expert_subsets`): per cluster and sync unit, the elements it leaves at home
    # (plan/subsets.py; zeros when off), and the note of a map decided at run time
    home: np.ndarray | None = None
    subsets_note: str = ""

    @property
    def n(self) -> int:
        return len(self.names)

    def cpu_share(self, members: np.ndarray) -> float:
        """How much slower CPU work inside a sync runs when every member's ranks do it at once on a shared host
        (the norms, the codec, the tags, the apply): their ranks / the host's cores, at least 1."""
        cores = self.scenario.host_cores
        return max(1.0, float(self.ranks[members].sum()) / cores) if cores > 0 else 1.0

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

    def unit_bytes(self, c: int, world: int, paired: bool, codec: traffic.Codec, needs: str,
                   subsets: bool = False) -> np.ndarray:
        """Bytes cluster `c` sends of each unit in one sync (`subsets`: its unowned experts' rows left out)."""
        unsent = tuple(int(x) for x in self.home[c]) if subsets and self.home is not None else None
        return _unit_bytes(tuple(self.facts.unit_sizes), world, codec, int(self.ranks[c]), paired,
                           self.scenario.chunks, self.scenario.gather_max, needs, unsent)

    def codec_s(self, c: int, world: int, paired: bool, codec: traffic.Codec, needs: str) -> float:
        """Seconds cluster `c`'s codec takes in one sync among `world`: its own contribution encoded, the
        others' decoded (`traffic.codec_values`), at the profile's measured cost per call and per value."""
        if not codec.lossy or world <= 1:
            return 0.0
        ranks = int(self.ranks[c])
        enc, dec = traffic.codec_values(self.facts.unit_sizes, world, codec, ranks=ranks, paired=paired,
                                        chunks=self.scenario.chunks, gather_max=self.scenario.gather_max, needs=needs)
        lanes = traffic.lanes(ranks, paired, self.scenario.chunks)  # each on its own thread, side by side
        calls = len(self.facts.unit_sizes) * lanes
        return self.profile.codec_s(codec, (calls, enc), ((world - 1) * calls, dec)) / lanes

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
        """What a sync among `members` costs each of them (seconds, bytes), by mode (`pipeline.py`)."""
        p = self.profile
        world, paired = len(members), self.paired(members)
        codec = cand.codec(self.scenario)
        needs = traffic.NEEDS.get(cand.algo, "measurements")
        per_unit = np.array([self.unit_bytes(int(c), world, paired, codec, needs, bool(cand.subsets))
                             for c in members])
        nbytes = per_unit.sum(axis=1)
        cpu = self.cpu_share(members)
        apply = cpu * p.work_s(self.facts.total_params)  # norms, outer steps, re-bases: between the units
        probe = cpu * (p.probe_s if cand.algo in ("edit", "a_edit") else 0.0)  # the verified rule's own bucket
        out: dict[str, np.ndarray | float] = {"bytes": nbytes, "work": apply + probe}
        if world <= 1:
            zero = np.zeros(world)
            return {**out, "exchange": 0.0, "vote": 0.0, "at_end": zero, "layerwise": zero, "background": 0.0}
        lat, sim = float(self.lat[members].max()), self.scenario.simulated_link
        out["exchange"] = out["vote"] = pipeline.small(lat, cpu * p.per_op_s, sim)
        wire = self.wire_s(members, nbytes.astype(float), paired)
        share = np.asarray(self.facts.unit_sizes, dtype=float) / max(self.facts.total_params, 1)
        coded = np.array([self.codec_s(int(c), world, paired, codec, needs) for c in members])
        wire_u = per_unit * (wire / np.maximum(nbytes, 1))[:, None]
        work_u = cpu * (p.per_op_s + per_unit / (p.sw_bytes_per_s or math.inf) + np.outer(coded, share))
        apply_u = np.outer(np.ones(world), apply * share)
        out["background"] = float(pipeline.at_once(wire_u, work_u, lat, sim)[0])
        groups = np.array_split(np.arange(per_unit.shape[1]), min(MAX_GROUPS, per_unit.shape[1]))
        merge = lambda x: np.stack([x[:, g].sum(axis=1) for g in groups], axis=1)  # noqa: E731
        out["at_end"] = pipeline.blocking(merge(wire_u), merge(work_u), lat, merge(apply_u), sim)[0]
        if cand.mode == "layerwise":
            layer = np.array([self._layer_share(g) for g in groups], dtype=float)
            fwd = np.outer(FWD_FRACTION * self.mean_step[members], layer / max(layer.sum(), 1.0))
            out["layerwise"] = pipeline.blocking(merge(wire_u), merge(work_u), lat, merge(apply_u) + fwd, sim)[0]
        if self.scenario.backward_overlap:
            sw = np.array([p.sync_software_s(per_unit.shape[1], b) for b in nbytes]) + coded
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

    def ddp_step_comm(self, members: np.ndarray, scheme: str = "none") -> tuple[float, np.ndarray]:
        """(seconds every member waits for the gradient all-reduce after the quorum, bytes each sends);
        gradients in fp32 (edit-train's ddp) or `scheme`'s value width (bf16: the published settings)."""
        world = len(members)
        if world <= 1:
            return self.profile.quorum_s, np.zeros(world)
        width = traffic.VALUE_BYTES.get(scheme, 4)
        nbytes = np.full(world, float(traffic.ddp_bytes(self.facts.total_params, world, width)))
        wire = self.wire_s(members, nbytes, self.paired(members))
        sw = self.cpu_share(members) * np.array([self.profile.sync_software_s(2, b) for b in nbytes])
        lat = float(self.lat[members].max())
        if self.scenario.backward_overlap:
            per_unit = np.outer(nbytes, np.array(self.facts.unit_sizes, dtype=float) / self.facts.total_params)
            wait = self.after_backward(members, per_unit, wire / np.maximum(nbytes, 1), sw, lat)
            return self.profile.quorum_s + float(wait.max()), nbytes
        landed = pipeline.at_once(wire[:, None], sw[:, None], lat, self.scenario.simulated_link)
        return self.profile.quorum_s + float(landed.max()), nbytes

    def heal_s(self, healer: int) -> float:
        nbytes = traffic.heal_bytes(self.facts.total_params)
        return float(self.lat[healer] + nbytes / self.bw[healer] + self.profile.sync_software_s(2, nbytes))


@lru_cache(maxsize=4096)
def _unit_bytes(units: tuple[int, ...], world: int, scheme: traffic.Codec, ranks: int, paired: bool, chunks: int,
                gather_max: int, needs: str, unsent: tuple[int, ...] | None = None) -> np.ndarray:
    left = unsent or (0,) * len(units)
    return np.array([traffic.sync_bytes([u], world, scheme, ranks=ranks, paired=paired, chunks=chunks,
                                        gather_max=gather_max, needs=needs, unsent=[s]) for u, s in zip(units, left)],
                    dtype=float)


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
    demand = np.array([c.ranks / max(c.slowdown, 1.0) for c in scn.clusters])
    home, note = subsets_home(scn, facts)
    return Fed(scn, profile, facts, [c.name for c in scn.clusters], ranks, dists, np.array(tps, dtype=float),
               np.array(bw), np.array(lat), np.array(up), [u.bandwidth_mbps * 1e6 / 8 for u in scn.uplinks],
               means, stds, demand, home, note)


def subsets_home(scn: Scenario, facts: hardware.ModelFacts) -> tuple[np.ndarray | None, str]:
    """The scenario's expert subsets: per cluster and unit, the elements it leaves at home (None: off), and the
    note of a map decided at run time (`plan/subsets.cluster_map`, the product's own parser)."""
    if not scn.expert_subsets:
        return None, ""
    if not facts.experts:
        raise PlanError(f"expert_subsets: model {facts.name} has no routed experts")
    try:
        owners, note = subsets.cluster_map(scn.expert_subsets, len(scn.clusters), facts.experts)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    return np.array([subsets.home(o, facts.expert_sizes) for o in owners], dtype=np.int64), note


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
