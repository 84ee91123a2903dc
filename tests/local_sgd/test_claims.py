"""What one member may claim and what the federation takes from many claims (issue 37), rule by rule, in one
process: the vetting before lanes connect, the agreed state and who heals from whom, the step a joiner
adopts, and a heal payload checked against the agreed sync, steps and anchor digest."""

from __future__ import annotations

import pytest
import torch

from edit_train.federation.heal import decode, encode
from edit_train.local_sgd.aggregation.claims import TIME_MARGIN, Terms, agreed_steps, vet
from edit_train.local_sgd.errors import FederationRefused, HealError
from edit_train.local_sgd.sync.healing import Expect, Healer, anchor_digest, check_payload
from edit_train.local_sgd.protocols import Member, Quorum
from edit_train.local_sgd.sync.schedule import ScheduleConfig
from test_heal import _HostileTransport

D, E, X = "d" * 32, "e" * 32, "f" * 32


def _q(*claims: tuple, me: int = 0, nonce: str = "q1") -> Quorum:
    """A quorum of members c0, c1, … from (sync, anchor digest[, data]) claims."""
    members = [Member(f"c{i}", c[0], 1, "", {"fp": "a", "anchor": c[1], "total_steps": 8, **(c[2] if len(c) > 2 else {})})
               for i, c in enumerate(claims)]
    return Quorum(1, nonce, members, me)


# ------------------------------------------------------------------ vetting
@pytest.mark.parametrize(("data", "needle"), [
    ({"total_steps": 2**53 - 1}, "claims total_steps = 9007199254740991, more than the 100 steps"),
    ({"local_steps": -1}, "claims local_steps = -1, not a count"),
    ({"local_steps": True}, "not a count"),
    ({"anchor": "not-hex"}, "anchor digest that is not 32 hex digits"),
    ({"fp": "b"}, "runs another configuration"),
])
def test_a_member_whose_claims_cannot_be_the_federations_is_left_out_alone(data: dict, needle: str) -> None:
    q = _q((3, D), (3, D), (3, D, data), me=0)
    kept, why = vet(q, Terms("a", 100, authoritative=True))
    assert kept.names == ["c0", "c1"] and kept.me == 0 and kept.left_out == ["c2"]
    assert needle in why["c2"] and "\n" not in why["c2"]
    assert kept.nonce != q.nonce  # the lanes of what is left are another namespace than the issued quorum's
    other, _ = vet(_q((3, D), (3, D), (3, D, data), me=1), Terms("a", 100, authoritative=True))
    assert other.nonce == kept.nonce  # …the same one for every honest member


def test_a_sync_past_the_federations_steps_is_left_out() -> None:
    kept, why = vet(_q((3, D), (2**40, X), me=0), Terms("a", 100))
    assert kept.names == ["c0"] and "claims sync = 1099511627776" in why["c1"]


def test_an_honest_cluster_never_refuses_itself_for_a_liars_claim() -> None:
    """With the roster's terms a lone cluster differing from a liar keeps going; without a roster a 1-1 split
    leaves each out of the other's sync; only a strict majority of others makes a cluster refuse itself."""
    kept, _ = vet(_q((3, D), (2**20, X, {"fp": "b"}), me=0), Terms("a", authoritative=True))
    assert kept.names == ["c0"]
    kept, _ = vet(_q((3, D), (5, X, {"fp": "b"}), me=0), Terms("a"))
    assert kept.names == ["c0"]
    with pytest.raises(FederationRefused, match="cluster c2 runs another configuration than the federation"):
        vet(_q((3, D, {"fp": "b"}), (3, D, {"fp": "b"}), (3, D), me=2), Terms("a"))
    kept, _ = vet(_q((3, D, {"fp": "b"}), (3, D, {"fp": "b"}), (3, D), me=2), Terms("a", authoritative=True))
    assert kept.names == ["c2"]  # with a roster the majority does not decide: the roster does


# ------------------------------------------------------------------ the agreed state
def test_what_two_hold_outweighs_what_one_claims_however_new() -> None:
    q = _q((5, D), (5, D), (10**6, X))
    assert q.agreed == (5, D) and q.behind() == [2]
    assert q.source_for(2) in (0, 1)


