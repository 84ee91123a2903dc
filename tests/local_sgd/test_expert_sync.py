"""Expert-aware sync (issue 41, phase B; docs/sync_math.md, "Experts"), in one process:

* the verified rule's expert weights on crafted counts, in closed form: each cluster's token backing spread as it
  routed its tokens; equal routing shares give exactly today's token weights; an expert nobody routed a token
  to weighs 0 everywhere (no NaN); a cluster left out of the module is left out of every expert;
* whole rounds of 3 toy clusters (`tests/helpers/toy_federation.py`, unit "2" cut into 4 experts of 6 rows) in every
  sync mode and both ways of moving (gathered: the verified rule; a SUM: `expert_sum_rule.TokenSum`) land on the
  closed-form anchor; an untouched expert's rows do not move;
* bytes fall by exactly the untouched rows' share (the `sync` event's `bytes` and `unsent_params`, the
  formula, and the planner's `traffic.sync_bytes`);
* the routed counts of an aborted round are added to the next one's;
* what a cluster did not send stays with it: after the sync its rows of those experts hold θ̄_new − Δᵢ (its own
  Δ), every other row θ̄_new, the anchor as before; its next sync sends the carried Δ when it touches the expert
  again; a cluster left out of the unit keeps nothing; a run ends with every cluster on one θ̄.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import read_events, run_train, tiny_overrides
from edit_train.config import Config, ConfigError, validate
from edit_train.federation.seal import TAG
from edit_train.local_sgd.aggregator import Evidence
from edit_train.local_sgd.moe.experts import Experts, RoutedCounts, unsent_rows
from edit_train.local_sgd.sync.round import EXTRA
from edit_train.local_sgd.aggregation.verified import VerifiedConfig, VerifiedRule, token_weights
from edit_train.plan import traffic
from edit_train.sim.byzantine import ByzantineTransport
from edit_train.sim.faults import FaultInjector
from toy_federation import H, Outcome, config, local_deltas, max_diff, run_inproc, toy_model, units_of

NAMES = ["c0", "c1", "c2"]
E, ROWS = 4, 6  # unit "2" (Linear 24x24): expert e owns rows 6e..6e+5 of its weight and bias
COUNTS = torch.tensor([[12, 4, 0, 0], [0, 8, 8, 0], [8, 8, 16, 0]], dtype=torch.float64)  # expert 3: nobody


def _pieces(name: str, _module: object, _params: object) -> tuple[int, list[list[tuple[int, slice]]]] | None:
    return (0, [[(0, slice(ROWS * e, ROWS * (e + 1))), (1, slice(ROWS * e, ROWS * (e + 1)))] for e in range(E)]) \
        if name == "2" else None


def _routed(takes: list[int] | None = None) -> object:
    """Cluster i's hook: COUNTS[i] per take (times k + 1 at its k-th take when `takes` records them)."""
    def make(index: int) -> RoutedCounts:
        def take() -> torch.Tensor:
            k = 1
            if takes is not None:
                takes.append(index)
                k = takes.count(index)
            return (COUNTS[index % 3] * k).to(torch.int64)[None]
        return RoutedCounts(take, _pieces)
    return make


