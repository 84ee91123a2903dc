"""Ling 2.0 (`model=tiny_v2`: sigmoid routing with an expert bias, grouped top-k, QK-norm, half RoPE, one MTP
layer) on a federation, under every sync mode and compression (issue 67).

Two clusters are threads of this process (`federation.inproc`), each the trainer's own pieces: the config
`edit-train` composes, `train/build.local_sgd_config`, `CausalLM`, `build_optimizer`, the FSDP units
(`cluster/mesh.fsdp_units`, the MTP layer one of them), the routed counts the trainer's `RoutedTally` hands the
sync core, the expert bias moved once per optimizer step, and the real `LocalSGD` with the verified rule. Each
run trains, every sync commits on both clusters, both end on one anchor, and the MTP layer's unit is judged by
the verified rule like any other unit (it has a decision in every sync). One whole `edit-train model=tiny_v2`
run (the default demo: 2 clusters, A-EDiT, its own processes and Lighthouse) checks the `mtp_loss` series.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import read_events
from edit_train.cli.common import compose
from edit_train.cluster.group import RankGroup
from edit_train.cluster.mesh import fsdp_units
from edit_train.codec.dense import CompressionConfig
from edit_train.federation import heal
from edit_train.federation.inproc import InProcessFederation
from edit_train.local_sgd.errors import SyncAborted
from edit_train.local_sgd.moe.experts import RoutedCounts
from edit_train.local_sgd.sync import records
from edit_train.local_sgd.sync.algorithms import LocalSGD
from edit_train.model import CausalLM
from edit_train.model.expert_params import sync_pieces
from edit_train.train.build import local_sgd_config
from edit_train.train.optim import build_optimizer
from fed_utils import finish, start

NAMES = ["c0", "c1"]
STEPS, INTERVAL, BATCH, SEQ = 8, 2, 2, 32
MTP_UNIT = "layers.4"  # tiny_v2: 4 decoder layers, then the MTP layer (BailingMoeV2 names it model.layers.4)

_INIT = threading.Lock()  # the global RNG: clusters that are threads must not interleave their inits


def _batch(cluster: int, step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable stream: each row counts up by a stride from a random start (mod 48), so token t+1 and t+2
    follow from token t (the MTP layer has something to learn too); each cluster its own stride."""
    g = torch.Generator().manual_seed(1000 * cluster + step)
    start_ = torch.randint(0, 48, (BATCH, 1), generator=g)
    ids = (start_ + (cluster + 1) * torch.arange(SEQ + 1)) % 48
    assert vocab > 48
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _cluster(index: int, cfg: Any, hub: InProcessFederation, out: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    name = NAMES[index]
    with _INIT:
        torch.manual_seed(cfg.seed)
        model = CausalLM(cfg.model)
    optimizer = build_optimizer(model.named_parameters(), cfg.train, torch.device("cpu"))
    events: list[dict[str, Any]] = []

    def take() -> torch.Tensor:  # RoutedTally.take on one rank
        counts = model.expert_counts().clone()
        model.reset_expert_counts()
        return counts

    held_out = _batch(index, 10_000, cfg.model.vocab_size)

    def probe() -> float:  # the trainer's usefulness probe: the model's loss on a fixed batch
        with torch.no_grad():
            return float(model(*held_out).ce_loss)

    def held() -> tuple[float, float]:  # (next-token, MTP) loss on the held-out batch
        with torch.no_grad():
            o = model(*held_out)
        return float(o.ce_loss), float(o.mtp_loss)

    transport = hub.transport(name, RankGroup(), compression=CompressionConfig.of(cfg.sync))
    algo = LocalSGD(local_sgd_config(cfg), model, fsdp_units(model), transport, (heal.encode, heal.decode),
                    emit=lambda event, **kw: events.append({"event": event, **kw}), cluster_index=index,
                    optimizer=optimizer, probe_loss=probe, routed_counts=RoutedCounts(take, sync_pieces(model)))
    losses: list[float] = []
    mtp: list[float] = []
    before = held()
    step = algo.join() or 0
    while not algo.should_stop(step):
        model.set_step(step)
        x, y = _batch(index, step, cfg.model.vocab_size)
        try:
            o = model(x, y)
        except SyncAborted:  # a rolled-back layer-wise sync: the forward runs again (the trainer's loop)
            o = model(x, y)
        o.loss.backward()
        algo.after_backward(step)
        optimizer.step()
        model.update_expert_bias()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(o.ce_loss.detach()))
        mtp.append(float(o.mtp_loss.detach()))
        outcome = algo.after_step(step, 0.01)
        step = outcome.adopt_step if outcome.adopt_step is not None else step + 1
    algo.finish()
    assert algo.driver is not None
    anchors = {u.name: [a.clone() for a in algo.driver.core.outer.anchors[u.name]] for u in algo.replica.units}
    out[name] = {"losses": losses, "mtp": mtp, "held": (before, held()), "events": events, "anchors": anchors,
                 "units": [u.name for u in algo.replica.units],
                 "bias": [b.gate.expert_bias.clone() for b in model.moe_blocks()]}
    algo.close()