def test_a_tie_goes_to_the_newest_so_a_restarted_cluster_heals() -> None:
    q = _q((9, D), (3, E))
    assert q.agreed == (9, D) and q.behind() == [1] and q.source_for(1) == 0


def test_same_sync_with_another_digest_is_not_healed() -> None:
    """A cluster on another device rounds its anchor differently: at the agreed sync it is not behind."""
    q = _q((7, D), (7, D), (7, E))
    assert q.agreed == (7, D) and q.behind() == []


def test_a_healer_is_not_sent_again_to_a_source_it_refused() -> None:
    for nonce in (f"q{i}" for i in range(20)):
        q = _q((5, D), (5, D), (5, D), (2, E, {"refused": "c1"}), nonce=nonce)
        assert q.source_for(3) in (0, 2)
    q = _q((5, D), (2, E, {"refused": "c0"}))
    assert q.source_for(1) == 0  # the only holder: asked again


EVERY_8 = ScheduleConfig(interval=8).steps_at  # a step schedule, a sync every 8 steps


def test_the_step_a_joiner_adopts_is_the_lower_median_of_every_claim_bounded_by_the_sync_count() -> None:
    assert agreed_steps(_q((5, D, {"total_steps": 40}), (5, D, {"total_steps": 2**50}), (0, E, {"total_steps": 0}),
                           me=2)) == 40
    # two clusters: the joiner's own claim counts, raised to what the agreed sync implies (5 syncs of 8 steps)
    assert agreed_steps(_q((5, D, {"total_steps": 40}), (0, E, {"total_steps": 16}), me=1), EVERY_8) == 40
    # a claim of the run's end (64) from the only other member: bounded by sync 0's one interval, not adopted
    assert agreed_steps(_q((0, D, {"total_steps": 64}), (0, D, {"total_steps": 0}), me=1), EVERY_8) == 0
    assert agreed_steps(_q((0, D, {"total_steps": 64}), (0, D, {"total_steps": 0}), (0, D, {"total_steps": 0}),
                           me=1), EVERY_8) == 0
    # syncs that follow the lr (algo.interval_power): the bound is the boundaries', not 8 per sync
    ramp = ScheduleConfig(interval=8, boundaries=(16, 23, 28, 33, 37)).steps_at
    assert agreed_steps(_q((3, D, {"total_steps": 33}), (0, E, {"total_steps": 0}), me=1), ramp) == 28
    assert agreed_steps(_q((3, D, {"total_steps": 33}), (0, E, {"total_steps": 40}), me=1), ramp) == 33
    assert agreed_steps(_q((6, D, {"total_steps": 53}), (0, E, {"total_steps": 0}), me=1), ramp) == 45  # 37 + 8


# ------------------------------------------------------------------ heal payloads
LOCAL = {"outer/l0/anchor/0": (torch.zeros(4, 3), None), "outer/l0/momentum/0": (torch.zeros(4, 3), None)}


def _state(scale: float = 1.0) -> dict:
    return {"outer/l0/anchor/0": torch.ones(4, 3) * scale, "outer/l0/momentum/0": torch.zeros(4, 3)}


@pytest.mark.parametrize(("meta", "tensors", "needle"), [
    ({"sync_index": 2**61}, {}, "sync_index = 2305843009213693952, the state agreed on is sync 5"),
    ({"sync_index": 5, "total_steps": 10**6}, {}, "total_steps = 1000000 is more than the federation's 64 steps"),
    ({"sync_index": 5, "global_step": 65}, {}, "global_step = 65"),
    ({"sync_index": 5}, {"penalty/x/mu": torch.tensor([float("inf")])}, "'penalty/x/mu' is not finite"),
    ({"sync_index": 5}, {"penalty/x/count": torch.tensor([-3])}, "counts out of range"),
    ({"sync_index": 5}, {"penalty/x/flag": torch.tensor([True])}, "torch.bool"),
    ({"sync_index": 5, "local_phase": True}, {"outer/l0/anchor/0": torch.full((4, 3), 1e30)}, "does not match the digest"),
])
def test_a_heal_payload_is_checked_against_what_was_agreed(meta: dict, tensors: dict, needle: str) -> None:
    with pytest.raises(HealError) as err:
        check_payload(meta, {**_state(), **tensors}, LOCAL, "cluster c2", Expect(5, 64, anchor_digest(_state())))
    assert needle in str(err.value) and "cluster c2" in str(err.value) and "\n" not in str(err.value)


