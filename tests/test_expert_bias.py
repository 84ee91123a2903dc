"""algo.expert_bias (issue 68): what a sync does to the routers' expert bias — the public update rule, the three rules'
closed forms after k syncs, the bounds on what a cluster reports (a 100x-counts liar), expert subsets."""

from __future__ import annotations

import pytest
import torch

from edit_train.local_sgd.expert_bias import (BiasHook, BiasSync, bound_biases, bound_counts, global_update,
                                              max_violation, mean_bias, sign_update)
from edit_train.model.moe import bias_update

pytestmark = pytest.mark.usefixtures("torch_one_thread")

U = 1e-3
L, E, K = 2, 8, 2


class Site:
    """One cluster's router bias (the model's buffer) and its BiasSync, with the per-step update the model makes."""

    def __init__(self, rule: str, owned: torch.Tensor | None = None) -> None:
        self.bias = torch.zeros(L, E, dtype=torch.float32)
        self.hook = BiasHook(lambda: self.bias.clone(), self._set, U, True, K,
                             owned=(lambda: owned) if owned is not None else (lambda: None))
        self.sync = BiasSync(rule, self.hook)
        self.sync.start()

    def _set(self, t: torch.Tensor) -> None:
        self.bias = t.to(torch.float32).clone()

    def step(self, load: torch.Tensor) -> None:
        self.bias = self.bias + torch.stack([bias_update(row, U) for row in load])


def _sync(sites: list[Site], counts: list[torch.Tensor], steps: int, tokens: list[float]) -> torch.Tensor:
    """One committed round among `sites` (the exchange every cluster reads the same): returns the columns."""
    columns = torch.tensor([s.sync.payload() for s in sites], dtype=torch.float64)
    c = torch.stack(counts).to(torch.float64)
    for s in sites:
        s.sync.committed([f"c{i}" for i in range(len(sites))], c, columns, torch.full((len(sites),), float(steps)),
                         torch.tensor(tokens, dtype=torch.float64))
    return columns


def test_the_rule_is_the_models_public_update_rule() -> None:
    g = torch.Generator().manual_seed(0)
    load = torch.randint(0, 50, (5, E), generator=g)
    for zero_mean in (True, False):
        ref = torch.stack([bias_update(row, U, zero_mean) for row in load]).to(torch.float64)
        assert torch.allclose(sign_update(load, U, zero_mean), ref, atol=1e-12)
    active = torch.tensor([True] * 4 + [False] * 4)
    d = sign_update(torch.tensor([1.0, 3, 5, 7, 100, 100, 0, 0]), 1.0, True, active)
    assert d.tolist() == [1.0, 1.0, -1.0, -1.0, 0, 0, 0, 0]  # only the active experts, zero-mean among them


def _loads(site: int, sync: int, step: int) -> torch.Tensor:
    """Site 0 routes mostly to experts 0-3, site 1 to 4-7 (deterministic per step)."""
    g = torch.Generator().manual_seed(100 * sync + 10 * step + site)
    base = torch.tensor([8.0] * 4 + [1.0] * 4) if site == 0 else torch.tensor([1.0] * 4 + [8.0] * 4)
    return (base + torch.randint(0, 4, (L, E), generator=g)).round()


@pytest.mark.parametrize("rule", ["mean", "global", "local"])
def test_closed_form_after_k_syncs(rule: str) -> None:
    """k syncs of H local steps: mean — b̄ₖ = mean of the clusters' biases; global — b̄ₖ = b̄₀ + Σⱼ H·update(Σᵢ loadᵢⱼ);
    local — each cluster's own bias is its local updates alone, the anchor the global closed form."""
    k, h, tokens = 3, 4, 1000.0
    sites = [Site(rule), Site(rule)]
    own = [torch.zeros(L, E, dtype=torch.float64) for _ in sites]  # local only: the sum of a site's own updates
    anchor = torch.zeros(L, E, dtype=torch.float64)  # global closed form
    mean_anchor = torch.zeros(L, E, dtype=torch.float64)
    for j in range(k):
        counts = []
        for i, s in enumerate(sites):
            c = torch.zeros(L, E)
            for t in range(h):
                load = _loads(i, j, t)
                s.step(load)
                own[i] += torch.stack([bias_update(row, U) for row in load]).to(torch.float64)
                c += load
            counts.append(c)
        before = [s.bias.to(torch.float64).clone() for s in sites]
        _sync(sites, counts, h, [tokens, tokens])
        anchor = anchor + h * sign_update(sum(c.double() for c in counts) / (2 * tokens), U)
        mean_anchor = (before[0] + before[1]) / 2
        if rule == "mean":
            for s in sites:
                assert torch.allclose(s.sync.anchor, mean_anchor, atol=1e-9)
                assert torch.allclose(s.bias.to(torch.float64), mean_anchor, atol=1e-6)
        elif rule == "global":
            for s in sites:
                assert torch.allclose(s.sync.anchor, anchor, atol=1e-12)
                assert torch.equal(s.bias, anchor.to(torch.float32))  # every cluster holds the same bias
        else:
            for i, s in enumerate(sites):
                assert torch.allclose(s.sync.anchor, anchor, atol=1e-12)
                assert torch.allclose(s.bias.to(torch.float64), own[i], atol=1e-5)  # untouched by the syncs
    if rule == "local":
        assert not torch.allclose(sites[0].bias, sites[1].bias)  # each kept its own
        sites[0].sync.to_anchor()  # the run's end / a joiner: the anchor's (global) bias
        assert torch.equal(sites[0].bias, anchor.to(torch.float32))


