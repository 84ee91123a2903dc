"""Routed tokens per expert (issue 41): the MoE layers' device tally against a brute-force count of the router's
top-k choices, its reset per interval, the `experts` events, which rows of a unit are which expert's, and the
report's heatmap of which cluster feeds which expert."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import read_events, run_train, tiny_overrides
from edit_train.model import CausalLM
from edit_train.model.config import ModelConfig
from edit_train.model.expert_params import count_rows, expert_slices, local_rows
from edit_train.model.moe import MoEBlock
from edit_train.train.parallel import apply_activation_checkpointing
from edit_train.train.routing import RoutedTally

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _tiny(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=16, num_experts=6, num_experts_per_tok=2,
                                moe_intermediate_size=16, intermediate_size=32, first_k_dense_replace=1))


def _brute_force(model: CausalLM) -> tuple[list[torch.Tensor], list]:
    """Per MoE layer, the tokens each expert is among the top-k of (recomputed from the router's logits)."""
    counts = [torch.zeros(b.num_experts, dtype=torch.int64) for b in model.moe_blocks()]

    def hook(i: int, block: MoEBlock):
        def count(_m, _inp, logits: torch.Tensor) -> None:
            top = torch.topk(torch.softmax(logits, -1), block.top_k, dim=-1).indices
            for e in top.reshape(-1).tolist():
                counts[i][e] += 1
        return count

    handles = [b.gate.register_forward_hook(hook(i, b)) for i, b in enumerate(model.moe_blocks())]
    return counts, handles


def test_counts_equal_a_brute_force_count_of_the_routers_top_k() -> None:
    model = _tiny()
    expected, handles = _brute_force(model)
    for seed in range(3):  # three training forwards accumulate
        torch.manual_seed(seed)
        model(torch.randint(0, 64, (3, 20)), torch.randint(0, 64, (3, 20))).loss.backward()
    for h in handles:
        h.remove()
    got = model.expert_counts()
    assert got.dtype == torch.int64 and got.shape == (2, 6) and model.moe_layers() == [1, 2]
    assert torch.equal(got, torch.stack(expected))
    assert got.sum(1).tolist() == [3 * 3 * 20 * 2] * 2  # every token routed to exactly k experts
    model.eval()
    with torch.no_grad():
        model(torch.randint(0, 64, (3, 20)))  # evaluation and probes do not count
    assert torch.equal(model.expert_counts(), got)
    model.reset_expert_counts()
    assert not model.expert_counts().any()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm unavailable")
def test_counting_reads_nothing_back_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the grouped experts path (no host sync of its own) the tally adds none: training steps and reading the
    counts as a tensor never call `.tolist()` / `.item()` / `bincount` (tests/model/test_experts.py, the same check)."""
    model = _tiny()
    for block in model.moe_blocks():
        block.experts.impl = "grouped"
    x = torch.randint(0, 64, (2, 16))

    def host_read(*_a, **_k):
        raise AssertionError("host read while counting routed tokens")

    for name in ("tolist", "item", "__int__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    monkeypatch.setattr(torch, "bincount", host_read)
    for _ in range(2):
        model(x, x).loss.backward()
    counts = model.expert_counts()
    monkeypatch.undo()
    assert counts.sum(1).tolist() == [2 * 2 * 16 * 2] * 2


@pytest.mark.parametrize("mode", ["full", "moe"])
def test_a_recomputed_forward_does_not_count_twice(mode: str) -> None:
    plain = _tiny()
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt, mode) > 0
    x = torch.randint(0, 64, (2, 24))
    for model in (plain, ckpt):
        model(x, x).loss.backward()
    assert plain.expert_counts().sum() > 0 and torch.equal(ckpt.expert_counts(), plain.expert_counts())


def _tally(model: CausalLM, events: list, **kw) -> RoutedTally:
    topo = SimpleNamespace(distributed=False, ranks=1, is_leader=True, index=1, name="c1")
    emit = lambda kind, **f: events.append({"event": kind, **f})  # noqa: E731
    args = {"local_sgd": True, "warmup_steps": 0, "log_every": 10, **kw}
    return RoutedTally(model, topo, emit, lambda: 7, **args)


def test_an_interval_is_read_summed_and_reset() -> None:
    model, events = _tiny(), []
    tally = _tally(model, events)
    x = torch.randint(0, 64, (2, 16))
    model(x, x)
    tally.counted()
    first = tally.take()
    assert first.sum(1).tolist() == [2 * 16 * 2] * 2 and not model.expert_counts().any()
    for _ in range(3):
        model(x, x)
        tally.counted()
    second = tally.take()
    assert torch.equal(second, 3 * first)  # the same batch three times: only this interval's tokens
    assert [(e["event"], e["interval"], e["steps"], e["cluster"], e["cluster_index"], e["step"]) for e in events] == \
        [("experts", 0, 1, "c1", 1, 7), ("experts", 1, 3, "c1", 1, 7)]
    assert events[1]["counts"] == second.tolist() and events[1]["layers"] == [1, 2]


def test_an_interval_closes_where_a_sync_began() -> None:
    tally, closed = _tally(_tiny(), [], warmup_steps=4, log_every=2), []
    local = {5: 1, 6: 2, 7: 0, 8: 1, 9: 0, 10: 1}  # a sync began in steps 7 and 9 (local steps back to 0)
    for step in range(1, 11):
        tally.counted()
        if tally.due(step, local.get(step, 0)):  # steps 1-4: the synchronous warm-up, every log_every
            closed.append(step)
            tally.steps = 0
    assert closed == [2, 4, 7, 9]


def test_which_rows_are_which_experts() -> None:
    """Changing expert e's rows changes the block's output for exactly the tokens routed to e."""
    model = _tiny()
    assert count_rows(model) == {"layers.1": 0, "layers.2": 1}
    unit = model.layers[1]
    params = list(unit.parameters())
    slices = expert_slices(unit, params)
    assert list(slices) == ["mlp"] and len(slices["mlp"]) == 6
    names = {id(p): n for n, p in unit.named_parameters()}
    for e, pieces in enumerate(slices["mlp"]):
        assert [(names[id(params[i])], r) for i, r in pieces] == \
            [(f"mlp.experts.{n}", slice(e, e + 1)) for n in ("gate_proj", "up_proj", "down_proj")]
    assert expert_slices(model.layers[0], list(model.layers[0].parameters())) == {}
    block = unit.mlp
    x = torch.randn(40, 32)
    with torch.no_grad():
        before, routed = block(x), block.route(x)[2]
        for i, rows in slices["mlp"][3]:
            params[i][rows] += 0.5
        changed = (block(x) - before).abs().amax(-1) > 0
    assert changed.any() and torch.equal(changed, (routed == 3).any(-1))


@pytest.mark.parametrize("dim0,ranks", [(8, 2), (6, 4), (5, 3), (3, 4)])
def test_expert_rows_on_a_dim0_shard(dim0: int, ranks: int) -> None:
    full = torch.arange(dim0)
    shards = torch.chunk(full, ranks) + (torch.empty(0),) * (ranks - len(torch.chunk(full, ranks)))
    for e in range(dim0):
        found = [(r, shards[r][s].tolist()) for r in range(ranks) if (s := local_rows(slice(e, e + 1), dim0, r, ranks))]
        assert found and len(found) == 1 and found[0][1] == [e], (e, found)


def test_a_run_logs_one_experts_event_per_interval(tmp_path: Path, small_corpus: str) -> None:
    """One cluster of edit (a sync every 4 steps, no federation): an `experts` event per sync, each holding the
    interval's tokens x k routed per MoE layer."""
    run_train(tiny_overrides(tmp_path, small_corpus, "algo=edit", "train.steps=8", "algo.interval=4",
                             "algo.warmup_steps=0", "train.eval_every=0", "checkpoint.at_end=false"))
    events = [e for e in read_events(tmp_path / "metrics.jsonl") if e["event"] == "experts"]
    assert [(e["step"], e["steps"], e["interval"]) for e in events] == [(4, 4, 0), (8, 4, 1)]
    for e in events:
        assert e["layers"] == [1, 2, 3] and all(sum(row) == 4 * 2 * 32 * 2 for row in e["counts"])


# ------------------------------------------------------------------------------------------------ the report
def _write_run(path: Path, counts: dict[str, list[list[list[int]]]]) -> Path:
    path.mkdir(parents=True)
    lines = []
    for g, (name, per_interval) in enumerate(counts.items()):
        for k, c in enumerate(per_interval):
            lines.append({"event": "experts", "step": 8 * (k + 1), "cluster_index": g, "cluster": name, "interval": k,
                          "steps": 8, "layers": [1, 2], "counts": c})
            lines.append({"event": "train", "step": 8 * (k + 1), "cluster_index": g, "cluster": name, "loss": 2.0,
                          "tokens": 1, "tokens_per_s": 1.0, "wall": 1.0 + k})
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return path


def test_the_report_draws_which_cluster_feeds_which_expert(tmp_path: Path) -> None:
    from edit_train.report import load_run
    from edit_train.report.experts import plot_expert_clusters, routed_shares

    c0 = [[[30, 10, 0], [5, 5, 5]], [[30, 10, 0], [5, 5, 5]]]
    c1 = [[[10, 30, 0], [5, 5, 5]], [[90, 0, 0], [0, 0, 15]]]
    run = _write_run(tmp_path / "run", {"a": c0, "b": c1})
    shares = routed_shares(load_run(run))
    assert shares is not None and shares.clusters == ["a", "b"] and shares.layers == [1, 2]
    assert shares.counts.shape == (2, 3, 2)
    np.testing.assert_allclose(shares.shares[0, :, 0], [60 / 160, 20 / 50, 0])  # expert 2: no tokens, no NaN
    np.testing.assert_allclose(shares.shares[1, :, 1], [5 / 15, 5 / 15, 20 / 30])
    last = routed_shares(load_run(run), last=1)
    np.testing.assert_allclose(last.shares[0, 0], [30 / 120, 90 / 120])
    png = plot_expert_clusters([load_run(run)], tmp_path)  # make_report draws it too (tests/report/test_report.py, PLOTS)
    assert png == tmp_path / "expert_clusters.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