def _closed_form(counts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[E, P]: wᵢₑ = (tᵢ·cᵢₑ/Σₑcᵢₑ) / Σⱼ (tⱼ·cⱼₑ/Σₑcⱼₑ), 0 where nobody routed a token."""
    share = tokens[:, None] * counts / counts.sum(1, keepdim=True)
    den = share.sum(0)
    return torch.where(den > 0, share / torch.where(den > 0, den, 1.0), torch.zeros_like(share)).T


def _evidence(counts: torch.Tensor, tokens: list[float], norms: list[float] | None = None,
              sent: torch.Tensor | None = None) -> Evidence:
    p = counts.shape[0]
    g = torch.tensor(norms if norms is not None else [1.0] * p, dtype=torch.float64)
    extra = {"tokens": torch.tensor(tokens, dtype=torch.float64), "reported": g.clone(), "sync": torch.tensor(1),
             "expert_tokens": counts, "expert_sent": sent if sent is not None else torch.ones_like(counts).bool()}
    return Evidence("2", tuple(NAMES[:p]), g, torch.full((p,), float(H), dtype=torch.float64), (True,) * p, extra)


# ------------------------------------------------------------------------------------------- the rule
def test_expert_weights_are_the_token_backing_spread_as_each_cluster_routed() -> None:
    rule = VerifiedRule(VerifiedConfig(expert_weights="tokens"))
    tokens = torch.tensor([8.0, 8.0, 16.0], dtype=torch.float64)
    d = rule.decide(_evidence(COUNTS, tokens.tolist()))
    assert d.weights == [0.25, 0.25, 0.5] and d.expert_weights is not None
    got = torch.tensor(d.expert_weights, dtype=torch.float64)
    assert torch.allclose(got, _closed_form(COUNTS, tokens), atol=1e-12, rtol=0)
    # by hand: backing x routing share = c0 [6, 2, 0, 0], c1 [0, 4, 4, 0], c2 [4, 4, 8, 0]
    assert torch.allclose(got[:3], torch.tensor([[0.6, 0.0, 0.4], [0.2, 0.4, 0.4], [0.0, 1 / 3, 2 / 3]],
                                                dtype=torch.float64), atol=1e-12, rtol=0)
    assert got[3].tolist() == [0.0, 0.0, 0.0]  # nobody routed a token to expert 3: no update, no NaN
    # the verified rule's default leaves the experts alone (today's numbers)
    assert VerifiedRule(VerifiedConfig()).decide(_evidence(COUNTS, tokens.tolist())).expert_weights is None


def test_equal_routing_shares_reduce_to_the_token_weights() -> None:
    tokens = [8.0, 24.0, 16.0]
    counts = torch.tensor([[2.0, 1, 1, 4]]) * torch.tensor([[1.0], [3.0], [2.0]])  # the same shares everywhere
    d = VerifiedRule(VerifiedConfig(expert_weights="tokens")).decide(_evidence(counts, tokens))
    assert d.expert_weights is not None
    for row in d.expert_weights:
        assert row == pytest.approx(d.weights, abs=1e-15)


@pytest.mark.parametrize("left_out", ["zero", "others"])
def test_a_cluster_left_out_of_the_module_is_left_out_of_every_expert(left_out: str) -> None:
    """c1 sent a non-finite norm: weight 0 in the module and in every expert; with left_out=zero its share (its
    claim capped at the median accepted claim, spread as it routed) is a zero update, with others it is not."""
    rule = VerifiedRule(VerifiedConfig(expert_weights="tokens", left_out=left_out))
    d = rule.decide(_evidence(COUNTS, [8.0, 8.0, 16.0], norms=[1.0, math.nan, 1.0]))
    assert d.left_out == [False, True, False] and d.expert_weights is not None
    accepted = torch.tensor([True, False, True])
    claims = torch.tensor([8.0, 8.0, 16.0], dtype=torch.float64)
    assert d.weights == token_weights(claims, accepted, 8.0, left_out).tolist()
    ew = torch.tensor(d.expert_weights, dtype=torch.float64)
    assert ew[:, 1].tolist() == [0.0] * E
    # kept shares: c0 [6, 2, 0, 0], c2 [4, 4, 8, 0]; c1's (claim 8, the median accepted claim 8): [0, 4, 4, 0]
    f64 = {"dtype": torch.float64}
    rejected = torch.tensor([0.0, 4.0, 4.0, 0.0], **f64) if left_out == "zero" else torch.zeros(E, **f64)
    den = torch.tensor([6.0, 2.0, 0.0, 0.0], **f64) + torch.tensor([4.0, 4.0, 8.0, 0.0], **f64) + rejected
    expect_c0 = torch.where(den > 0, torch.tensor([6.0, 2.0, 0.0, 0.0], **f64) / den.clamp_min(1e-9),
                            torch.zeros(E, **f64))
    assert torch.allclose(ew[:, 0], expect_c0, atol=1e-12, rtol=0)
    assert bool(torch.isfinite(ew).all())


def test_an_expert_a_cluster_did_not_send_is_no_contribution_to_it() -> None:
    sent = COUNTS >= 8  # expert_min_tokens = 8: c0 does not send expert 1 (4 tokens)
    d = VerifiedRule(VerifiedConfig(expert_weights="tokens", expert_min_tokens=8)).decide(
        _evidence(COUNTS, [8.0, 8.0, 16.0], sent=sent))
    assert d.expert_weights is not None
    assert d.expert_weights[1] == pytest.approx([0.0, 0.5, 0.5])  # c0 out; c1 and c2 back it 4 : 4


# ------------------------------------------------------------------------------------------ whole rounds
def _cfg(mode: str, rule: str = "verified", min_tokens: int = 0, syncs: int = 1) -> object:
    cfg = config(mode, rule, syncs=syncs, phi=1e9, lr=1.0, momentum=0.0, nesterov=False)
    cfg.rule.verified.expert_weights, cfg.rule.verified.expert_min_tokens = "tokens", min_tokens
    return cfg


def _expected() -> list[list[torch.Tensor]]:
    """The anchor after one sync with outer SGD lr 1: θ̄ − Σᵢ Wᵢ∘Δᵢ (module weights 1/3: equal local steps)."""
    model = toy_model()
    anchor = [[p.detach().clone() for p in u.parameters()] for u in units_of(model)]
    deltas = local_deltas(anchor, 3, 0)
    ew = _closed_form(COUNTS, torch.full((3,), float(H)))
    out = []
    for j, unit in enumerate(anchor):
        merged = []
        for k, a in enumerate(unit):
            rows = torch.full((a.shape[0],), 1 / 3, dtype=torch.float64)[:, None].repeat(1, 3)  # [rows, P]
            if j == 1:
                for e in range(E):
                    rows[ROWS * e:ROWS * (e + 1)] = ew[e]
            step = sum(deltas[i][j][k].double() * rows[:, i].reshape(-1, *[1] * (a.dim() - 1)) for i in range(3))
            merged.append((a.double() - step).float())
        out.append(merged)
    return out


@pytest.mark.parametrize("mode,rule", [("at_end", "verified"), ("layerwise", "verified"), ("overlap", "verified"),
                                       ("at_end", "expert_sum_rule:TokenSum")])
def test_three_clusters_land_on_the_closed_form_anchor(mode: str, rule: str) -> None:
    results = run_inproc(NAMES, _cfg(mode, rule), routed=_routed(), flush_each_step=mode == "overlap")
    expect = _expected()
    for n in NAMES:
        assert max_diff(results[n].anchors, expect) <= 1e-6, n
        assert max_diff(results[n].anchors, results["c0"].anchors) == 0.0
    untouched = [t[ROWS * 3:] for t in results["c0"].anchors[1]]
    assert all(torch.equal(u, a[ROWS * 3:]) for u, a in
               zip(untouched, [p.detach() for p in units_of(toy_model())[1].parameters()]))
    sync = [e for e in results["c0"].events if e["event"] == "sync"]
    assert sync[0]["aggregation"] == ("gathered" if rule == "verified" else "sum")
    assert sync[0]["expert_weights"]["2"] == pytest.approx([0.75, 0.25, 0.0, 0.0], abs=1e-8)
    # its coefficient in the merged update, by size: unit "2" is all experts (4 x 150 of its 600 values)
    assert sync[0]["weight"] == pytest.approx((168 / 3 + 600 * (0.75 + 0.25) / 4 + 75 / 3) / 843, abs=1e-8)


def test_above_gather_max_a_rule_that_weighs_experts_gathers() -> None:
    """Five clusters (sync.gather_max 4): the sketch check holds one weight per cluster, so a round whose provisional
    decision weighs experts is gathered instead (the config refuses this for the verified rule at start)."""
    names = [f"c{i}" for i in range(5)]
    results = run_inproc(names, _cfg("at_end"), routed=_routed())
    for n in names:
        (e,) = [e for e in results[n].events if e["event"] == "sync"]
        assert e["aggregation"] == "gathered" and len(e["expert_weights"]["2"]) == E
        assert max_diff(results[n].anchors, results["c0"].anchors) == 0.0


def _unit_sizes() -> list[int]:
    return [sum(p.numel() for p in u.parameters()) for u in units_of(toy_model())]


def _small(p: int) -> int:
    """The exchange (norms, marker, routed tokens, EXTRA, probe scores) and the vote, each tagged."""
    units = len(_unit_sizes())
    return (p - 1) * (8 * (units + 1 + E + len(EXTRA) + p) + TAG) + (p - 1) * (8 + TAG)


def test_a_gather_sends_only_the_rows_of_experts_each_cluster_touched() -> None:
    """expert_min_tokens=1: c0 leaves out experts 2 and 3, c1 0 and 3, c2 3 (150 values each); the anchor is
    the same closed form, and each cluster's bytes are the formula over what it sent (and the planner's)."""
    sizes, per_expert = _unit_sizes(), ROWS * 24 + ROWS
    full = run_inproc(NAMES, _cfg("at_end", min_tokens=0), routed=_routed())
    lean = run_inproc(NAMES, _cfg("at_end", min_tokens=1), routed=_routed())
    assert max_diff(lean["c0"].anchors, _expected()) <= 1e-6
    for i, n in enumerate(NAMES):
        unsent = per_expert * int((COUNTS[i] == 0).sum())
        (a,), (b,) = [[e for e in r[n].events if e["event"] == "sync"] for r in (full, lean)]
        assert (a["unsent_params"], b["unsent_params"]) == (0, unsent)
        payload = sum(2 * (4 * s + TAG) for s in sizes) - 2 * 4 * unsent
        assert b["bytes"] == payload + _small(3), n
        assert a["bytes"] - b["bytes"] == 2 * 4 * unsent  # (P − 1) copies of 4 bytes per value left out
        assert traffic.sync_bytes(sizes, 3, "none", unsent=[0, unsent, 0]) == payload


def test_a_sum_leaves_out_the_rows_nobody_touched() -> None:
    """A SUM rule that weighs experts: expert 3's rows (no cluster routed a token to it) are not in the
    reduction; the ring all-reduce moves the rest."""
    sizes = _unit_sizes()
    out = run_inproc(NAMES, _cfg("at_end", "expert_sum_rule:TokenSum"), routed=_routed())
    unsent = ROWS * 24 + ROWS
    for n in NAMES:
        (e,) = [e for e in out[n].events if e["event"] == "sync"]
        ring = sum(2 * 2 * 4 * (s - (unsent if j == 1 else 0)) // 3 for j, s in enumerate(sizes))
        assert e["unsent_params"] == unsent and e["bytes"] == ring + _small(3), (n, e["bytes"], ring)
        assert traffic.sync_bytes(sizes, 3, "none", needs="sum", unsent=[0, unsent, 0]) == ring


# ------------------------------------------------------------------ what a cluster did not send stays with it
UNIT = 2  # unit "2"'s weight and bias: model.parameters()[2:4]


def _first_deltas() -> list[list[list[torch.Tensor]]]:
    """[cluster][unit][tensor]: each cluster's Δ at the first sync (closed form, from the initial anchor)."""
    return local_deltas([[p.detach().clone() for p in u.parameters()] for u in units_of(toy_model())], 3, 0)


