"""An insider's lies within range (issue 49, part A): one cluster on the roster, holding its own identity and the
federation key, trains beside the honest ones over a real gate (torchft's Lighthouse behind `federation.gate`,
every request signed) and lies in what the terms allow: a stop vote at every norm exchange, a claim of
`total_steps = train.steps` (the roster's own bound), a claim of 10^12 tokens, a consistent 10x payload (its
reported norms match what it sends), a "no" at every commit vote. With 2 clusters (one honest) and 3 (two
honest), the honest clusters train all their steps, join every sync the liar cannot stop, end within 2 % of
the run in which the liar tells the truth, and a log line names the liar and the roster key that signed it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from edit_train.cluster.group import RankGroup
from edit_train.federation.inproc import InProcessFederation, ThreadGroup
from edit_train.federation.lanes import Lanes
from edit_train.federation.transport import LaneTransport
from edit_train.local_sgd.sync.round import EXTRA
from edit_train.sim import byzantine
from liar_utils import KEY, SYNCS, TOTAL, GateRun, final_loss, run_threads, toy_config
from toy_federation import Outcome, max_diff, train_cluster

UNITS = 3  # the toy model's units: the norm exchange starts with their ‖Δ‖², then the round marker, then EXTRA
TOLERANCE = 0.02


class LyingMember:
    """A training cluster's transport that lies (`lie`) and is otherwise honest."""

    def __init__(self, inner: LaneTransport, lie: str) -> None:
        self.inner, self.lie = inner, lie

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def form_start(self, sync: int, data: dict[str, Any], vet: Callable[..., Any] | None = None) -> None:
        if self.lie == "total_steps":
            data = {**data, "total_steps": TOTAL}
        self.inner.form_start(sync, data, vet)

    def all_gather(self, vec: Tensor, what: str = "norm exchange") -> Any:
        if what == "norm exchange":
            vec = vec.clone()
            extra = UNITS + 1
            if self.lie == "stop":
                vec[extra + EXTRA.index("stop_vote")] = 1.0
            elif self.lie == "tokens":
                vec[extra + EXTRA.index("tokens")] = 1e12
            elif self.lie == "scale":  # it reports the norms of what it sends: 10x
                vec[:UNITS] *= 100.0
        return self.inner.all_gather(vec, what)

    def vote(self, ok: bool) -> Any:
        return self.inner.vote(False if self.lie == "veto" else ok)

    def reduce_(self, tensors: list[Tensor], params: list[Tensor] | None = None, key: str = "", **kw: Any) -> Any:
        if self.lie != "scale":
            return self.inner.reduce_(tensors, params, key, **kw)
        sent = [10.0 * t for t in tensors]
        return _Into(self.inner.reduce_(sent, params, key, **kw), sent, tensors)

    def gather(self, tensors: list[Tensor], params: list[Tensor] | None = None, key: str = "", **kw: Any) -> Any:
        return self.inner.gather([10.0 * t for t in tensors] if self.lie == "scale" else tensors, params, key, **kw)


_Into = byzantine._Into  # a SUM that ran on the liar's copies: the result goes back into its tensors


def federation(root: Path, clusters: int, lie: str | None, rule: str = "edit_norm", late: float = 0.0,
               ) -> dict[str, Outcome]:
    """`clusters` clusters train the toy model over a gate with a roster; the last one lies (`lie`, or None);
    with 3, c1 starts `late` seconds after the others (the first quorum the others see lacks it)."""
    names = [f"c{i}" for i in range(clusters)]
    run = GateRun(root, names, honest=clusters).start()
    try:
        hub = InProcessFederation(timeout_s=30.0)
        cfg = toy_config(tuple(names), rule)
        transports: dict[str, Any] = {
            n: LaneTransport(n, RankGroup(), Lanes(lambda n=n: ThreadGroup(hub, n)), True, run.client(n),
                             f"inproc:{n}", key=KEY, quorum_timeout_s=30.0, connect_timeout_s=10.0) for n in names}
        if lie is not None:
            transports[names[-1]] = LyingMember(transports[names[-1]], lie)

        def job(i: int, n: str) -> Callable[[], Outcome]:
            def go() -> Outcome:
                if n == "c1" and clusters > 2:
                    time.sleep(late)
                return train_cluster(i, transports[n], cfg)
            return go

        return run_threads({n: job(i, n) for i, n in enumerate(names)})
    finally:
        run.close()


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, float]]:
    """Every honest cluster's final loss when nobody lies, with 2 and with 3 clusters."""
    out = {}
    for n in (2, 3):
        outs = federation(tmp_path_factory.mktemp(f"clean{n}"), n, None)
        out[n] = {f"c{i}": final_loss(outs[f"c{i}"], i) for i in range(n - 1)}
    return out