def _federation(mode: str, compression: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], list[Any]]:
    """Both clusters' outcomes, and every `SyncReport` the clusters completed (its per-unit decisions)."""
    cfg = compose(["model=tiny_v2", "algo=edit", "cluster=local_2x1", f"algo.interval={INTERVAL}",
                   f"train.steps={STEPS}", f"train.batch_size={BATCH}", f"train.seq_len={SEQ}", "train.lr=3e-3",
                   "algo.rule.verified.warmup_syncs=1", f"sync.mode={mode}", f"sync.compression={compression}",
                   "logger=none"])
    reports: list[Any] = []
    completed = records.Records.completed

    def keep(self: records.Records, report: Any) -> None:
        reports.append(report)
        completed(self, report)

    monkeypatch.setattr(records.Records, "completed", keep)
    hub = InProcessFederation(min_clusters=2, join_timeout_s=60.0, timeout_s=60.0)
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            _cluster(i, cfg, hub, out)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(NAMES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a cluster thread hung"
    return out, reports


COMBINATIONS = [(m, c) for m in ("layerwise", "at_end", "overlap") for c in ("none", "bf16", "int8", "topk")]
DEFAULT_SUITE = {("layerwise", "none"), ("at_end", "int8"), ("overlap", "topk")}  # each mode once


@pytest.mark.parametrize("mode,compression", [
    pytest.param(m, c, marks=() if (m, c) in DEFAULT_SUITE else pytest.mark.slow, id=f"{m}-{c}")
    for m, c in COMBINATIONS])
def test_tiny_v2_trains_on_a_federation_and_the_verified_rule_judges_its_mtp_layer(
        mode: str, compression: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out, reports = _federation(mode, compression, monkeypatch)
    syncs = STEPS // INTERVAL
    for name in NAMES:
        o = out[name]
        assert MTP_UNIT in o["units"]  # the MTP layer is a sync unit of its own
        assert all(math.isfinite(v) for v in o["losses"] + o["mtp"]), name
        # it learns the stream, the MTP layer too (top-k sends ~1 % of each Δ: the anchor moves less in 4 syncs)
        (ce0, mtp0), (ce1, mtp1) = o["held"]
        fall = (0.2, 0.1) if compression == "topk" else (1.0, 0.9)
        assert ce1 < ce0 - fall[0] and mtp1 < mtp0 - fall[1], (name, o["held"])
        done = [e for e in o["events"] if e["event"] == "sync"]
        assert [e["sync"] for e in done] == list(range(1, syncs + 1)), name  # every sync committed
        assert not [e for e in o["events"] if e["event"] == "sync_aborted"]
        assert all(e["quorum"] == NAMES for e in done)
        assert len(o["bias"]) == 4 and all(float(b.abs().sum()) > 0 for b in o["bias"])  # the bias moved
    # both clusters end on one anchor (the MTP layer's included)
    for unit, tensors in out["c0"]["anchors"].items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, out["c1"]["anchors"][unit])), unit
    # the verified rule decided on the MTP layer's unit in every sync, on both clusters, with both clusters in it
    assert len(reports) == len(NAMES) * syncs
    for r in reports:
        assert set(r.decisions) == set(out["c0"]["units"]), sorted(r.decisions)
        d = r.decisions[MTP_UNIT]
        assert d.module == MTP_UNIT and len(d.weights) == 2 and not any(d.left_out)
        assert sum(d.weights) == pytest.approx(1.0) and d.evidence  # the verified rule's evidence on it


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run (the in-process runs above cover the sync)
def test_edit_train_model_tiny_v2_completes_the_default_demo(tmp_path: Path, corpus: str) -> None:
    """`edit-train model=tiny_v2` on the default demo (A-EDiT, 2 clusters of different speed over a slow link),
    shortened: it completes, the val loss falls, both clusters sync, and `metrics.jsonl` holds a `mtp_loss` series."""
    run = tmp_path / "demo"
    finish(start(run, corpus, "model=tiny_v2", "algo=a_edit", "cluster=hetero_2x1", "train.steps=32",
                 "train.batch_size=4", "train.log_every=1"), timeout=600)  # 2 syncs of 5 s; every step logs
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["final_val_loss"] < summary["initial_val_loss"] - 0.3, summary
    events = read_events(run / "metrics.jsonl")
    for name in NAMES:
        assert [e for e in events if e["event"] == "sync" and e["cluster"] == name], name
        mtp = [e["mtp_loss"] for e in events if e["event"] == "moe" and e["cluster"] == name]
        assert mtp and all(math.isfinite(v) and v > 0 for v in mtp), name