def _mask(experts: torch.Tensor) -> torch.Tensor:
    """bool [24]: the rows of unit "2"'s weight and bias that are the experts `experts` (bool [E]) says."""
    return experts.repeat_interleave(ROWS)


def _check_kept(state: dict[str, object], delta: list[torch.Tensor], held: torch.Tensor) -> None:
    """A cluster's live parameters right after a sync: θ̄_new on every row but the rows of the experts `held`
    (which it did not send), there θ̄_new − Δ (its own); anything not unit "2" exactly θ̄_new."""
    anchor: list[list[torch.Tensor]] = state["anchor"]  # type: ignore[assignment]
    params: list[torch.Tensor] = state["params"]  # type: ignore[assignment]
    rows = _mask(held)
    for j, unit in enumerate(anchor):
        for k, a in enumerate(unit):
            live = params[2 * j + k]
            if j != 1:
                assert torch.equal(live, a), (j, k)
                continue
            assert torch.equal(live[~rows], a[~rows]), k  # what it sent: it holds θ̄_new, exactly
            if bool(held.any()):
                assert float((live[rows] - (a[rows] - delta[k][rows])).abs().max()) <= 1e-6, k
                assert float(delta[k][rows].abs().max()) > 1e-4  # (there was progress to keep)


def _ends_on_one_anchor(out: dict[str, Outcome]) -> None:
    for n in out:
        assert all(torch.equal(x, a) for x, a in zip(out[n].params, [a for u in out[n].anchors for a in u])), n
        assert max_diff(out[n].anchors, out["c0"].anchors) == 0.0, n


