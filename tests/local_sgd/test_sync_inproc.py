"""Whole sync rounds in one process: 2–4 clusters as threads over `federation.inproc`, each with the real
`LocalSGD` and `LaneTransport` (quorum forming, lanes, compression), in milliseconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from edit_train.cluster.group import RankGroup
from edit_train.codec.dense import CompressionConfig
from edit_train.federation.inproc import InProcessFederation
from edit_train.local_sgd.sync import membership
from edit_train.local_sgd.sync.algorithms import LocalSGDConfig
from words import retired_in_events
from toy_federation import H, Outcome, config, max_diff, reference, run_inproc, train_cluster

NAMES = ["c0", "c1", "c2"]


@pytest.mark.parametrize("mode", ["layerwise", "at_end", "overlap"])
@pytest.mark.parametrize("rule", ["edit_norm", "uniform"])
def test_three_clusters_equal_the_closed_form(mode: str, rule: str) -> None:
    """After 3 syncs every cluster holds the anchor the EDiT math gives (weights, clipping, Nesterov)."""
    results = run_inproc(NAMES, config(mode, rule), flush_each_step=mode == "overlap")
    ref = reference(3, 3, rule)
    for name in NAMES:
        assert max_diff(results[name].anchors, ref) <= 1e-6, name
        assert all(torch.equal(a, b) for a, b in zip(results[name].params, results["c0"].params))
    syncs = [e for e in results["c0"].events if e["event"] == "sync"]
    assert [e["sync"] for e in syncs] == [1, 2, 3] and all(e["quorum"] == NAMES for e in syncs)
    assert any(e["clip_coef"] < 1.0 for e in syncs)  # clipping took part in the reference too
    assert retired_in_events(results["c0"].events) == []  # one word per concept (tests/docs/test_words.py)


def test_outer_sgd_lr1_uniform_is_parameter_averaging() -> None:
    results = run_inproc(NAMES[:2], config("at_end", "uniform", syncs=1, phi=1e9, lr=1.0, momentum=0.0,
                                           nesterov=False))
    ref = reference(2, 1, "uniform", lr=1.0, mu=0.0, nesterov=False, phi=1e9)
    assert max_diff(results["c0"].anchors, ref) <= 1e-6


@pytest.mark.parametrize("mode", ["layerwise", "at_end", "overlap"])
@pytest.mark.parametrize("when", ["reduction", "vote"])
def test_a_participant_lost_mid_round_changes_nothing(mode: str, when: str) -> None:
    """c2 vanishes in the second sync, while its second unit is being reduced or at the commit vote (every
    reduction landed; layer-wise had applied every unit): every survivor's anchor, outer optimizer state and
    live parameters are exactly what they were before that round, and the next sync runs without c2."""
    def arm(hub: InProcessFederation) -> None:
        # the uniform rule moves a SUM: per sync c2 all-gathers twice (the exchange, the vote) and all-reduces once
        # per unit (3)
        if when == "reduction":
            hub.kill_at("c2", "allreduce", 5)  # sync 2, unit 2
        else:
            hub.kill_at("c2", "allgather", 4)  # sync 2, the vote

    cfg = config(mode, "uniform", syncs=4)
    results = run_inproc(NAMES, cfg, before=arm, flush_each_step=mode == "overlap", snapshot_at=(2 * H - 1,))
    assert results["c2"].killed
    for name in ("c0", "c1"):
        out = results[name]
        aborted = [e for e in out.events if e["event"] == "sync_aborted"]
        assert len(aborted) == 1 and aborted[0]["sync"] == 2, out.events
        before, after = out.snapshots[2 * H - 1], out.snapshots["aborted"]
        assert before["outer"].keys() == after["outer"].keys()
        assert all(torch.equal(before["outer"][k], after["outer"][k]) for k in before["outer"]), name
        assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"])), name
    syncs = [e for e in results["c0"].events if e["event"] == "sync"]
    # the aborted interval's progress is kept and goes into the next sync (now without c2)
    assert [e["sync"] for e in syncs] == [1, 2, 3] and [len(e["quorum"]) for e in syncs] == [3, 2, 2]
    assert max_diff(results["c0"].anchors, results["c1"].anchors) == 0.0


@pytest.mark.parametrize("mode", ["layerwise", "at_end", "overlap"])
@pytest.mark.parametrize("rule", ["uniform", "verified"])
def test_int8_payloads_bit_identical_and_close_to_fp32(mode: str, rule: str) -> None:
    """int8 with blockwise scales and error feedback at 3 clusters, both reduction paths: `uniform` moves a SUM —
    a reduce-scatter as an all-to-all of payloads, then an all-gather of the re-quantized sums (`rs_ag`) —
    and `verified` gathers every payload. Every cluster holds the bit-identical anchor, within the
    quantization error of the fp32 closed form."""
    cfg = config(mode, rule)
    exact = reference(3, 3, "uniform")  # verified: equal claims weigh 1/3 each, and nothing is flagged in 3 syncs
    hub = InProcessFederation(min_clusters=1, join_timeout_s=30.0, timeout_s=30.0)
    results = run_inproc(NAMES, cfg, hub=hub, compression=CompressionConfig("int8", block_size=8),
                         flush_each_step=mode == "overlap")
    for name in NAMES[1:]:
        assert max_diff(results[name].anchors, results["c0"].anchors) == 0.0
    assert 0 < max_diff(results["c0"].anchors, exact) <= 2e-3
    syncs = [e for e in results["c0"].events if e["event"] == "sync"]
    assert syncs and all(e["bytes"] > 0 for e in syncs)
    assert all(e["aggregation"] == ("sum" if rule == "uniform" else "gathered") for e in syncs)
    alltoall = hub.calls[("c0", "alltoall")]
    assert alltoall == 3 * 3 if rule == "uniform" else alltoall == 0  # rs_ag: one all-to-all per unit and sync


def test_a_late_cluster_heals_and_ends_on_the_same_anchor() -> None:
    """c2 starts once c0 and c1 have synced twice: it heals from the source (anchor, outer momentum, rule
    statistics), adopts the federation's step, takes part with weight 0 until it has local steps, and every
    cluster ends on one anchor."""
    outs = late_federation(InProcessFederation(min_clusters=1, join_timeout_s=30.0, timeout_s=30.0),
                           config("layerwise", "edit_norm", syncs=40))
    assert outs["c2"].algo is not None and outs["c2"].algo.membership.healed_from
    assert all(o.steps == 40 * H for o in outs.values())
    joined = [e for e in outs["c2"].events if e["event"] == "sync"]
    assert joined and all(e["quorum"] == NAMES for e in joined)
    first_three = next(i for i, e in enumerate(outs["c0"].events) if e["event"] == "sync" and len(e["quorum"]) == 3)
    assert first_three > 0
    for n in NAMES[1:]:
        assert max_diff(outs[n].anchors, outs["c0"].anchors) == 0.0, n


@pytest.mark.parametrize("restarted", [True, False])
def test_a_restarted_cluster_whose_peers_are_gone_waits_the_grace_window_not_the_quorum_timeout(
        restarted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """c1, started again by its launcher after c0 finished the run (and before its own first checkpoint: no steps
    to resume), meets nobody. A fresh federation would wait up to quorum_timeout_s for every configured cluster;
    a restarted one is not a fresh start: it waits the grace window (join_timeout_s) and trains alone. (Found on
    the local launcher: the restarted a_edit cluster sat 300 s in start-up.) Membership's clock is a fake that
    moves 1 s per reading, so what is asserted is which deadline ended the wait, not how long it took."""
    clock = {"now": 0.0, "met": None}

    def now() -> float:
        clock["now"] += 1.0
        return clock["now"]

    monkeypatch.setattr(membership, "time", SimpleNamespace(time=now, sleep=lambda _s: None))
    meet = membership.Membership.meet

    def timed_meet(self: membership.Membership) -> Any:
        out = meet(self)
        clock["met"] = clock["now"]
        return out

    monkeypatch.setattr(membership.Membership, "meet", timed_meet)
    cfg = config("layerwise", "uniform", syncs=2)
    cfg.membership.expected, cfg.membership.restarted = ("c0", "c1"), restarted
    cfg.membership.join_timeout_s, cfg.membership.quorum_timeout_s = 5.0, 40.0
    out = run_inproc(["c1"], cfg, hub=InProcessFederation(min_clusters=1, join_timeout_s=0.02, timeout_s=30.0))["c1"]
    syncs = [e["quorum"] for e in out.events if e["event"] == "sync"]
    assert out.steps == 2 * H and syncs and set(map(tuple, syncs)) == {("c1",)}, syncs
    met = clock["met"]
    assert met is not None
    # past the 5 s grace window (a fresh start: the join wait, issue 69), long before the 40 s quorum timeout
    assert 5 <= met < 40, met
    if not restarted:  # a fresh start made no sync alone at first: it kept the first anchor for c0 (issue 69)
        assert out.events[[e["event"] for e in out.events].index("sync") - 1]["event"] == "missed", out.events


@pytest.mark.parametrize("mode", ["layerwise", "at_end", "overlap"])
@pytest.mark.parametrize("unsent", ["resend", "keep"])
def test_topk_unsent_part_is_resent_or_kept_and_nothing_is_lost(mode: str, unsent: str) -> None:
    """Top-k (10 %, 4-bit) between 2 clusters, outer SGD lr 1, uniform weights, no clipping. `resend` (error
    feedback): after the sync both clusters hold θ̄_new and the residual waits to be sent. `keep`: each holds
    θ̄_new − eᵢ (what top-k left out of its own Δ), no residual waits, and the clusters' mean equals the mean of
    their models before the sync (plain averaging, nothing lost). Either way the run ends on one θ̄."""
    comp = CompressionConfig("topk", block_size=64, topk_density=0.1, bits=4, unsent=unsent)
    cfg = config(mode, "uniform", syncs=2, phi=1e9, lr=1.0, momentum=0.0, nesterov=False)
    results = run_inproc(NAMES[:2], cfg, compression=comp, flush_each_step=True,  # the sync lands at once
                         snapshot_at=(H - 1,), after_at=(H - 1,))
    before = [results[n].snapshots[H - 1]["params"] for n in NAMES[:2]]
    after = [results[n].snapshots[("after", H - 1)]["params"] for n in NAMES[:2]]
    anchor = [a for unit in results["c0"].snapshots[("after", H - 1)]["anchor"] for a in unit]
    mean = lambda ps: [sum(t) / len(t) for t in zip(*ps)]  # noqa: E731
    gap = max(float((x - y).abs().max()) for x, y in zip(mean(after), mean(before)))
    if unsent == "keep":
        assert gap <= 1e-6
        assert not any(torch.equal(x, y) for x, y in zip(after[0], after[1]))  # each kept its own part
        assert all(results[n].snapshots[("after", H - 1)]["residuals"] == [] for n in NAMES[:2])
    else:
        assert gap > 1e-4  # what top-k left out is not in anybody's model yet
        assert all(torch.equal(x, a) for p in after for x, a in zip(p, anchor))
        assert all(results[n].snapshots[("after", H - 1)]["residuals"] for n in NAMES[:2])
    for n in NAMES[:2]:  # the end: every cluster on θ̄, the same one
        assert all(torch.equal(x, a) for x, a in zip(results[n].params, [a for u in results[n].anchors for a in u]))
        assert max_diff(results[n].anchors, results["c0"].anchors) == 0.0


def test_a_cluster_that_missed_a_newcomer_heals_from_one_that_knows_it() -> None:
    """c2 joins while c1 is cut off: c0 and c2's rule statistics then hold a row for c2, c1's do not. When c1
    comes back it heals from a cluster that knows one more cluster than it does — the rule's statistics are
    the rule's to check (their shape follows the clusters it has met), not refused as the wrong shape — and
    syncs again. (Seen on a real overlap run: c1 skipped every sync for the rest of the run.)"""
    hub = InProcessFederation(min_clusters=1, join_timeout_s=0.3, timeout_s=30.0)

    def away(outs: dict[str, Outcome]) -> Iterator[None]:  # c1 is away while c2 joins, back once c2 contributed
        hub.partitioned_until["c1"] = time.monotonic() + 600.0
        yield
        while sum(e["event"] == "sync" for e in outs["c2"].events) < 2:  # c2 contributes from its 2nd sync
            time.sleep(0.001)
        hub.partitioned_until["c1"] = 0.0

    outs = late_federation(hub, config("layerwise", "verified", syncs=40), away)
    assert outs["c1"].algo is not None and outs["c1"].algo.membership.healed_from
    synced = [e for e in outs["c1"].events if e["event"] == "sync"]
    assert synced and synced[-1]["quorum"] == NAMES  # back among all three
    assert any(e["event"] == "missed" for e in outs["c1"].events)  # it was away
    for n in NAMES[1:]:
        assert max_diff(outs[n].anchors, outs["c0"].anchors) == 0.0, n


def late_federation(hub: InProcessFederation, cfg: LocalSGDConfig, around_join: Any = None) -> dict[str, Outcome]:
    """c0 and c1 train; once they have synced twice c2 starts (`around_join(outs)`: a generator run before c2
    starts and, after its first yield, while it trains); every thread joined."""
    outs = {n: Outcome() for n in NAMES}
    transports = {n: hub.transport(n, RankGroup()) for n in NAMES[:2]}
    threads = [threading.Thread(target=train_cluster, args=(i, transports[n], cfg), kwargs={"out": outs[n]})
               for i, n in enumerate(NAMES[:2])]
    for t in threads:
        t.start()
    while sum(e["event"] == "sync" for e in outs["c0"].events) < 2:
        time.sleep(0.001)
    steps = around_join(outs) if around_join is not None else iter(())
    next(steps, None)
    late = threading.Thread(target=train_cluster, args=(2, hub.transport("c2", RankGroup()), cfg),
                            kwargs={"out": outs["c2"]})
    late.start()
    next(steps, None)
    for t in [*threads, late]:
        t.join(120)
    return outs
