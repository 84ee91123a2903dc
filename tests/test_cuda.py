"""GPU paths: bf16 (autocast and FSDP2 mixed precision), activation checkpointing and grouped experts in a
real training run, and a federation of one CUDA cluster and one CPU cluster. Every test is marked `cuda`
and skipped without a CUDA device (run them with `pytest -m cuda` on a GPU machine).

The multi-process tests start the ranks themselves (env:// rendezvous on 127.0.0.1) and build a `Trainer`
per rank, so the test can look inside it (parameter dtypes, anchors, which expert path ran).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from conftest import read_events, tiny_overrides
from mp_utils import free_port

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _trainer(overrides: list[str]):  # type: ignore[no-untyped-def]
    from edit_train.cli.common import compose
    from edit_train.train.trainer import Trainer

    return Trainer(compose(overrides))


def _rank_entry(rank: int, world: int, port: int, out_dir: str, per_rank: list[list[str]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    trainer = _trainer(per_rank[rank])
    summary = trainer.run()
    params = list(trainer.model.parameters())
    anchors = [a for ts in trainer.algo.engine.outer.anchors.values() for a in ts] if trainer.algo.engine else []
    result: dict[str, Any] = {
        "device": str(trainer.topo.device),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "param_is_dtensor": all(hasattr(p, "to_local") for p in params),
        "anchor_dtypes": sorted({str(a.dtype) for a in anchors}),
        "fsdp_param_dtype": str(trainer.precision.fsdp_param_dtype),
        "autocast_dtype": str(trainer.precision.autocast_dtype),
        "summary": summary if rank == 0 else None,
        "final_params": [float(p.detach().float().to_local().sum() if hasattr(p, "to_local")
                               else p.detach().float().sum()) for p in params],
    }
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _spawn(per_rank: list[list[str]]) -> list[dict[str, Any]]:
    world = len(per_rank)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_entry, args=(world, free_port(), out, per_rank), nprocs=world, join=True,
                           start_method="spawn")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def test_single_gpu_bf16_checkpointed_grouped_run(tmp_path, small_corpus) -> None:
    """One GPU, unsharded: bf16 autocast, full activation checkpointing, grouped experts (auto); the loss
    is finite, master weights stay fp32, and MFU is logged when the GPU is in the peak table."""
    from edit_train.train.mfu import lookup_peak

    trainer = _trainer(tiny_overrides(tmp_path, small_corpus, "train.device=cuda", "train.precision=bf16",
                                      "train.activation_checkpointing=full", "train.steps=8"))
    summary = trainer.run()
    assert summary["completed"] and summary["final_val_loss"] < summary["initial_val_loss"]
    assert trainer.precision.autocast_dtype == torch.bfloat16 and trainer.precision.fsdp_param_dtype is None
    assert all(p.dtype == torch.float32 and p.is_cuda for p in trainer.model.parameters())
    assert {b.experts.last_impl for b in trainer.model.moe_blocks()} == {"grouped"}
    events = [e for e in read_events(tmp_path / "metrics.jsonl") if e["event"] == "train"]
    if lookup_peak(torch.cuda.get_device_name()) is not None:
        assert all(0 < e["mfu"] < 1 for e in events) and 0 < summary["mfu"] < 1
    else:
        assert all(e["mfu"] is None for e in events)


def test_grouped_and_sorted_runs_agree_on_gpu(tmp_path, small_corpus) -> None:
    losses = {}
    for impl in ("grouped", "sorted"):
        run_train_dir = tmp_path / impl
        trainer = _trainer(tiny_overrides(run_train_dir, small_corpus, "train.device=cuda", "train.precision=bf16",
                                          f"model.expert_impl={impl}", "train.steps=4", "train.log_every=1"))
        trainer.run()
        losses[impl] = [e["loss"] for e in read_events(run_train_dir / "metrics.jsonl") if e["event"] == "train"]
    assert losses["grouped"] == pytest.approx(losses["sorted"], rel=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fsdp2_bf16_mixed_precision_keeps_fp32_state(tmp_path, small_corpus) -> None:
    """A cluster of 2 GPUs sharding one replica: FSDP2 gathers bf16 parameters and reduces in fp32, while
    the sharded parameters (AdamW's), the anchor and the outer momentum stay fp32."""
    overrides = tiny_overrides(tmp_path, small_corpus, "train.device=cuda", "train.precision=bf16",
                               "cluster.shard_size=2", "algo=edit", "algo.interval=2", "train.steps=4",
                               "train.activation_checkpointing=moe")
    results = _spawn([overrides, overrides])
    for r in results:
        assert r["device"].startswith("cuda") and r["param_is_dtensor"]
        assert r["fsdp_param_dtype"] == "torch.bfloat16" and r["autocast_dtype"] == "None"
        assert r["param_dtypes"] == ["torch.float32"] and r["anchor_dtypes"] == ["torch.float32"]
    assert results[0]["summary"]["completed"] and results[0]["summary"]["syncs"] >= 1


def test_mixed_devices_one_cuda_cluster_one_cpu_cluster(tmp_path, small_corpus) -> None:
    """Two clusters of one rank each, one on the GPU and one on the CPU, each its own job, syncing over the
    federation's gloo lanes (tensors staged on CPU): both end on the same anchor."""
    from fed_utils import anchors, finish, same, start

    run = tmp_path / "mixed"
    finish(start(run, small_corpus, "algo=edit", "algo.interval=2", "train.steps=4", "train.batch_size=2",
                 "cluster.clusters=[{name:gpu,ranks:1,device:cuda},{name:cpu,ranks:1,device:cpu}]"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["syncs"] >= 1
    assert summary["per_cluster"]["gpu"]["device"].startswith("cuda")
    assert summary["per_cluster"]["cpu"]["device"] == "cpu"
    assert same(anchors(run, "gpu"), anchors(run, "cpu")) <= 1e-6  # the outer step runs on each device (FMA)