@pytest.mark.parametrize("mode", ["at_end", "layerwise", "overlap"])
def test_a_cluster_keeps_its_own_delta_on_the_experts_it_did_not_send(mode: str) -> None:
    """Gathered, expert_min_tokens=1 (c0 does not send experts 2 and 3, c1 0 and 3, c2 3): the anchor is the
    closed form it was before, and each cluster holds θ̄_new − Δᵢ on the rows of the experts it did not send,
    θ̄_new elsewhere (overlap: nothing happened since the snapshot, so the same numbers). The run ends on one θ̄."""
    out = run_inproc(NAMES, _cfg(mode, min_tokens=1, syncs=2), routed=_routed(), flush_each_step=True,
                     after_at=(H - 1,))
    deltas, expect = _first_deltas(), _expected()
    for i, n in enumerate(NAMES):
        after = out[n].snapshots[("after", H - 1)]
        assert max_diff(after["anchor"], expect) <= 1e-6, n
        _check_kept(after, deltas[i][1], COUNTS[i] == 0)
    _ends_on_one_anchor(out)


@pytest.mark.parametrize("mode", ["at_end", "overlap"])
def test_in_a_sum_every_cluster_keeps_its_delta_on_the_rows_nobody_weighs(mode: str) -> None:
    """A SUM (`expert_sum_rule.TokenSum`): nobody routed a token to expert 3, so its rows are in no reduction and
    the anchor's stay where they were (no outer momentum); each cluster keeps its own Δ there — which is its model
    before the sync, θ̄ − Δᵢ — and holds θ̄_new on every other row."""
    out = run_inproc(NAMES, _cfg(mode, "expert_sum_rule:TokenSum"), routed=_routed(), flush_each_step=True,
                     snapshot_at=(H - 1,), after_at=(H - 1,))
    deltas, expect, held = _first_deltas(), _expected(), torch.tensor([False, False, False, True])
    initial = [p.detach() for p in units_of(toy_model())[1].parameters()]
    for i, n in enumerate(NAMES):
        after, before = out[n].snapshots[("after", H - 1)], out[n].snapshots[H - 1]
        assert max_diff(after["anchor"], expect) <= 1e-6, n
        assert all(torch.equal(a[_mask(held)], b[_mask(held)]) for a, b in zip(after["anchor"][1], initial))
        _check_kept(after, deltas[i][1], held)
        for k in range(2):
            rows = _mask(held)
            assert float((after["params"][UNIT + k][rows] - before["params"][UNIT + k][rows]).abs().max()) <= 1e-6
        (e,) = [e for e in out[n].events if e["event"] == "sync"]
        assert e["aggregation"] == "sum" and e["unsent_params"] == ROWS * 24 + ROWS
    _ends_on_one_anchor(out)


