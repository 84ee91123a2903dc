"""Issue 69, item 2 under a time schedule (A-EDiT, the default algorithm). A liar claims 4x its local steps in every
norm exchange (tokens to match) and sends 15x its Δ. Under A-EDiT a cluster's steps follow its speed, so no sync
count bounds them; but every member's row of the exchange says both its steps and its seconds per step, and steps x
seconds per step is the interval's duration as that member says it spent it. Each member caps every claim at
what its claimed seconds per step fit in the quorum's agreed duration (the lower median of those, at least
τ) (`judge.time_caps`): the exchange's rows and the quorum's records only, so every honest member caps the same
claims the same way and their anchors stay one. The liar is named by its roster key; honest federations at 1:1, 1:3
and 1:12 keep every claim as it was (nobody capped, nobody named). Over a real gate with a roster.

What the exchange cannot check is a *consistent* lie: 4x the steps at a quarter of the seconds per step. Where
the roster declares each cluster's hardware speed (signed by the operator), a member counts at most as fast,
relative to the quorum, as declared (`judge.declared_floor`), and one claiming over NAMED_OVER x that is named."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from edit_train.cluster.group import RankGroup
from edit_train.federation.inproc import InProcessFederation, ThreadGroup
from edit_train.federation.lanes import Lanes
from edit_train.federation.transport import LaneTransport
from edit_train.local_sgd.sync import judge
from edit_train.local_sgd.sync.judge import EXTRA, time_caps
from edit_train.local_sgd.sync.schedule import ScheduleConfig
from liar_utils import KEY, SYNCS, TOTAL, GateRun, final_loss, run_threads, toy_config
from test_insiders_claimed_steps import CLAIM, ClaimsMore
from toy_federation import H, Outcome, train_cluster

TOLERANCE = 0.02
STEP_S = 0.01  # the seconds per step every cluster reports (× its ratio): 2H steps of it per interval
TAU = 2 * H * STEP_S


class ClaimsFaster(ClaimsMore):
    """ClaimsMore, and seconds per step divided by the same factor: steps x s/step is the interval's duration."""

    def all_gather(self, vec: Any, what: str = "") -> Any:
        if what == "norm exchange":
            vec = vec.clone()
            vec[self.units + 1 + EXTRA.index("secs_per_step")] /= CLAIM
        return super().all_gather(vec, what)


def _config(names: tuple[str, ...]) -> Any:
    cfg = toy_config(names, rule="verified")
    return replace(cfg, schedule=ScheduleConfig(kind="time", sync_time_s=TAU, interval=H), total_steps=TOTAL)


def _run(root: Path, ratios: list[int], liar: bool, how: Any = ClaimsMore,
         speeds: dict[str, float] | None = None) -> tuple[dict[str, Outcome], dict[str, str]]:
    names = [f"c{i}" for i in range(len(ratios))]
    run = GateRun(root, names, honest=len(names), speeds=speeds).start()
    keys = {n: run.creds[n].key_id(n) for n in names}
    cfg = _config(tuple(names))
    try:
        hub = InProcessFederation(timeout_s=30.0)
        transports: dict[str, Any] = {
            n: LaneTransport(n, RankGroup(), Lanes(lambda n=n: ThreadGroup(hub, n)), True, run.client(n),
                             f"inproc:{n}", key=KEY, quorum_timeout_s=30.0, connect_timeout_s=10.0) for n in names}
        wraps = {names[-1]: how} if liar else {}
        return run_threads({n: (lambda i=i, n=n: train_cluster(i, transports[n], cfg, wrap=wraps.get(n),
                                                               step_s=STEP_S * ratios[i]))
                            for i, n in enumerate(names)}, timeout=240.0), keys
    finally:
        run.close()


def _syncs(o: Outcome) -> list[dict[str, Any]]:
    return [e for e in o.events if e["event"] == "sync"]


