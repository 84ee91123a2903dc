"""Issue 69, item 1: the first heal. A liar (on the roster, signing with its own key) claims one sync more than it
holds, with the digest of an anchor it noised (Gaussian, each tensor's RMS) and sends that anchor when asked to
heal: a consistent lie, and no probe here to judge the anchor (the issue's run: the probe passed it, 1.7 % worse
at initialisation). Before, every cluster counted as "rejoining" at start and healed from it at sync 1: +39 % loss
at 2 clusters; at 3 clusters a fresh cluster met the liar alone (the third on its way), took its claim for a
federation that had begun, healed from it, and the two then outvoted the third. Now the first anchor is everyone's
by construction (nobody heals at sync 1: a fresh start is not rejoining), a fresh start waits for a strict majority
of the other configured clusters before it believes the federation began, and a cluster heals only to a state a
strict majority of the others holds. Over a real gate with a roster."""

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
from test_insiders_probe_heal import NoisedAhead
from toy_federation import Outcome, train_cluster

TOLERANCE = 0.02


def _run(root: Path, names: list[str], liar: bool, late: dict[str, float]) -> tuple[dict[str, Outcome], dict[str, str]]:
    """`names` train over a real gate with a roster; the last one lies (`NoisedAhead`) when `liar`; a cluster in
    `late` starts that many seconds after the others."""
    run = GateRun(root, names, honest=len(names)).start()
    keys = {n: run.creds[n].key_id(n) for n in names}
    cfg = toy_config(tuple(names))
    try:
        hub = InProcessFederation(timeout_s=30.0)
        outs = {n: Outcome() for n in names}
        transports: dict[str, Any] = {
            n: LaneTransport(n, RankGroup(), Lanes(lambda n=n: ThreadGroup(hub, n)), True, run.client(n),
                             f"inproc:{n}", key=KEY, quorum_timeout_s=30.0, connect_timeout_s=10.0) for n in names}
        if liar:
            transports[names[-1]] = NoisedAhead(transports[names[-1]], lambda: outs[names[-1]].algo)

        def one(i: int, n: str) -> Outcome:
            time.sleep(late.get(n, 0.0))
            return train_cluster(i, transports[n], cfg, out=outs[n])

        return run_threads({n: (lambda i=i, n=n: one(i, n)) for i, n in enumerate(names)}), keys
    finally:
        run.close()


@pytest.mark.parametrize("n", [2, 3], ids=["2 clusters", "3 clusters"])
def test_nobody_heals_from_one_member_at_the_start(tmp_path: Path, caplog: pytest.LogCaptureFixture, n: int) -> None:
    names = [f"c{i}" for i in range(n)]
    liar, honest = names[-1], names[:-1]
    late = {"c1": GateRun.join_timeout_s + 1.0} if n == 3 else {}  # c0 meets the liar first, c1 on its way
    clean, _ = _run(tmp_path / "clean", names, False, late)
    with caplog.at_level(logging.WARNING):
        outs, keys = _run(tmp_path / "lied", names, True, late)
    for name in honest:
        o = outs[name]
        assert o.algo is not None and o.algo.membership.healed_from == [], (name, o.algo.membership.healed_from)
        assert o.steps == TOTAL, (name, o.steps)
        syncs = [e for e in o.events if e["event"] == "sync"]
        assert len(syncs) == SYNCS and all(e["quorum"] == names for e in syncs), (name, syncs)
        named = {s["key"] for e in syncs for s in e.get("suspects", [])}
        assert named <= {keys[liar]}, (name, named)
        loss, base = final_loss(o, 0), final_loss(clean[name], 0)
        assert abs(loss - base) <= TOLERANCE * base, (name, loss, base)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(tuple(f"cluster {h}:" for h in honest))]
    assert any(f"cluster {liar}" in x and f"roster key {keys[liar]}" in x for x in said), said[-20:]
    assert all("\n" not in x for x in said)
    assert not [x for x in said for h in honest if f"roster key {keys[h]}" in x], said  # no honest cluster named
