"""Issue 69, item 2: claimed steps buy weight. A liar (on the roster, signing with its own key) claims 4x its local
steps in every norm exchange, tokens to match, and sends 15x its Δ (its reported norms to match). Under the verified
rule a cluster weighs by its tokens, capped at local steps x tokens per step — and the local steps were the liar's
own claim: it weighed 0.8 against the honest 0.2 (+27.7 % loss in the issue's run). Now, under a step schedule, a
member's local steps are bounded by what the sync count lets anyone have taken since the anchor (every member at the
agreed anchor took what the receiver took): the claim buys nothing, and the liar is named by its roster key. (Under
a time schedule a cluster's speed is its own word: docs/security.md has what that still buys.) Over a real gate."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from edit_train.cluster.group import RankGroup
from edit_train.federation.inproc import InProcessFederation, ThreadGroup
from edit_train.federation.lanes import Lanes
from edit_train.federation.transport import LaneTransport
from edit_train.local_sgd.sync.judge import EXTRA
from liar_utils import KEY, SYNCS, TOTAL, GateRun, final_loss, run_threads, toy_config
from toy_federation import Outcome, train_cluster, units_of, toy_model

TOLERANCE = 0.02
CLAIM, SCALE = 4.0, 15.0


class ClaimsMore:
    """Claims CLAIM x its local steps and tokens in every norm exchange, and sends SCALE x its Δ (norms to match)."""

    def __init__(self, inner: Any, _step: Any) -> None:
        self.inner, self.lied = inner, 0
        self.units = len(units_of(toy_model()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_gather(self, vec: torch.Tensor, what: str = "") -> Any:
        if what == "norm exchange":
            n = self.units
            vec = vec.clone()
            vec[:n] *= SCALE ** 2
            for col in ("local_steps", "tokens"):
                vec[n + 1 + EXTRA.index(col)] *= CLAIM
            self.lied += 1
        return self.inner.all_gather(vec, what)

    def gather(self, tensors: list[torch.Tensor], *a: Any, **kw: Any) -> Any:
        return self.inner.gather([t * SCALE for t in tensors], *a, **kw)

    def reduce_(self, tensors: list[torch.Tensor], *a: Any, **kw: Any) -> Any:
        for t in tensors:
            t.mul_(SCALE)
        return self.inner.reduce_(tensors, *a, **kw)


def _run(root: Path, names: list[str], liar: bool) -> tuple[dict[str, Outcome], dict[str, str]]:
    run = GateRun(root, names, honest=len(names)).start()
    keys = {n: run.creds[n].key_id(n) for n in names}
    cfg = toy_config(tuple(names), rule="verified")
    try:
        hub = InProcessFederation(timeout_s=30.0)
        transports: dict[str, Any] = {
            n: LaneTransport(n, RankGroup(), Lanes(lambda n=n: ThreadGroup(hub, n)), True, run.client(n),
                             f"inproc:{n}", key=KEY, quorum_timeout_s=30.0, connect_timeout_s=10.0) for n in names}
        wraps = {names[-1]: ClaimsMore} if liar else {}
        return run_threads({n: (lambda i=i, n=n: train_cluster(i, transports[n], cfg, wrap=wraps.get(n)))
                            for i, n in enumerate(names)}), keys
    finally:
        run.close()


@pytest.mark.parametrize("n", [2, 3], ids=["2 clusters", "3 clusters"])
def test_claimed_steps_buy_no_weight(tmp_path: Path, caplog: pytest.LogCaptureFixture, n: int) -> None:
    names = [f"c{i}" for i in range(n)]
    liar, honest = names[-1], names[:-1]
    clean, _ = _run(tmp_path / "clean", names, False)
    with caplog.at_level(logging.WARNING):
        outs, keys = _run(tmp_path / "lied", names, True)
    for name in honest:
        o = outs[name]
        assert o.steps == TOTAL, (name, o.steps)
        syncs = [e for e in o.events if e["event"] == "sync"]
        assert len(syncs) == SYNCS and all(e["quorum"] == names for e in syncs), (name, syncs)
        named = {s["key"] for e in syncs for s in e.get("suspects", [])}
        assert keys[liar] in named and named <= {keys[liar]}, (name, named)
        loss, base = final_loss(o, 0), final_loss(clean[name], 0)
        assert abs(loss - base) <= TOLERANCE * base, (name, loss, base)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(tuple(f"cluster {h}:" for h in honest))]
    assert any(f"cluster {liar} claims" in x and "local steps" in x and f"roster key {keys[liar]}" in x for x in said), \
        said[-20:]
    assert not [x for x in said for h in honest if f"roster key {keys[h]}" in x], said  # no honest cluster named