def test_an_overlapped_commit_keeps_the_bias_moves_since_the_exchange() -> None:
    a, b = Site("global"), Site("global")
    columns = torch.tensor([a.sync.payload(), b.sync.payload()], dtype=torch.float64)
    a.step(_loads(0, 0, 0))  # a local step while the round is in flight
    moved = a.bias.to(torch.float64).clone()
    counts = torch.stack([_loads(0, 0, 0), _loads(1, 0, 0)]).to(torch.float64)
    a.sync.committed(["c0", "c1"], counts, columns, torch.tensor([1.0, 1.0]), torch.tensor([100.0, 100.0]))
    assert torch.allclose(a.bias.to(torch.float64), a.sync.anchor + moved, atol=1e-7)


def test_a_liar_reporting_100x_counts_for_one_expert_is_bounded_by_its_tokens() -> None:
    """Three sites, one of which reports 100x its counts for expert 0: its counts are cut to what its tokens hold
    (an expert at most once per token, k per token in all: the largest counts cut to one level), the honest sites'
    bias is the global rule on the bounded counts, the liar is named. Here the cut brings the lie back to its
    honest count, so no honest site's bias moves at all; unbounded, the lie would flip expert 0's update."""
    h, tokens = 8, 200.0
    honest = [torch.full((L, E), tokens * K / E) for _ in range(3)]
    honest[0][:, 0] = 20.0  # expert 0 underloaded at site 0 ...
    honest[1][:, 0] = 30.0  # ... and at site 1: the federation should raise its bias
    lie = [c.clone() for c in honest]
    lie[2][:, 0] = 100 * honest[2][:, 0]
    counts = torch.stack(lie).to(torch.float64)
    bounded, cut = bound_counts(counts, torch.full((3,), tokens), K)
    assert cut == [2]
    assert bool((bounded[2] <= tokens).all()) and bool((bounded[2].sum(-1) <= K * tokens + 1e-9).all())
    assert torch.equal(bounded[:2], counts[:2])  # the honest counts are untouched

    named: list[tuple[int, str]] = []
    sites = [Site("global") for _ in range(3)]
    columns = torch.tensor([s.sync.payload() for s in sites], dtype=torch.float64)
    for s in sites[:2]:
        s.sync.committed(["c0", "c1", "c2"], counts, columns, torch.full((3,), float(h)), torch.full((3,), tokens),
                         lambda i, what: named.append((i, what)))
    assert {i for i, _ in named} == {2}
    want = h * sign_update(bounded.sum(0) / (3 * tokens), U)
    honest_only = h * sign_update(torch.stack(honest).sum(0).to(torch.float64) / (3 * tokens), U)
    assert torch.allclose(bounded[2], torch.stack(honest)[2].double())  # cut to one level: its honest 50
    for s in sites[:2]:
        assert torch.allclose(s.sync.anchor, want, atol=1e-15)
        assert torch.equal(s.sync.anchor, honest_only)  # the liar moved no honest site's bias
    # expert 0 still rises: the bounded claim (200 tokens) cannot outweigh the honest sites' deficit; unbounded,
    # the 100x report (5000) would have made it the most loaded expert and pushed its bias down
    assert float(want[0, 0]) > 0
    assert float(h * sign_update(counts.sum(0) / (3 * tokens), U)[0, 0]) < 0


