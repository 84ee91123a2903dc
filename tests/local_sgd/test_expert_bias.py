"""algo.expert_bias (issue 68): what a sync does to the routers' expert bias — the public update rule, the three
rules' closed forms after k syncs, the bounds on what a cluster reports (a 100x-counts liar), expert subsets."""

from __future__ import annotations

import pytest
import torch

from edit_train.local_sgd.moe.expert_bias import (BiasHook, BiasSync, bound_biases, bound_counts, max_violation,
                                              mean_bias, sign_update)
from edit_train.model.moe import bias_update

pytestmark = pytest.mark.usefixtures("torch_one_thread")

U = 1e-3
L, E, K = 2, 8, 2


class Site:
    """One cluster's expert bias (the model's buffer) and its BiasSync, with the per-step update the model makes."""

    def __init__(self, rule: str, owned: torch.Tensor | None = None) -> None:
        self.bias = torch.zeros(L, E, dtype=torch.float32)
        self.hook = BiasHook(lambda: self.bias.clone(), self._set, U, True, K,
                             owned=(lambda: owned) if owned is not None else (lambda: None))
        self.sync = BiasSync(rule, self.hook)
        self.sync.start()

    def _set(self, t: torch.Tensor) -> None:
        self.bias = t.to(torch.float32).clone()

    def step(self, load: torch.Tensor) -> None:
        """The model's per-step update, its load through the rule's (`LocalSGD.bias_load`: global adds the others')."""
        fed = self.sync.step_load()
        load = load if fed is None else fed(load)
        self.bias = self.bias + torch.stack([bias_update(row, U) for row in load])


def _sync(sites: list[Site], counts: list[torch.Tensor], steps: int, tokens: list[float],
          name: object = None, total: int | None = None) -> torch.Tensor:
    """One committed round among `sites` (the exchange every cluster reads the same): returns the columns."""
    columns = torch.tensor([s.sync.payload() for s in sites], dtype=torch.float64)
    c = torch.stack(counts).to(torch.float64)
    for me, s in enumerate(sites):
        s.sync.committed([f"c{i}" for i in range(len(sites))], c, columns, torch.full((len(sites),), float(steps)),
                         torch.tensor(tokens, dtype=torch.float64), me, name if name is not None else lambda i, w: None,
                         torch.full((len(sites),), float(total if total is not None else steps)))
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
    """k syncs of H local steps from per-step loads L_{i,t}:
    mean   — b_i ← b̄ + Σ_t update(L_{i,t}); b̄ ← mean_i b_i; every cluster continues from b̄;
    global — b_i ← b̄ + Σ_t update(R_i ⊙ L_{i,t} + A_i) with, from the last interval's counts C (none at first),
             R_i = Σ_j C_j / C_i where C_i > 0 (else 1) and A_i = Σ_{j≠i} C_j / H where C_i = 0 (else 0);
             b̄ ← Σ_i C_i ⊙ b_i / Σ_i C_i per expert; every cluster continues from b̄ (all hold the same bias);
    local  — b_i ← b_i + Σ_t update(L_{i,t}), untouched by the syncs; b̄ as global's."""
    k, h, tokens = 3, 4, 1000.0
    sites = [Site(rule), Site(rule)]
    ref = [torch.zeros(L, E, dtype=torch.float64) for _ in sites]  # each cluster's bias, closed form
    anchor = torch.zeros(L, E, dtype=torch.float64)
    fed: list = [None, None]  # global: each site's (R, A) of the last interval
    upd = lambda load: torch.stack([bias_update(row, U) for row in load]).to(torch.float64)  # noqa: E731
    for j in range(k):
        counts = []
        for i, s in enumerate(sites):
            c = torch.zeros(L, E)
            for t in range(h):
                load = _loads(i, j, t)
                s.step(load)
                if rule == "global" and fed[i] is not None:
                    ref[i] += upd(load.double() * fed[i][0] + fed[i][1])
                else:
                    ref[i] += upd(load)
                c += load
            counts.append(c)
        _sync(sites, counts, h, [tokens, tokens], total=h * (j + 1))
        cs = torch.stack(counts).double()
        if rule == "mean":
            anchor = (ref[0] + ref[1]) / 2
        else:
            anchor = (cs[0] * ref[0] + cs[1] * ref[1]) / cs.sum(0)
        if rule == "global":
            total = cs.sum(0)
            fed = [(torch.where(cs[i] > 0, total / cs[i].clamp_min(1e-300), 1.0),
                    torch.where(cs[i] > 0, 0.0, cs[1 - i] / h)) for i in range(2)]
        if rule != "local":
            ref = [anchor.clone(), anchor.clone()]
        for i, s in enumerate(sites):
            assert torch.allclose(s.sync.anchor, anchor, atol=1e-6), (rule, j)
            assert torch.allclose(s.bias.to(torch.float64), ref[i], atol=1e-5), (rule, j)
    if rule == "global":
        assert torch.equal(sites[0].bias, sites[1].bias)  # every cluster holds the same bias
    if rule == "local":
        assert not torch.allclose(sites[0].bias, sites[1].bias)  # each kept its own
        sites[0].sync.to_anchor()  # the run's end / a joiner: the anchor's bias
        assert torch.equal(sites[0].bias, sites[0].sync.anchor.to(torch.float32))