def _named(records: list[logging.LogRecord], liar: str, *needles: str) -> str:
    """The one line that names the liar and its roster key (and says `needles`)."""
    lines = [r.getMessage() for r in records
             if f"cluster {liar} " in r.getMessage() and "roster key" in r.getMessage()
             and all(s in r.getMessage() for s in needles)]
    assert lines and all("\n" not in x for x in lines), [r.getMessage() for r in records][-20:]
    return lines[0]


def _honest_unharmed(outs: dict[str, Outcome], clean: dict[str, float], liar: str, syncs_with_liar: bool) -> None:
    honest = sorted(n for n in outs if n != liar)
    for i, n in enumerate(honest):
        o = outs[n]
        assert o.steps == TOTAL, (n, o.steps)
        syncs = [e for e in o.events if e["event"] == "sync"]
        assert len(syncs) == SYNCS, [e for e in o.events if e["event"] in ("sync", "sync_aborted", "missed")]
        assert all(set(honest) <= set(e["quorum"]) for e in syncs), syncs
        if syncs_with_liar:
            assert all(liar in e["quorum"] for e in syncs), syncs
        loss = final_loss(o, i)
        assert abs(loss - clean[n]) <= TOLERANCE * clean[n], (n, loss, clean[n])
    if len(honest) > 1:
        assert max_diff(outs[honest[0]].anchors, outs[honest[1]].anchors) == 0.0
    named = [s for n in honest for e in outs[n].events if e["event"] in ("sync", "sync_aborted")
             for s in e.get("suspects", [])]
    assert named and all(s["cluster"] == liar and len(s["key"]) == 12 for s in named), named


@pytest.mark.parametrize("clusters", [2, 3])
def test_a_stop_vote_at_every_exchange_stops_nobody(tmp_path: Path, clean: dict[int, dict[str, float]],
                                                    caplog: pytest.LogCaptureFixture, clusters: int) -> None:
    """A step schedule ends at train.steps: the liar's vote at every norm exchange is not followed (today any
    one vote stops everyone at the first sync)."""
    with caplog.at_level(logging.WARNING):
        outs = federation(tmp_path, clusters, "stop")
    liar = f"c{clusters - 1}"
    _honest_unharmed(outs, clean[clusters], liar, syncs_with_liar=True)
    _named(caplog.records, liar, "voted to stop", "not followed")


@pytest.mark.parametrize("clusters", [2, 3])
def test_a_claim_of_the_whole_run_moves_nobody(tmp_path: Path, clean: dict[int, dict[str, float]],
                                               caplog: pytest.LogCaptureFixture, clusters: int) -> None:
    """total_steps = train.steps (within the roster's bound): no honest cluster adopts it, not even from a
    start-up quorum asked again for because c1 was not in it yet (today every cluster trains 0 steps)."""
    with caplog.at_level(logging.WARNING):
        outs = federation(tmp_path, clusters, "total_steps", late=1.5)
    liar = f"c{clusters - 1}"
    # the liar may be held to its own bounded claim (asking alone first, it takes one interval's steps it did
    # not train): then it syncs an interval ahead of the honest, who still join every sync
    _honest_unharmed(outs, clean[clusters], liar, syncs_with_liar=False)
    _named(caplog.records, liar, f"claims total_steps = {TOTAL}", "bounded")


@pytest.mark.parametrize("clusters", [2, 3])
def test_a_claim_of_a_trillion_tokens_weighs_its_steps(tmp_path: Path, clean: dict[int, dict[str, float]],
                                                       caplog: pytest.LogCaptureFixture, clusters: int) -> None:
    """10^12 claimed tokens weigh what its local steps can hold (the verified rule weighs by tokens; today the
    liar takes the 8x cap's share of the weight)."""
    with caplog.at_level(logging.WARNING):
        outs = federation(tmp_path, clusters, "tokens", rule="verified")
    liar = f"c{clusters - 1}"
    _honest_unharmed(outs, clean_verified(tmp_path, clusters), liar, syncs_with_liar=True)
    _named(caplog.records, liar, "claims 1e+12 tokens", "bounded")


_VERIFIED: dict[int, dict[str, float]] = {}


def clean_verified(tmp_path: Path, clusters: int) -> dict[str, float]:
    if clusters not in _VERIFIED:
        outs = federation(tmp_path / "clean", clusters, None, rule="verified")
        _VERIFIED[clusters] = {f"c{i}": final_loss(outs[f"c{i}"], i) for i in range(clusters - 1)}
    return _VERIFIED[clusters]


