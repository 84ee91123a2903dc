"""Issue 69, item 7: a configured member that never asks for a quorum held every honest cluster's fresh start for
`quorum_timeout_s` (300 s by default). Now a fresh start waits the join wait (`federation.join_timeout_s`, seconds)
for the configured clusters and then trains; until its first shared sync (at most `quorum_timeout_s` after it
started) it makes no sync alone (`Membership.holding_start`), so its anchor stays the federation's first — the same
on every cluster by construction — and a configured cluster that comes later meets it at sync 0 with the same anchor:
nobody heals from one member's word (item 1) and nobody is left on its own anchor. A-EDiT over a real gate."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from edit_train.cluster.group import RankGroup
from edit_train.federation.inproc import InProcessFederation, ThreadGroup
from edit_train.federation.lanes import Lanes
from edit_train.federation.transport import LaneTransport
from edit_train.federation.quorum import Quorum
from liar_utils import KEY, GateRun, claims, run_threads
from test_insiders_claimed_steps_a_edit import STEP_S, _config
from toy_federation import Outcome, max_diff, train_cluster

JOIN_S = 1.0  # the join wait
HOLD = 8.0  # quorum_timeout_s


class SlowAsker:
    """An honest cluster whose requests take `delay` seconds to reach the gate (so its run outlasts the join
    wait: the toy's steps take microseconds)."""

    def __init__(self, inner: LaneTransport, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def form_start(self, sync: int, data: dict[str, Any], vet: Any = None) -> None:
        time.sleep(self.delay)
        self.inner.form_start(sync, data, vet)


def _run(root: Path, train: dict[str, float], delay: float = 0.0) -> dict[str, Outcome]:
    """Two configured clusters c0, c1; those in `train` start after their value in seconds (c1 absent: it never
    asks); c0's requests take `delay` seconds."""
    names = ["c0", "c1"]
    run = GateRun(root, names, honest=2).start()
    cfg = _config(tuple(names))
    cfg = replace(cfg, membership=replace(cfg.membership, quorum_timeout_s=HOLD, join_timeout_s=JOIN_S))
    try:
        hub = InProcessFederation(timeout_s=30.0)
        transports: dict[str, Any] = {
            n: LaneTransport(n, RankGroup(), Lanes(lambda n=n: ThreadGroup(hub, n)), True, run.client(n),
                             f"inproc:{n}", key=KEY, quorum_timeout_s=30.0, connect_timeout_s=10.0) for n in train}
        if delay:
            transports["c0"] = SlowAsker(transports["c0"], delay)

        def job(i: int, n: str) -> Outcome:
            time.sleep(train[n])
            return train_cluster(i, transports[n], cfg, step_s=STEP_S)

        return run_threads({n: (lambda i=i, n=n: job(i, n)) for i, n in enumerate(names) if n in train},
                           timeout=120.0)
    finally:
        run.close()


def test_a_member_that_never_asks_holds_a_fresh_start_only_the_join_wait(tmp_path: Path) -> None:
    outs = _run(tmp_path, {"c0": 0.0}, delay=0.2)  # c1 is configured and never asks
    o = outs["c0"]
    assert o.steps > 0 and not o.killed
    # before: it waited quorum_timeout_s at start, then synced alone. Now it trains after the join wait, making no
    # sync alone (its anchor the federation's first) until quorum_timeout_s has passed since its start
    kinds = [e["event"] for e in o.events if e["event"] in ("sync", "missed")]
    assert kinds[0] == "missed" and "sync" in kinds, kinds
    first_sync = next(e for e in o.events if e["event"] == "sync")
    assert first_sync["sync"] == 1 and first_sync["quorum"] == ["c0"]


def test_a_configured_cluster_that_comes_late_meets_the_first_anchor(tmp_path: Path) -> None:
    outs = _run(tmp_path, {"c0": 0.0, "c1": JOIN_S + 1.5}, delay=0.5)
    c0, c1 = outs["c0"], outs["c1"]
    assert [e for e in c0.events if e["event"] == "missed"]  # c0 trained before c1 came
    for o in (c0, c1):
        syncs = [e for e in o.events if e["event"] == "sync"]
        assert syncs and syncs[0]["sync"] == 1 and all(e["quorum"] == ["c0", "c1"] for e in syncs), syncs
        assert o.algo is not None and not o.algo.membership.healed_from  # nobody healed
        assert not [s for e in syncs for s in e["suspects"]]
    assert max_diff(c0.anchors, c1.anchors) == 0.0  # one anchor


def test_a_member_that_asked_once_and_then_only_heartbeats_is_waited_for_at_most_once(tmp_path: Path) -> None:
    """Item 7: a roster member asks for one quorum (alone, before anyone else came: a quorum of one), then only
    heartbeats. Before, the gate forwarded its heartbeats for `ASK_WINDOW_S` (600 s) after that request, and torchft
    waits the grace window for a heartbeating member of the previous quorum: it held the honest clusters' quorums
    (31 s measured). Now heartbeats are forwarded only while a name asks or belongs to the latest quorum answered:
    the honest pair's first quorum is the one it can hold (one join wait); after it, nothing — a later quorum whose
    membership changed (torchft's fast path does not apply) forms without waiting for it."""
    names = ["c0", "c1", "c2"]
    join = 6.0
    run = GateRun(tmp_path, names, honest=2, join_timeout_s=join).start()
    try:
        g = run.gate
        assert g is not None
        liar = run.client("c2")
        alone = liar.request(0, 1, "inproc:c2", claims()[1], 5.0)
        assert isinstance(alone, Quorum) and [m.name for m in alone.members] == ["c2"]
        assert g.taking_part("c2")  # a member of the latest quorum: its beats are forwarded (torchft's grace)
        liar.start_heartbeat()  # and it never asks again
        outs = run.train()
        assert not g.taking_part("c2") and g.asked("c2")  # asked within the window, beats no longer forwarded
        for n in ("c0", "c1"):
            syncs = [e for e in outs[n].events if e["event"] == "sync"]
            assert syncs and all(e["quorum"] == ["c0", "c1"] for e in syncs), syncs
        time.sleep(5.5)  # the honest clients stopped with their runs: torchft forgets them (heartbeat timeout 5 s)
        # c1 gone, membership changes: before, the liar's forwarded heartbeats outnumbered the lone asker and torchft
        # formed no quorum at all within the request's 30 s (FederationError)
        late = run.client("c0").request(99, 1, "inproc:c0", claims()[1], 30.0)
        assert isinstance(late, Quorum) and [m.name for m in late.members] == ["c0"]
        liar.close()
    finally:
        run.close()
