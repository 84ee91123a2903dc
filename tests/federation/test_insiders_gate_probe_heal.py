"""Issue 49 (a): the probe-score lie and the heal-tie lie over a real gate with a roster (torchft's Lighthouse
behind `federation.gate`, every request and member record signed), as `test_insiders_votes.py` runs the other
lies; `test_insiders_probe_heal.py` has them in process.

* probe scores (2 and 3 clusters): the last cluster scores every other cluster's update +1000 % in every norm
  exchange; the honest clusters weigh in every sync, train all their steps, end within 2 % of the run in which
  the liar tells the truth, and a log line names the liar's roster key;
* heal tie (2 clusters, the issue's table): the liar claims one sync ahead with a noised anchor and its own
  matching digest; the honest cluster never heals from it, trains all its steps, ends within 2 % of the clean
  run, and a log line names the liar's roster key.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edit_train.cluster.group import RankGroup
from edit_train.federation.inproc import InProcessFederation, ThreadGroup
from edit_train.federation.lanes import Lanes
from edit_train.federation.transport import LaneTransport
from edit_train.local_sgd.sync.algorithms import LocalSGDConfig
from liar_utils import KEY, SYNCS, TOTAL, GateRun, final_loss, run_threads, toy_config
from test_insiders_probe_heal import NoisedAhead, ProbeLiar
from toy_federation import Outcome, train_cluster

TOLERANCE = 0.02


def _probe_config(names: tuple[str, ...]) -> LocalSGDConfig:
    cfg = toy_config(names, rule="verified")
    verified = dataclasses.replace(cfg.rule.verified, probe_tokens=8)
    return dataclasses.replace(cfg, rule=dataclasses.replace(cfg.rule, verified=verified))


def gate_federation(root: Path, names: list[str], cfg: LocalSGDConfig,
                    liar: Callable[[Any, Callable[[], Any]], Any] | None,
                    keys: dict[str, str] | None = None, first_late_s: float = 0.0) -> dict[str, Outcome]:
    """`names` train the toy model, each a thread, over a real gate with a roster (lanes over the in-process
    hub's threads); the last one's transport is `liar(transport, its algorithm)` when given. Every cluster
    scores the others' updates on its own held-out batch (`probe`). `keys` gets each cluster's roster key id.
    The first cluster starts `first_late_s` after the others."""
    run = GateRun(root, names, honest=len(names)).start()
    if keys is not None:
        keys.update({n: run.creds[n].key_id(n) for n in names})
    try:
        hub = InProcessFederation(timeout_s=30.0)
        outs = {n: Outcome() for n in names}
        transports: dict[str, Any] = {
            n: LaneTransport(n, RankGroup(), Lanes(lambda n=n: ThreadGroup(hub, n)), True, run.client(n),
                             f"inproc:{n}", key=KEY, quorum_timeout_s=30.0, connect_timeout_s=10.0) for n in names}
        if liar is not None:
            transports[names[-1]] = liar(transports[names[-1]], lambda: outs[names[-1]].algo)

        def one(i: int, n: str) -> Outcome:
            time.sleep(first_late_s if i == 0 else 0.0)
            return train_cluster(i, transports[n], cfg, out=outs[n], probe=True)

        return run_threads({n: (lambda i=i, n=n: one(i, n)) for i, n in enumerate(names)})
    finally:
        run.close()


def _one_line(records: list[logging.LogRecord], key: str, *needles: str) -> str:
    """The one line that names the liar by the roster key that signed its records (and says `needles`)."""
    assert key
    lines = [r.getMessage() for r in records if f"roster key {key}" in r.getMessage()
             and all(s in r.getMessage() for s in needles)]
    assert lines and all("\n" not in x for x in lines), [r.getMessage() for r in records][-20:]
    return lines[0]


def _every_sync_every_step(o: Outcome, names: list[str], name: str) -> list[dict[str, Any]]:
    assert o.steps == TOTAL, (name, o.steps)
    syncs = [e for e in o.events if e["event"] == "sync"]
    assert len(syncs) == SYNCS and all(e["quorum"] == names for e in syncs), (name, syncs)
    return syncs


@pytest.mark.parametrize("n", [2, 3], ids=["2 clusters", "3 clusters"])
def test_probe_scores_of_one_evaluator_flag_nobody_over_a_gate(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                n: int) -> None:
    names = [f"c{i}" for i in range(n)]
    liar = names[-1]
    cfg = _probe_config(tuple(names))
    clean = gate_federation(tmp_path / "clean", names, cfg, None)
    with caplog.at_level(logging.WARNING):
        lied = gate_federation(tmp_path / "lied", names, cfg, ProbeLiar, keys := {})
    for name in names[:-1]:
        syncs = _every_sync_every_step(lied[name], names, name)
        assert all(e["weight"] > 0 and not e["anomalous"] for e in syncs), [(e["weight"], e["anomalous"])
                                                                              for e in syncs]
        loss, base = final_loss(lied[name], 0), final_loss(clean[name], 0)
        assert abs(loss - base) <= TOLERANCE * base, (name, loss, base)
    _one_line(caplog.records, keys[liar], f"cluster {liar} sent probe scores", "not counted")


def test_a_two_cluster_heal_tie_keeps_what_you_have_over_a_gate(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    names = ["c0", "c1"]
    cfg = _probe_config(tuple(names))
    clean = gate_federation(tmp_path / "clean", names, cfg, None)
    with caplog.at_level(logging.WARNING):
        lied = gate_federation(tmp_path / "lied", names, cfg, NoisedAhead, keys := {})
    o = lied["c0"]
    assert o.algo is not None and o.algo.membership.healed_from == [], o.algo.membership.healed_from
    _every_sync_every_step(o, names, "c0")
    loss, base = final_loss(o, 0), final_loss(clean["c0"], 0)
    assert abs(loss - base) <= TOLERANCE * base, (loss, base)
    _one_line(caplog.records, keys["c1"], "cluster c0: kept its own state", "cluster c1's sync")


def test_a_liar_alone_at_start_waits_for_the_roster_like_anyone(tmp_path: Path) -> None:
    """c0 starts past the gate's join timeout, so the liar's first quorum holds only itself, and as it claims one
    sync ahead that quorum's agreed sync is 1. Before, a fresh start judged "the federation has begun" by that
    agreed sync: the liar trained its first interval alone, c0 met it with no step taken, weighed 0 in the
    first sync and skipped its first interval (+3.7 % loss; one CI run in six met this by chance). Now only
    another member's anchor says the federation has begun: both meet at step 0, c0 weighs in every sync and
    ends where it ends when both start together."""
    names = ["c0", "c1"]
    cfg = _probe_config(tuple(names))
    together = gate_federation(tmp_path / "together", names, cfg, NoisedAhead)
    late = gate_federation(tmp_path / "late", names, cfg, NoisedAhead, first_late_s=GateRun.join_timeout_s + 1.0)
    o = late["c0"]
    assert o.algo is not None and o.algo.membership.healed_from == [], o.algo.membership.healed_from
    syncs = _every_sync_every_step(o, names, "c0")
    assert all(e["local_steps"] > 0 and e["weight"] > 0 for e in syncs), [(e["local_steps"], e["weight"])
                                                                          for e in syncs]
    assert final_loss(o, 0) == pytest.approx(final_loss(together["c0"], 0), rel=1e-6)
