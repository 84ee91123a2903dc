"""Issue 69, item 5: a stalled collective. A member on the roster joins every quorum and its lanes, then sleeps past
the collective deadline before its norm exchange. Before, no sync completed (0 of 8 in the issue's run), the staller
was not named, and the honest clusters named each other for a `total_steps` claim (the steps a lost sync leaves
past what the sync count implies). Now each leader marks its arrival at a small exchange (one byte to every other
leader, `LaneTransport._mark`): when the exchange fails, the members whose mark never came are named by roster key
(the log line, the `sync_aborted` reason and the suspects of the next event) and left out of the next quorums as a
silent store is; no honest cluster is named. Over a real gate with a roster; lanes over the in-process hub, whose
deadline (`timeout_s`) stands for `federation.collective_timeout_s`."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from edit_train.cluster.group import RankGroup
from edit_train.federation.inproc import InProcessFederation, ThreadGroup
from edit_train.federation.lanes import Lanes
from edit_train.federation.transport import LaneTransport
from liar_utils import KEY, SYNCS, TOTAL, GateRun, final_loss, run_threads, toy_config
from toy_federation import Outcome, train_cluster

DEADLINE_S = 2.0  # the lanes' collective deadline here


class Staller:
    """Joins the quorum and the lanes, then sleeps past the deadline before every norm exchange."""

    def __init__(self, inner: Any, _step: Any) -> None:
        self.inner, self.stalled = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_gather(self, vec: Any, what: str = "") -> Any:
        if what == "norm exchange":
            self.stalled += 1
            time.sleep(DEADLINE_S * 1.5)
        return self.inner.all_gather(vec, what)


def _run(root: Path, names: list[str], staller: str | None) -> tuple[dict[str, Outcome], dict[str, str]]:
    run = GateRun(root, names, honest=len(names)).start()
    keys = {n: run.creds[n].key_id(n) for n in names}
    cfg = toy_config(tuple(names))
    try:
        hub = InProcessFederation(timeout_s=DEADLINE_S)
        transports: dict[str, Any] = {
            n: LaneTransport(n, RankGroup(), Lanes(lambda n=n: ThreadGroup(hub, n)), True, run.client(n),
                             f"inproc:{n}", key=KEY, quorum_timeout_s=30.0, connect_timeout_s=DEADLINE_S)
            for n in names}
        return run_threads({n: (lambda i=i, n=n: train_cluster(i, transports[n], cfg,
                                                               wrap=Staller if n == staller else None))
                            for i, n in enumerate(names)}), keys
    finally:
        run.close()


# the default suite's 20-minute budget (CI: 1,246 s at the last stop): the 3-cluster case, which has a majority to
# judge by, stays in it
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3], ids=["2 clusters", "3 clusters"])
def test_a_member_that_stalls_the_norm_exchange_is_named_and_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                      n: int) -> None:
    names = [f"c{i}" for i in range(n)]
    staller, honest = names[-1], names[:-1]
    alone, _ = _run(tmp_path / "honest", honest, None)  # the honest clusters' run without the staller
    with caplog.at_level(logging.WARNING):
        outs, keys = _run(tmp_path / "stalled", names, staller)
    for name in honest:
        o = outs[name]
        assert o.steps == TOTAL, (name, o.steps)
        syncs = [e for e in o.events if e["event"] == "sync"]
        lost = [e for e in o.events if e["event"] == "sync_aborted"]
        # at most the first two syncs lost; every later one without the staller
        assert len(lost) <= 2 and len(syncs) >= SYNCS - 2 and all(staller not in e["quorum"] for e in syncs), \
            (name, syncs, lost)
        assert lost and f"roster key {keys[staller]}" in lost[0]["reason"], lost
        named = {s["key"] for e in [*syncs, *lost] for s in e.get("suspects", [])}
        assert keys[staller] in named and named <= {keys[staller]}, (name, named)
        if n == 3:
            assert all(e["quorum"] == honest for e in syncs), syncs
        # the lost first sync is the staller's whole cost: its interval goes into the next one (in 4 syncs of this
        # toy +3.3 % at 2 clusters, +5.7 % at 3 against the honest clusters' run without the staller: a lost sync's
        # cost, not a bound's; docs/security.md)
        assert final_loss(o, 0) < final_loss(alone[name], 0) * 1.10, name
    if n == 3:
        a, b = (outs[h].anchors for h in honest)
        assert all(bool((x == y).all()) for ua, ub in zip(a, b) for x, y in zip(ua, ub))  # the honest synced on
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(tuple(f"cluster {h}:" for h in honest))]
    assert any(f"cluster {staller} never came" in x and f"roster key {keys[staller]}" in x for x in said), said[-20:]
    assert not [x for x in said for h in honest if f"roster key {keys[h]}" in x], said  # no honest cluster named