def test_an_overlapped_commit_keeps_the_bias_moves_since_the_exchange() -> None:
    a, b = Site("global"), Site("global")
    columns = torch.tensor([a.sync.payload(), b.sync.payload()], dtype=torch.float64)
    a.step(_loads(0, 0, 0))  # a local step while the round is in flight
    moved = a.bias.to(torch.float64).clone()
    counts = torch.stack([_loads(0, 0, 0), _loads(1, 0, 0)]).to(torch.float64)
    a.sync.committed(["c0", "c1"], counts, columns, torch.tensor([1.0, 1.0]), torch.tensor([100.0, 100.0]), 0)
    assert torch.allclose(a.bias.to(torch.float64), a.sync.anchor + moved, atol=1e-7)


def test_a_liar_reporting_100x_counts_for_one_expert_is_bounded_by_its_tokens() -> None:
    """Three sites, one of which reports 100x its counts for one expert: its counts are cut to what its tokens hold
    (an expert at most once per token, k per token in all: the largest counts cut to one level) and it is named.
    The lie on its most-loaded expert comes back to its honest count exactly: no honest site's anchor or per-step
    load moves at all; a lie on another expert moves them by no more than that expert's count up to T allows."""
    h, tokens = 8, 200.0
    g = torch.Generator().manual_seed(5)
    honest = []
    for _ in range(3):  # whole counts, each layer's row summing to k·T, as top-k routing gives
        picks = torch.multinomial(torch.rand(E, generator=g) + 0.2, int(K * tokens) * L, replacement=True,
                                  generator=g).reshape(L, -1)
        honest.append(torch.stack([torch.bincount(p, minlength=E) for p in picks]).double())
    top = int(honest[2][0].argmax())

    def run(counts: list[torch.Tensor]) -> tuple[list[Site], list[tuple[int, str]]]:
        named: list[tuple[int, str]] = []
        sites = [Site("global") for _ in range(3)]
        for i, s in enumerate(sites):
            s.bias = s.bias + 0.0002 * (i + 1) * torch.arange(E, dtype=torch.float32)  # some bias to weigh
        _sync(sites, counts, h, [tokens] * 3, lambda i, what: named.append((i, what)))
        return sites, named

    base, none = run(honest)
    assert none == []
    for expert, exact in ((top, True), ((top + 1) % E, False)):
        lie = [c.clone() for c in honest]
        lie[2][0, expert] *= 100  # layer 0
        bounded, cut = bound_counts(torch.stack(lie), torch.full((3,), tokens), K)
        assert cut == [2]
        assert bool((bounded[2] <= tokens).all()) and bool((bounded[2].sum(-1) <= K * tokens * (1 + 1e-12)).all())
        sites, named = run(lie)
        assert {i for i, _ in named} == {2} and "routed counts" in named[0][1]
        for s, b in zip(sites[:2], base[:2]):
            if exact:
                assert torch.allclose(s.sync.anchor, b.sync.anchor, atol=1e-12)
                assert torch.allclose(s.sync.fed, b.sync.fed, atol=1e-9)
            else:  # what a site that routed up to T tokens to the expert could have done, no more
                assert float((s.sync.fed - b.sync.fed).abs().max()) <= tokens
            unbounded = torch.stack(lie).double().sum(0)
            assert float((unbounded - s.sync.fed).abs().max()) > tokens  # the bound did something