def test_the_next_sync_sends_the_kept_delta_when_the_expert_is_touched_again() -> None:
    """c0 routes no token to expert 2 in the first interval (it keeps Δ₁ there), 5 in the second: its second
    sync sends expert 2 (unsent_params 300 → 150, its bytes by the formula), and what it sends there is Δ₁ (the
    closed form) plus its progress since: the anchor moves on expert 2's rows by Σᵢ wᵢ₂Δᵢ with that Δ."""
    second = torch.tensor([12, 4, 5, 0])

    def routed(index: int) -> RoutedCounts:
        takes = [0]

        def take() -> torch.Tensor:
            takes[0] += 1
            row = second if index == 0 and takes[0] == 2 else COUNTS[index].to(torch.int64)
            return row.to(torch.int64)[None]
        return RoutedCounts(take, _pieces)

    out = run_inproc(NAMES, _cfg("at_end", min_tokens=1, syncs=2), routed=routed, flush_each_step=True,
                     snapshot_at=(2 * H - 1,), after_at=(H - 1, 2 * H - 1))
    syncs = {n: [e for e in out[n].events if e["event"] == "sync"] for n in NAMES}
    per_expert, sizes = ROWS * 24 + ROWS, _unit_sizes()
    assert [e["unsent_params"] for e in syncs["c0"]] == [2 * per_expert, per_expert]
    for e in syncs["c0"]:
        assert e["bytes"] == sum(2 * (4 * s + TAG) for s in sizes) - 2 * 4 * e["unsent_params"] + _small(3)
    ew = [syncs[n][1]["expert_weights"]["2"][2] for n in NAMES]  # each cluster's weight on expert 2, sync 2
    assert ew[0] > 0.0 and ew[1] > 0.0 and ew[2] > 0.0
    first, rows = _first_deltas()[0][1], _mask(torch.tensor([False, False, True, False]))
    anchor1 = out["c0"].snapshots[("after", H - 1)]["anchor"][1]
    anchor2 = out["c0"].snapshots[("after", 2 * H - 1)]["anchor"][1]
    for k in range(2):
        sent = []
        for i, n in enumerate(NAMES):
            before = out[n].snapshots[2 * H - 1]["params"][UNIT + k]  # its model when sync 2 starts
            delta = anchor1[k] - before
            if i == 0:  # Δ₁ kept, plus the progress since sync 1
                progress = out[n].snapshots[("after", H - 1)]["params"][UNIT + k] - before
                assert float((delta[rows] - (first[k][rows] + progress[rows])).abs().max()) <= 1e-6
                assert float(first[k][rows].abs().max()) > 1e-4
            sent.append(delta[rows].double())
        want = anchor1[k][rows].double() - sum(w * d for w, d in zip(ew, sent))
        assert float((anchor2[k][rows].double() - want).abs().max()) <= 1e-6, k
    _ends_on_one_anchor(out)


