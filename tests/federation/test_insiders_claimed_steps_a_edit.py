"""Issue 69, item 2 under a time schedule (A-EDiT, the default algorithm). A liar claims 4x its local steps in every
norm exchange (tokens to match) and sends 15x its Δ. Under A-EDiT a cluster's steps follow its speed, so no sync
count bounds them; but every member's row of the exchange says both its steps and its seconds per step, and steps x
seconds per step is the interval's duration as that member says it spent it. Each member caps every claim at
what its claimed seconds per step fit in the quorum's agreed duration (the lower median of those, at least
τ) (`judge.time_caps`): the exchange's rows and the quorum's records only, so every honest member caps the same
claims the same way and their anchors stay one. The liar is named by its roster key; honest federations at 1:1, 1:3
and 1:12 keep every claim as it was (nobody capped, nobody named). Over a real gate with a roster."""

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
from edit_train.local_sgd.sync.judge import time_caps
from edit_train.local_sgd.sync.schedule import ScheduleConfig
from liar_utils import KEY, SYNCS, TOTAL, GateRun, final_loss, run_threads, toy_config
from test_insiders_claimed_steps import ClaimsMore
from toy_federation import H, Outcome, train_cluster

TOLERANCE = 0.02
STEP_S = 0.01  # the seconds per step every cluster reports (× its ratio): 2H steps of it per interval
TAU = 2 * H * STEP_S


def _config(names: tuple[str, ...]) -> Any:
    cfg = toy_config(names, rule="verified")
    return replace(cfg, schedule=ScheduleConfig(kind="time", sync_time_s=TAU, interval=H), total_steps=TOTAL)


def _run(root: Path, ratios: list[int], liar: bool, how: Any = ClaimsMore) -> tuple[dict[str, Outcome], dict[str, str]]:
    names = [f"c{i}" for i in range(len(ratios))]
    run = GateRun(root, names, honest=len(names)).start()
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


@pytest.mark.parametrize("ratio", [1, 3, 12])
def test_an_honest_a_edit_federation_keeps_its_claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      ratio: int) -> None:
    seen: list[tuple[list[float], list[float]]] = []
    real = judge.Judge._time_steps

    def spy(self: judge.Judge, claimed: torch.Tensor, secs: torch.Tensor) -> torch.Tensor:
        out = real(self, claimed, secs)
        seen.append((claimed.tolist(), out.tolist()))
        return out

    monkeypatch.setattr(judge.Judge, "_time_steps", spy)
    outs, _ = _run(tmp_path, [1, ratio], liar=False)
    assert seen and all(a == b for a, b in seen), seen  # every claim kept exactly
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