@pytest.mark.parametrize("clusters", [2, 3])
def test_a_consistent_tenfold_payload_counts_for_the_bound_from_the_first_sync(
        tmp_path: Path, clean: dict[int, dict[str, float]], caplog: pytest.LogCaptureFixture, clusters: int) -> None:
    """The liar sends 10x its pseudo-gradient and reports the norms of what it sends (the verified rule, whose
    norm test is off for its warm-up of 10 syncs): from sync 1, being over `scale_bound` times the quorum's
    median norm per lr-weighted step, it counts as the median (today +11 % / +14 % loss here)."""
    with caplog.at_level(logging.WARNING):
        outs = federation(tmp_path, clusters, "scale", rule="verified")
    liar = f"c{clusters - 1}"
    _honest_unharmed(outs, clean_verified(tmp_path, clusters), liar, syncs_with_liar=True)
    _named(caplog.records, liar, "times the quorum's median norm", "it counts as the median's size")


def test_a_veto_at_every_sync_is_outvoted_by_a_majority(tmp_path: Path, clean: dict[int, dict[str, float]],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """c2 votes no at every commit vote: the two honest clusters are a strict majority of three and commit every
    sync without it (today nothing commits: 0 syncs joined)."""
    with caplog.at_level(logging.WARNING):
        outs = federation(tmp_path, 3, "veto")
    _honest_unharmed(outs, clean[3], "c2", syncs_with_liar=True)
    _named(caplog.records, "c2", "voted no at sync", "committed without it")


def test_with_two_clusters_a_veto_is_a_tie_that_keeps_what_you_have(tmp_path: Path, clean: dict[int, dict[str, float]],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """c1 votes no at every commit vote: one "no" of two is no strict majority, so the honest cluster commits every
    sync (a tie keeps what you have), ends within 2 % of the clean loss and names the vetoer (before: every sync
    rolled back, the honest cluster trained alone, +11 % loss)."""
    with caplog.at_level(logging.WARNING):
        outs = federation(tmp_path, 2, "veto")
    _honest_unharmed(outs, clean[2], "c1", syncs_with_liar=True)
    assert not [e for e in outs["c0"].events if e["event"] == "sync_aborted"]
    _named(caplog.records, "c1", "voted no at sync", "committed without it")


# ---------------------------------------------------------------- the stop under a time schedule or budget
class _Lone:
    size, device = 1, "cpu"


def _votes(*rows: tuple[float, float]) -> Tensor:
    """Exchange rows [local_steps, s/step, total_steps, stop vote] from (total_steps, vote) pairs."""
    return torch.tensor([[4.0, 0.1, total, vote] for total, vote in rows], dtype=torch.float64)


def test_under_a_time_schedule_no_vote_ends_the_run_before_its_syncs() -> None:
    """A-EDiT's run is its syncs (`pacer.run_syncs`, counted by every cluster itself; tests/local_sgd/test_insiders_a_edit.py
    runs it): a vote, or a count at train.steps, from any number of members is not followed, and named."""
    from edit_train.local_sgd.sync.pacer import PaceConfig, Pacer
    from edit_train.local_sgd.sync.schedule import ScheduleConfig

    p = Pacer(PaceConfig(ScheduleConfig(kind="time", sync_time_s=0.4, interval=10), total_steps=100), _Lone())  # type: ignore[arg-type]
    why = "a time schedule ends at its run's syncs, which every cluster counts itself"
    assert p.exchanged(_votes((10, 0), (100, 1), (100, 1)), 0, False, 3) == {1: why, 2: why} and not p.stopped
    assert p.exchanged(_votes((10, 0), (10, 0), (10, 0)), 0, False, 10) == {} and p.stopped


def test_under_a_time_budget_votes_count_only_near_this_clusters_own_clock() -> None:
    from edit_train.local_sgd.sync.pacer import PaceConfig, Pacer
    from edit_train.local_sgd.sync.schedule import ScheduleConfig

    p = Pacer(PaceConfig(ScheduleConfig(interval=4), total_steps=100, time_budget_s=3600.0), _Lone())  # type: ignore[arg-type]
    stop, ignored = p.stop_votes(_votes((8, 0), (8, 1), (8, 1)), 0)
    assert not stop and "not near the time budget" in ignored[1]  # an hour to go here: two liars cannot stop it
    p._t0 -= 3600.0  # this cluster's own clock reaches the budget
    assert p.stop_votes(_votes((8, 0), (8, 1), (8, 1)), 0) == (True, {})
    assert p.stop_votes(_votes((8, 0), (8, 1)), 0)[0] is False  # one of two is no strict majority


def test_under_a_step_schedule_no_vote_stops_anyone() -> None:
    from edit_train.local_sgd.sync.pacer import PaceConfig, Pacer
    from edit_train.local_sgd.sync.schedule import ScheduleConfig

    p = Pacer(PaceConfig(ScheduleConfig(interval=4), total_steps=100), _Lone())  # type: ignore[arg-type]
    assert p.exchanged(_votes((8, 1), (8, 1), (8, 1)), 0, False) == {1: "a step schedule ends at train.steps",
                                                                      2: "a step schedule ends at train.steps"}
    assert not p.stopped and not p.should_stop(99) and p.should_stop(100)