def test_a_cluster_left_out_of_the_unit_keeps_nothing() -> None:
    """c1's first contribution arrives non-finite (its transport sends NaN): weight 0 in every unit, so it lands
    on θ̄_new on every row — the experts it did not send too — while c0 and c2 keep their own Δ on theirs."""
    faults = FaultInjector([{"kind": "nan_payload", "group": 1, "start": 0, "end": H}], group=1, vocab_size=2)
    out = run_inproc(NAMES, _cfg("at_end", min_tokens=1, syncs=2), routed=_routed(), flush_each_step=True,
                     after_at=(H - 1,), wraps={"c1": lambda t, step: ByzantineTransport(t, faults, step)})
    first = [e for e in out["c1"].events if e["event"] == "sync"][0]
    assert first["weight"] == 0.0 and first["unsent_params"] == 2 * (ROWS * 24 + ROWS)
    after = out["c1"].snapshots[("after", H - 1)]
    assert all(torch.equal(x, a) for x, a in zip(after["params"], [a for u in after["anchor"] for a in u]))
    deltas = _first_deltas()
    for i in (0, 2):
        _check_kept(out[NAMES[i]].snapshots[("after", H - 1)], deltas[i][1], COUNTS[i] == 0)
    _ends_on_one_anchor(out)


def test_the_rows_kept_are_this_ranks_rows_of_its_shard() -> None:
    """FSDP2 Shard(0) over 2 ranks: rank 1 holds rows 12..23 of unit "2"'s weight; expert 2 (rows 12..17) does
    not go, so rank 1 keeps its local rows 0..5 (a copy), rank 0 none; a parameter sent whole keeps nothing."""
    class Sharded:  # what shard_range sees of a DTensor: the global shape and a local part
        def __init__(self, rows: int, rank: int) -> None:
            self.shape, self.rank = (24, 24)[:rows], rank

        def to_local(self) -> torch.Tensor:
            return torch.zeros(12, *self.shape[1:])

    sends = torch.tensor([True, True, False, True]).repeat_interleave(ROWS)
    for rank in (0, 1):
        delta = [torch.arange(12 * 24, dtype=torch.float32).reshape(12, 24) + 1000 * rank, torch.ones(12)]
        held = unsent_rows(delta, [sends, None], [Sharded(2, rank), Sharded(1, rank)], rank, 2)
        if rank == 0:
            assert held == []
            continue
        ((k, idx, rows),) = held
        assert k == 0 and idx.tolist() == list(range(ROWS)) and torch.equal(rows, delta[0][:ROWS])
        delta[0].zero_()
        assert float(rows.abs().min()) > 0.0  # a copy: the Δ may change after the launch


