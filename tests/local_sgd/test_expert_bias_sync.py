"""algo.expert_bias over the in-process federation (issue 68): small Ling 2.0 models whose two clusters see disjoint
halves of the experts' traffic (tests/helpers/bias_federation.py) — the federation's MaxVio under each rule beside one
cluster trained on both halves' tokens, a cluster that reports 100x its counts named and bounded, and the rule's
state carried by checkpoints and heals (a joiner starts from the anchor's bias)."""

from __future__ import annotations

import json

import pytest
import torch

from bias_federation import federation_maxvio, maxvio_tail, run_federation, run_single
from edit_train.local_sgd.moe.expert_bias import max_violation

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SYNCS, H = 32, 8


def test_global_balances_the_federation_as_one_cluster_on_both_halves_would(capsys: pytest.CaptureFixture) -> None:
    """Acceptance 1: over the last half of the run, the federation's MaxVio (mean over its MoE layers and syncs)
    under `global` is within 10 % of one cluster's trained on both halves' tokens (same steps, same intervals);
    `mean` and `local` measured beside it. Under `global` every cluster holds the same bias after every sync."""
    single = maxvio_tail([max_violation(c).tolist() for c in run_single(steps=SYNCS * H, interval=H)], SYNCS // 2)
    measured = {}
    for rule in ("global", "mean", "local"):
        sites = run_federation(rule, syncs=SYNCS, interval=H)
        measured[rule] = maxvio_tail(federation_maxvio(sites[0]), SYNCS // 2)
        assert federation_maxvio(sites[0]) == federation_maxvio(sites[1])  # one number for the federation
        if rule == "global":
            for j in range(SYNCS):
                assert torch.equal(sites[0].biases[H * j + H - 1], sites[1].biases[H * j + H - 1])
    with capsys.disabled():
        print(f"\nMaxVio (federation, last {SYNCS // 2} intervals): single cluster {single:.3f}, "
              + ", ".join(f"{r} {v:.3f}" for r, v in measured.items()))
    assert measured["global"] <= 1.1 * single


def test_a_cluster_reporting_100x_its_counts_is_named_and_moves_no_honest_bias() -> None:
    """Acceptance 3 over the in-process federation: cluster c2 reports 100x its counts for its most-loaded expert
    of the first MoE layer at every sync. It is named in the honest clusters' `sync` events; its claim is cut to
    what its tokens hold (back to its honest count: k·T per layer), so the honest clusters end with exactly the
    bias of the run where it told the truth."""
    def lie(counts: torch.Tensor) -> torch.Tensor:
        out = counts.clone()
        out[0, int(counts[0].argmax())] *= 100
        return out

    honest = run_federation("global", sites=3, syncs=4, interval=H)
    lied = run_federation("global", sites=3, syncs=4, interval=H, lies={2: lie})
    for i in (0, 1):
        syncs = [e for e in lied[i].events if e["event"] == "sync"]
        named = {s["cluster"] for e in syncs for s in e["suspects"] if "routed counts" in s["what"]}
        assert named == {"c2"}, syncs[0]["suspects"]
        assert not any(e["suspects"] for e in honest[i].events if e["event"] == "sync")
        assert torch.equal(lied[i].bias, honest[i].bias)
        assert torch.equal(lied[i].anchor, honest[i].anchor)
    assert lied[2].seen[0][0].max() > 50 * honest[2].seen[0][0].max()  # it did lie


def test_checkpoint_and_heal_carry_the_rule_and_a_joiner_starts_from_the_anchor() -> None:
    """The sync state's JSON (checkpoint) holds the anchor's bias and global's per-step load of the others
    bit-exactly; a heal payload carries them and the healed cluster's live bias is the anchor's."""
    sites = run_federation("global", syncs=2, interval=4)
    src, dst = sites[0].algo, sites[1].algo
    assert src is not None and dst is not None and src.bias is not None and dst.bias is not None
    state = json.loads(json.dumps(src.state.json()))
    assert state["expert_bias"]["rule"] == "global"
    dst.bias.anchor, dst.bias.others = None, None
    dst.bias.load_json(state["expert_bias"], "checkpoint")
    assert torch.equal(dst.bias.anchor, src.bias.anchor) and torch.equal(dst.bias.others, src.bias.others)
    assert torch.equal(dst.bias.own, src.bias.own) and torch.equal(dst.bias.fed, src.bias.fed)

    meta, local = src.state.heal_out()
    tensors = {k: t for k, (t, _) in local.items()}
    dst.bias.hook.set(torch.full_like(dst.bias.hook.get(), 0.5))  # a joiner's own (stale) bias
    dst.state.heal_in(json.loads(json.dumps(meta)), tensors)
    assert torch.equal(dst.bias.hook.get(), src.bias.anchor.to(torch.float32))
    bad = {**meta, "expert_bias": {"anchor": [[1.0]]}}
    with pytest.raises(Exception, match="expert_bias anchor has shape"):
        dst.state.heal_in(bad, tensors)


@pytest.mark.parametrize("rule", ["global", "local"])
def test_a_resumed_federation_is_bit_identical(rule: str) -> None:
    """Both clusters stop after two syncs (their checkpoints: model with its expert-bias buffers, optimizer, the
    sync state's tensors and JSON) and resume from them: every cluster's live bias, anchor bias and parameters at
    the end equal the uninterrupted run's bit for bit."""
    full = run_federation(rule, syncs=4, interval=4)
    first = run_federation(rule, syncs=4, interval=4, stop_at=8)
    saved = [s.saved for s in first]
    assert all(s is not None for s in saved)
    assert json.loads(saved[0]["json"])["expert_bias"]["rule"] == rule
    second = run_federation(rule, syncs=4, interval=4, resume=saved)  # type: ignore[arg-type]
    for a, b in zip(full, second):
        assert len(b.biases) == 8 and [e["sync"] for e in b.events if e["event"] == "sync"] == [3, 4]  # resumed
        assert torch.equal(a.bias, b.bias) and torch.equal(a.anchor, b.anchor)
        pa = [p for p in a.algo.replica.model.parameters()]
        pb = [p for p in b.algo.replica.model.parameters()]
        assert all(torch.equal(x, y) for x, y in zip(pa, pb))
