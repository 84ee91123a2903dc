"""Issue 69, item 7: a member that votes commit and then rolls its own state back (its anchor, its outer optimizer's
momentum and its parameters as they were when the sync began) before it asks for the next quorum. It then claims
the new sync with the very anchor digest it claimed at the last one: a committed sync with contributions moves every
member's anchor, and honest clusters on devices that round differently hold other digests, but never the one they
held before — so it is named by its roster key (`Membership._name_rolled_back`), with 2 and 3 clusters, and its
update counts for nothing from then on (its Δ is from another anchor). Three clusters: the honest pair ends no worse
than 2 % above the run in which it tells the truth (its data no longer counts; the toy's loss is the honest tasks',
so the pair ends lower). Two clusters: the honest cluster trains on its own from the second sync, which costs what
the liar's data was worth — less than believing it, and no more than the liar's absence: within 2 % of the honest
cluster training alone (issue 69's "within 2 % of the clean loss" cannot hold here: the clean loss has the liar's
data, and its updates, from another anchor, cannot count — docs/security.md). Over a real gate with a roster."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from edit_train.cluster.group import RankGroup
from edit_train.federation.inproc import InProcessFederation, ThreadGroup
from edit_train.federation.lanes import Lanes
from edit_train.federation.transport import LaneTransport
from edit_train.local_sgd.sync.membership import Membership
from liar_utils import KEY, SYNCS, GateRun, final_loss, run_threads, toy_config
from toy_federation import Outcome, max_diff, train_cluster

TOLERANCE = 0.02


class RollsBack:
    """Honest in every exchange and vote; after each sync it restores the state it held when the sync began."""

    def __init__(self, inner: LaneTransport, out: Outcome) -> None:
        self.inner, self.out, self.saved, self.rolled = inner, out, None, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_gather(self, vec: Tensor, what: str = "norm exchange") -> Any:
        algo = self.out.algo
        if what == "norm exchange" and algo is not None and algo.driver is not None:
            outer = algo.driver.core.outer
            self.saved = ({k: [a.clone() for a in v] for k, v in outer.anchors.items()},
                          [p.detach().clone() for p in algo.replica.model.parameters()],
                          {k: _clone(o.state_dict()) for k, o in outer.optimizers.items()})
        return self.inner.all_gather(vec, what)

    def form_start(self, sync: int, data: dict[str, Any], vet: Any = None) -> None:
        algo = self.out.algo
        if self.saved is not None and algo is not None and algo.driver is not None:
            anchors, params, states = self.saved
            outer = algo.driver.core.outer
            with torch.no_grad():
                for k, v in anchors.items():
                    for a, s in zip(outer.anchors[k], v):
                        a.copy_(s)
                for p, s in zip(algo.replica.model.parameters(), params):
                    p.copy_(s)
            for k, st in states.items():
                outer.optimizers[k].load_state_dict(st)
            self.saved, self.rolled = None, self.rolled + 1
            data = {**data, "anchor": algo.membership.digest()}
        self.inner.form_start(sync, data, vet)


def _clone(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def _run(root: Path, names: list[str], liar: bool) -> tuple[dict[str, Outcome], dict[str, str], int]:
    run = GateRun(root, names, honest=len(names)).start()
    keys = {n: run.creds[n].key_id(n) for n in names}
    cfg = toy_config(tuple(names))
    outs = {n: Outcome() for n in names}
    try:
        hub = InProcessFederation(timeout_s=30.0)
        transports: dict[str, Any] = {
            n: LaneTransport(n, RankGroup(), Lanes(lambda n=n: ThreadGroup(hub, n)), True, run.client(n),
                             f"inproc:{n}", key=KEY, quorum_timeout_s=30.0, connect_timeout_s=10.0) for n in names}
        if liar:
            transports[names[-1]] = RollsBack(transports[names[-1]], outs[names[-1]])
        res = run_threads({n: (lambda i=i, n=n: train_cluster(i, transports[n], cfg, out=outs[n]))
                           for i, n in enumerate(names)})
        return res, keys, getattr(transports[names[-1]], "rolled", 0)
    finally:
        run.close()


@pytest.mark.parametrize("n", [2, 3], ids=["2 clusters", "3 clusters"])
def test_a_member_that_rolls_back_a_committed_sync_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    names = [f"c{i}" for i in range(n)]
    liar, honest = names[-1], names[:-1]
    clean, _, _ = _run(tmp_path / "clean", names, False)
    with monkeypatch.context() as m:  # what believing it cost (fe89eed): nobody tells the rollback apart
        m.setattr(Membership, "_name_rolled_back", lambda self, q: None)
        believed, _, _ = _run(tmp_path / "believed", names, True)
    with caplog.at_level(logging.WARNING):
        outs, keys, rolled = _run(tmp_path / "lied", names, True)
    assert rolled >= SYNCS - 1
    for name in honest:
        o = outs[name]
        syncs = [e for e in o.events if e["event"] == "sync"]
        assert len(syncs) >= SYNCS, (name, syncs)
        named = {s["key"] for e in o.events if e["event"] in ("sync", "sync_aborted") for s in e.get("suspects", [])}
        assert keys[liar] in named and named <= {keys[liar]}, (name, named)
        loss, base, before = final_loss(o, 0), final_loss(clean[name], 0), final_loss(believed[name], 0)
        assert loss < before, (name, loss, before)
        if n > 2:
            assert loss <= (1 + TOLERANCE) * base, (name, loss, base)
        else:  # its updates cannot count (counted, measured: 1.082x the clean run, as believing it); the honest
            # cluster pays no more than the liar's absence would cost: 1.045x clean where training alone is 1.102x
            alone, _, _ = _run(tmp_path / "alone", [name], False)
            assert loss <= (1 + TOLERANCE) * final_loss(alone[name], 0), (name, loss, final_loss(alone[name], 0))
    if n > 2:
        assert max_diff(outs[honest[0]].anchors, outs[honest[1]].anchors) == 0.0  # the honest decide alike
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(tuple(f"cluster {h}:" for h in honest))]
    assert any(f"cluster {liar} " in x and "rolled back" in x and f"roster key {keys[liar]}" in x for x in said), \
        said[-20:]
    assert not [x for x in said for h in honest if f"roster key {keys[h]}" in x], said  # no honest cluster named


def test_an_honest_federation_names_no_rollback(tmp_path: Path) -> None:
    """Every honest member's anchor moves at every committed sync: nobody is named, with 3 clusters."""
    outs, _, _ = _run(tmp_path, ["c0", "c1", "c2"], False)
    for o in outs.values():
        assert not [s for e in o.events if e["event"] == "sync" for s in e["suspects"]]