def test_the_counts_of_an_aborted_round_go_into_the_next() -> None:
    """c2 vanishes at the vote of sync 2: the survivors roll back and keep that interval's counts, so the sync
    that follows carries two intervals' (takes 2 + 3 = 5 x COUNTS), the one after its own (4 x)."""
    takes: list[int] = []
    out = run_inproc(NAMES, _cfg("at_end", "expert_sum_rule:TokenSum", syncs=4), routed=_routed(takes),
                     before=lambda hub: hub.kill_at("c2", "allgather", 4))
    assert out["c2"].killed
    for i, n in enumerate(NAMES[:2]):
        rule = out[n].algo.rule  # type: ignore[union-attr]
        seen = [float(s[i].sum() / COUNTS[i].sum()) for s in rule.seen]
        assert seen == [1.0, 2.0, 5.0, 4.0], (n, seen)
        assert out[n].algo.driver.core.experts.pending is None  # type: ignore[union-attr]


def test_counts_are_kept_until_the_round_commits() -> None:
    got = iter([torch.tensor([[1, 2]]), torch.tensor([[10, 20]]), torch.tensor([[100, 200]])])
    ex = Experts(RoutedCounts(lambda: next(got), lambda *_: None), [])
    assert ex.take() == [1.0, 2.0] and ex.width == 2
    assert ex.take() == [11.0, 22.0]  # the first round did not commit
    ex.committed()
    assert ex.pending is None and ex.take() == [100.0, 200.0]


# ------------------------------------------------------------------------------------------ config + a run
def test_what_expert_weights_cannot_go_with_is_refused_in_one_line() -> None:
    cfg = Config()
    cfg.algo.local_sgd, cfg.cluster.count = True, 6
    cfg.algo.rule.verified.expert_weights = "tokens"
    with pytest.raises(ConfigError, match="algo.rule.verified.expert_weights: tokens: above sync.gather_max=4"):
        validate(cfg)
    cfg.cluster.count, cfg.algo.rule.verified.expert_min_tokens, cfg.sync.compression = 2, 16, "int8"
    with pytest.raises(ConfigError, match="algo.rule.verified.expert_min_tokens: rows a cluster does not send"):
        validate(cfg)
    cfg.sync.compression, cfg.algo.rule.verified.expert_weights = "none", "none"
    with pytest.raises((ConfigError, ValueError), match="expert_min_tokens"):
        validate(cfg)


def test_a_moe_run_weighs_its_experts_by_the_tokens_it_routed(tmp_path: Path, small_corpus: str) -> None:
    """One cluster of edit on the tiny MoE with expert_weights=tokens: every sync says each expert's weight (1 for
    an expert it routed at least expert_min_tokens tokens to, alone) and the loss stays finite."""
    run_train(tiny_overrides(tmp_path, small_corpus, "algo=edit", "train.steps=8", "algo.interval=4",
                             "algo.warmup_steps=0", "train.eval_every=0", "checkpoint.at_end=false",
                             "algo.rule.verified.expert_weights=tokens",
                             "algo.rule.verified.expert_min_tokens=1"))
    events = read_events(tmp_path / "metrics.jsonl")
    syncs = [e for e in events if e["event"] == "sync"]
    experts = [e for e in events if e["event"] == "experts"]
    assert len(syncs) == 2 and len(experts) == 2
    for s, x in zip(syncs, experts):
        assert sorted(s["expert_weights"]) == ["layers.1", "layers.2", "layers.3"]
        for j, (unit, w) in enumerate(sorted(s["expert_weights"].items())):
            assert w == [1.0 if c >= 1 else 0.0 for c in x["counts"][j]], unit
    assert all(math.isfinite(e["loss"]) for e in events if e["event"] == "train")