def test_the_agreed_anchor_passes() -> None:
    check_payload({"sync_index": 5, "local_phase": True, "total_steps": 40}, _state(), LOCAL, "c0",
                  Expect(5, 64, anchor_digest(_state())))


def test_a_healer_refuses_a_source_whose_anchor_is_not_the_agreed_one_and_says_so() -> None:
    """c2 holds the agreed claim (so it is a source) but sends a finite anchor 1e30 times the agreed one: the
    healer adopts nothing, and names c2 as refused in its next request (it is sent to another holder)."""
    applied: list = []
    payload = encode({"sync_index": 5, "local_phase": True, "total_steps": 40}, _state(1e30))
    healer = Healer(_HostileTransport(payload), lambda: ({}, LOCAL), lambda m, t: applied.append(m),  # type: ignore[arg-type]
                    encode, decode)
    digest = anchor_digest(_state())
    q = Quorum(1, "q", [Member("c2", 5, 1, "", {"anchor": digest, "total_steps": 40}),
                        Member("c3", 0, 1, "", {"anchor": E, "total_steps": 0})], 1)
    with pytest.raises(HealError, match="healing payload from cluster c2: its anchor does not match the digest"):
        healer.run(q, 64, rejoining=True)
    assert applied == [] and healer.refused == ["c2"]
    good = encode({"sync_index": 5, "local_phase": True, "total_steps": 40}, _state())
    healer.t = _HostileTransport(good)  # type: ignore[assignment]
    assert healer.run(q, 64, agreed_steps(q, EVERY_8), rejoining=True) == "c2" and healer.refused == []
    assert applied[0]["total_steps"] == 40  # what sync 5 of 8-step intervals implies (the source's claim agrees)


def test_a_sharded_healer_takes_its_shard_of_state_it_does_not_hold_yet() -> None:
    """A 2-rank cluster that heals before its first outer step has no outer momentum yet: it takes its shard
    of the source's, like the anchor's (it once kept the whole tensor and failed at its next outer step)."""
    from edit_train.cluster.group import RankGroup

    class Sharded(_HostileTransport):
        cluster = RankGroup(rank=0, size=2)  # the leader of two ranks (no process group: collectives are local)

    local = {"outer/l0/anchor/0": (torch.zeros(2, 3), torch.zeros(4, 3))}  # this rank's half of a 4x3 anchor
    state = {"outer/l0/anchor/0": torch.arange(12.0).reshape(4, 3), "outer/l0/momentum/0": torch.ones(4, 3)}
    applied: list = []
    healer = Healer(Sharded(encode({"sync_index": 5, "local_phase": True}, state)), lambda: ({}, local),  # type: ignore[arg-type]
                    lambda m, t: applied.append(t), encode, decode)
    q = Quorum(1, "q", [Member("c0", 5, 1, "", {"anchor": anchor_digest(state)}), Member("c1", 0, 2, "", {})], 1)
    assert healer.run(q, 64, rejoining=True) == "c0"
    assert applied[0]["outer/l0/momentum/0"].shape == (2, 3)
    assert torch.equal(applied[0]["outer/l0/anchor/0"], torch.arange(6.0).reshape(2, 3))


def test_a_cluster_whose_own_claims_are_out_of_bounds_trains_alone_rather_than_stop() -> None:
    """Under a time schedule a cluster may pass train.steps by an interval (the bound is twice it plus a margin
    for the many short steps of one interval); a cluster past even that leaves the others out, as they leave it
    out, and never refuses itself."""
    q = _q((3, D, {"total_steps": 150}), (3, D), me=0)
    assert vet(q, Terms("a", 100, slack=2))[0].names == ["c0", "c1"]
    short = _q((3, D, {"total_steps": 10, "local_steps": 6}), (3, D), me=0)  # a 4-step A-EDiT run took 10
    assert vet(short, Terms("a", 4, slack=2, margin=TIME_MARGIN))[0].names == ["c0", "c1"]
    assert vet(_q((3, D, {"total_steps": 2**40}), (3, D), me=0), Terms("a", 4, slack=2, margin=TIME_MARGIN))[1]
    kept, why = vet(q, Terms("a", 100))
    assert kept.names == ["c0"] and "whose own claims are out of bounds" in why["c1"]