def test_time_caps_bound_a_claim_by_the_agreed_duration_and_keep_honest_claims() -> None:
    tau = 0.04
    # honest 1:1, 1:3, 1:12 (a cluster slower than τ per step takes min_steps): nothing capped
    for steps, secs in (([4, 4], [0.01, 0.01]), ([4, 1], [0.01, 0.03]), ([4, 1], [0.01, 0.12]),
                        ([5, 4, 1], [0.0085, 0.01, 0.12])):
        st = torch.tensor(steps, dtype=torch.float64)
        assert bool((time_caps(st, torch.tensor(secs, dtype=torch.float64), [1] * len(steps), tau) >= st).all())
    # the first interval (until τ is spent: one step more than τ fits) is kept; one step more (the step in
    # progress when an overlapped quorum is issued), at the first sync two (a step spent waiting is not timed)
    st = torch.tensor([5.0, 2.0])
    assert time_caps(st, torch.tensor([0.0085, 0.039]), [1, 1], tau).tolist() == [6.0, 3.0]
    st = torch.tensor([4.0, 2.0])
    assert time_caps(st, torch.tensor([0.01, 0.12]), [1, 1], tau, first=True).tolist() == [6.0, 3.0]
    # 4x the steps at its real speed: counted at what the agreed duration fits, and one (2 and 3 clusters)
    caps = time_caps(torch.tensor([4.0, 16.0]), torch.tensor([0.01, 0.01]), [1, 1], tau)
    assert caps.tolist() == [5.0, 5.0]
    caps = time_caps(torch.tensor([4.0, 4.0, 16.0]), torch.tensor([0.01, 0.01, 0.01]), [1, 1, 1], tau)
    assert caps.tolist() == [5.0, 5.0, 5.0]
    # claiming 100x the speed too: at three members the speed counts at most SPEED_SPAN x the lower median's
    caps = time_caps(torch.tensor([4.0, 4.0, 400.0]), torch.tensor([0.01, 0.01, 1e-4]), [1, 1, 1], tau)
    assert caps[2] == round(tau / (0.01 / judge.SPEED_SPAN)) + 1
    # a member claiming no work (or NaN) cannot shrink the others' duration below τ; two intervals since an anchor
    caps = time_caps(torch.tensor([8.0, float("nan")]), torch.tensor([0.01, float("nan")]), [2, 1], tau)
    assert caps[0] == 9.0 and caps[1] == 5.0


@pytest.mark.parametrize("ratio,declared", [(1, False), (3, False), (12, False), (3, True), (12, True)],
                         ids=["1:1", "1:3", "1:12", "1:3 declared", "1:12 declared"])
def test_an_honest_a_edit_federation_keeps_its_claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      ratio: int, declared: bool) -> None:
    """Every claim kept exactly and nobody named, with or without the roster declaring the speeds it runs at."""
    seen: list[tuple[list[float], list[float], list[float]]] = []
    real = judge.Judge._time_steps

    def spy(self: judge.Judge, claimed: torch.Tensor, secs: torch.Tensor) -> torch.Tensor:
        out = real(self, claimed, secs)
        seen.append((claimed.tolist(), out.tolist(), list(self.declared)))
        return out

    monkeypatch.setattr(judge.Judge, "_time_steps", spy)
    speeds = {"c0": float(ratio), "c1": 1.0} if declared else None
    outs, _ = _run(tmp_path, [1, ratio], liar=False, speeds=speeds)
    assert seen and all(a == b for a, b, _ in seen), seen  # every claim kept exactly
    want = [float(ratio), 1.0] if declared else [0.0, 0.0]  # the roster's speeds reach the rule (0: none declared)
    assert all(d == want for _, _, d in seen), seen
    for o in outs.values():
        syncs = _syncs(o)
        assert syncs and not [s for e in syncs for s in e["suspects"]], syncs


@pytest.mark.parametrize("n", [2, 3], ids=["2 clusters", "3 clusters"])
def test_claimed_steps_buy_no_weight_under_a_edit(tmp_path: Path, caplog: pytest.LogCaptureFixture, n: int) -> None:
    names = [f"c{i}" for i in range(n)]
    liar, honest = names[-1], names[:-1]
    clean, _ = _run(tmp_path / "clean", [1] * n, False)
    with caplog.at_level(logging.WARNING):
        outs, keys = _run(tmp_path / "lied", [1] * n, True)
    for name in honest:
        o = outs[name]
        syncs = _syncs(o)
        assert len(syncs) >= SYNCS and all(e["quorum"] == names for e in syncs), (name, syncs)
        named = {s["key"] for e in syncs for s in e.get("suspects", [])}
        assert keys[liar] in named and named <= {keys[liar]}, (name, named)
        loss, base = final_loss(o, 0), final_loss(clean[name], 0)
        assert abs(loss - base) <= TOLERANCE * base, (name, loss, base)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(tuple(f"cluster {h}:" for h in honest))]
    assert any(f"cluster {liar} claims" in x and "local steps" in x and f"roster key {keys[liar]}" in x for x in said), \
        said[-20:]
    assert not [x for x in said for h in honest if f"roster key {keys[h]}" in x], said  # no honest cluster named