def test_a_bias_further_than_its_steps_move_it_is_cut_under_mean() -> None:
    """Each reported bias within 4u·s of the quorum's elementwise lower median (the same reference everywhere)."""
    biases = torch.zeros(3, L, E, dtype=torch.float64)
    biases[0] += 2 * U * 4  # within 4 steps' reach of the median (0)
    biases[2, :, 0] = 100.0  # a liar
    out, cut = bound_biases(biases, torch.tensor([4.0, 4.0, 4.0]), U)
    assert cut == [2]
    assert float(out[2, 0, 0]) == pytest.approx(2 * U * 4 + 4 * U * 4)  # the median there is site 0's
    assert torch.equal(out[:2], biases[:2])
    nan = biases.clone()
    nan[1, 0, 0] = float("nan")
    out, cut = bound_biases(nan, torch.tensor([4.0, 4.0, 4.0]), U)
    assert cut == [1, 2] and bool(torch.isfinite(out).all())


def test_expert_subsets_an_expert_a_site_does_not_own_gets_no_update_from_it() -> None:
    """expert_subsets=split with two sites: site i owns the experts e with e % 2 == i and reports 0 for the others.
    Whatever a site did to its bias on an expert it does not own, that expert's anchor bias is its owner's (mean:
    the owners' mean; global / local: weighted by the owners' counts); an expert nobody owns (or, weighted, nobody
    routed a token to) keeps the anchor's bias; global's per-step load from the others is the owners' load."""
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
            results.append((sites[0].sync.anchor.clone(), [s.bias.clone() for s in sites], sites))
        (a0, b0, sites), (a1, _, _) = results
        assert torch.equal(a0, a1), rule  # nobody's bias on an expert it does not own reaches the anchor
        mine = torch.where(owned[0], b0[0].to(torch.float64), 0) + torch.where(owned[1], b0[1].to(torch.float64), 0)
        if rule != "local":  # (local: b0 is each site's own bias, which its sync leaves alone)
            assert torch.allclose(a0, mine.to(torch.float32).double(), atol=1e-7), rule
        if rule == "global":  # site 0's per-step load from the others: site 1's (its owned experts only) per step
            assert torch.equal(sites[0].sync.others, counts[1].double())
            est = sites[0].sync.step_load()(torch.ones(L, E))  # where it routed nothing: the owner's load
            assert torch.equal(est[~owned[0]], 1 + counts[1].double()[~owned[0]])
    anchor = torch.full((L, E), 0.25, dtype=torch.float64)
    nobody = torch.ones(2, L, E, dtype=torch.bool)
    nobody[:, :, 0] = False
    biases = torch.randn(2, L, E, dtype=torch.float64)
    assert torch.equal(mean_bias(biases, anchor, nobody)[:, 0], anchor[:, 0])
    unrouted = torch.ones(2, L, E)
    unrouted[:, :, 3] = 0
    assert torch.equal(mean_bias(biases, anchor, None, unrouted)[:, 3], anchor[:, 3])


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
    with pytest.raises(ValueError, match="not a record"):
        t.sync.load_json([1, 2], "checkpoint")
    with pytest.raises(ValueError, match="algo.expert_bias"):
        BiasSync("median", s.hook)


def test_the_report_draws_maxvio_per_site_and_the_federation(tmp_path) -> None:
    """edit-train-report's expert_maxvio.png from the `sync` events; maxvio_series extracts the numbers (per sync,
    per cluster, per MoE layer; the first cluster's events), and the W&B sink's metrics of one event."""
    import json

    from edit_train.report import load_run
    from edit_train.report.maxvio import maxvio_series, plot_maxvio
    from edit_train.train.wandb_sink import maxvio_metrics

    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for g, name in enumerate(("a", "b")):
        for k in range(3):
            eb = {"rule": "global", "spread": 0.0,
                  "maxvio": {"clusters": {"a": [1.0 + k, 2.0], "b": [0.5, 0.5 * k]}, "federation": [0.1 * k, 0.2]}}
            lines.append({"event": "sync", "step": 8 * (k + 1), "sync": k + 1, "cluster_index": g, "cluster": name,
                          "expert_bias": eb})
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    d = maxvio_series(load_run(run))
    assert d is not None and d.syncs == [1, 2, 3] and d.layers == 2 and d.rule == "global"
    assert d.clusters["a"] == [[1.0, 2.0], [2.0, 2.0], [3.0, 2.0]]
    assert d.federation[2] == pytest.approx([0.2, 0.2])
    png = plot_maxvio([load_run(run)], tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = maxvio_metrics(lines[-1]["expert_bias"])
    assert m["sync/maxvio/federation"] == pytest.approx(0.2) and m["sync/maxvio/a/layer0"] == 3.0
    assert maxvio_metrics(None) == {}