def test_a_bias_further_than_its_steps_move_it_is_cut_under_mean() -> None:
    anchor = torch.zeros(L, E, dtype=torch.float64)
    biases = torch.zeros(3, L, E, dtype=torch.float64)
    biases[0] += 0.5 * 2 * U * 4  # within 4 steps' reach
    biases[2, :, 0] = 100.0  # a liar
    out, cut = bound_biases(biases, anchor, torch.tensor([4.0, 4.0, 4.0]), U)
    assert cut == [2]
    assert float(out[2, 0, 0]) == pytest.approx(2 * U * 4)
    assert torch.equal(out[:2], biases[:2])


def test_expert_subsets_an_expert_a_site_does_not_own_gets_no_update_from_it() -> None:
    """expert_subsets=split with two sites: site i owns the experts e with e % 2 == i and reports 0 for the others.
    Whatever a site's counts or bias on an expert it does not own, that expert's anchor bias is the owner's:
    mean — the owner's bias; global / local — the update from the owner's load per owner token."""
    owned = [torch.tensor([[e % 2 == i for e in range(E)]] * L) for i in range(2)]
    g = torch.Generator().manual_seed(3)
    counts = torch.stack([torch.where(owned[i], torch.randint(1, 60, (L, E), generator=g), 0) for i in range(2)])
    for rule in ("mean", "global", "local"):
        results = []
        for noise in (0.0, 0.004):
            sites = [Site(rule, owned[i]) for i in range(2)]
            for i, s in enumerate(sites):
                s.step(counts[i])  # its own update, on every expert (the model's per-step rule)
                s.bias = s.bias + torch.where(owned[i], 0.0, noise)  # what it did to the experts it does not own
            _sync(sites, list(counts), 1, [1000.0, 500.0])
            results.append((sites[0].sync.anchor.clone(), [s.bias.clone() for s in sites]))
        (a0, b0), (a1, b1) = results
        assert torch.equal(a0, a1), rule  # nobody's bias on an expert it does not own reaches the anchor
        if rule == "mean":
            mine = torch.where(owned[0], results[0][1][0].to(torch.float64), 0) + \
                torch.where(owned[1], results[0][1][1].to(torch.float64), 0)
            assert torch.allclose(a0, mine, atol=1e-7)
        else:  # each expert's load per token of its owner
            per_token = torch.where(owned[0], counts[0].double() / 1000.0, counts[1].double() / 500.0)
            assert torch.allclose(a0, sign_update(per_token, U), atol=1e-15)
            assert torch.allclose(a0, global_update(counts.double(), torch.tensor([1000.0, 500.0]), 1, U, True,
                                                    torch.stack(owned)))
    # an expert nobody owns keeps the anchor's bias
    nobody = torch.zeros(2, L, E, dtype=torch.bool)
    nobody[:, :, 1:] = True
    anchor = torch.full((L, E), 0.25, dtype=torch.float64)
    assert torch.equal(mean_bias(torch.zeros(2, L, E, dtype=torch.float64), anchor, nobody)[:, 0], anchor[:, 0])
    assert bool((global_update(counts.double(), torch.tensor([1.0, 1.0]), 1, U, True, nobody)[:, 0] == 0).all())


def test_maxvio() -> None:
    load = torch.tensor([[2.0, 2.0, 2.0, 2.0], [4.0, 2.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert max_violation(load).tolist() == [0.0, 1.0, 0.0]
    assert max_violation(torch.tensor([4.0, 2.0, 9.0, 9.0]), torch.tensor([True, True, False, False])).item() == \
        pytest.approx(4 / 3 - 1)


def test_state_round_trips_bit_exact_and_a_bad_one_is_one_line() -> None:
    s = Site("local")
    s.step(_loads(0, 0, 0))
    s.sync.anchor = s.bias.to(torch.float64) * 1.000000123
    state = s.sync.state_json()
    t = Site("local")
    t.sync.load_json(__import__("json").loads(__import__("json").dumps(state)), "checkpoint")
    assert torch.equal(t.sync.anchor, s.sync.anchor)
    with pytest.raises(ValueError, match="expert_bias anchor has shape"):
        t.sync.load_json({"anchor": [[1.0]]}, "checkpoint")
    with pytest.raises(ValueError, match="not a table"):
        t.sync.load_json({"anchor": [["x"] * E] * L}, "checkpoint")
    with pytest.raises(ValueError, match="algo.expert_bias"):
        BiasSync("median", s.hook)