def test_declared_speeds_bound_a_consistent_speed_claim_and_keep_honest_ones() -> None:
    tau = 0.04
    t = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    # honest 1:3 and 1:12 as declared (and 2 fast + 1 slow): every claim kept
    for steps, secs, declared in (([4, 1], [0.01, 0.03], [3, 1]), ([4, 1], [0.01, 0.12], [12, 1]),
                                  ([4, 4, 1], [0.01, 0.01, 0.12], [12, 12, 1])):
        caps = time_caps(t(*steps), t(*secs), [1] * len(steps), tau, declared=t(*declared))
        assert bool((caps >= t(*steps)).all()), (steps, caps)
    # 4x the steps at a quarter of the seconds per step, consistently: without declared speeds kept at two members
    lie = (t(4.0, 16.0), t(0.01, 0.0025))
    assert time_caps(*lie, [1, 1], tau).tolist() == [5.0, 17.0]
    # with them (declared equal): the liar counts as fast as the honest, at two and three members
    assert time_caps(*lie, [1, 1], tau, declared=t(1, 1)).tolist() == [5.0, 5.0]
    caps = time_caps(t(4.0, 4.0, 16.0), t(0.01, 0.01, 0.0025), [1, 1, 1], tau, declared=t(1, 1, 1))
    assert caps.tolist() == [5.0, 5.0, 5.0]
    # claiming to be 4x slower than declared (to hold the other to its speed: of two, either may lie) buys no more
    # than its declared share either: the honest counts at least as much as it
    steps = t(4.0, 1.0)
    counted = torch.minimum(steps, time_caps(steps, t(0.01, 0.04), [1, 1], tau, declared=t(1, 1)))
    assert counted[1] / counted.sum() <= 0.5 and counted[0] >= counted[1], counted


@pytest.mark.parametrize("n", [2, 3], ids=["2 clusters", "3 clusters"])
def test_a_consistent_speed_claim_buys_no_weight_where_the_roster_declares_speeds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, n: int) -> None:
    """A member claiming 4x its speed and 4x its steps (the time caps hold) and sending 15x its Δ: without declared
    speeds it costs the honest +14.7 % (2 clusters) / +19.7 % (3) (benchmarks/insiders_checked.py); with them
    at most 2 % worse than the clean run, and the liar is named for its speed, no honest cluster."""
    names = [f"c{i}" for i in range(n)]
    liar, honest, speeds = names[-1], names[:-1], {x: 1.0 for x in names}
    clean, _ = _run(tmp_path / "clean", [1] * n, False, speeds=speeds)
    with caplog.at_level(logging.WARNING):
        outs, keys = _run(tmp_path / "lied", [1] * n, True, ClaimsFaster, speeds=speeds)
    for name in honest:
        o = outs[name]
        syncs = _syncs(o)
        assert len(syncs) >= SYNCS and all(e["quorum"] == names for e in syncs), (name, syncs)
        named = {s["key"] for e in syncs for s in e.get("suspects", [])}
        assert named == {keys[liar]}, (name, named)
        loss, base = final_loss(o, 0), final_loss(clean[name], 0)
        # the price is what it costs: at most 2 % worse (the liar's data may help — CI measured -2.0 %: the clean
        # A-EDiT run's quorums follow the threads' timing on a loaded box)
        assert loss <= (1 + TOLERANCE) * base, (name, loss, base)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(tuple(f"cluster {h}:" for h in honest))]
    assert any(f"cluster {liar} claims" in x and "as the roster declares its hardware" in x
               and f"roster key {keys[liar]}" in x for x in said), said[-20:]
