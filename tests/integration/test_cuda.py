"""GPU paths: bf16 (autocast and FSDP2 mixed precision), activation checkpointing and grouped experts in a
real training run, and a federation of one CUDA cluster and one CPU cluster; the fused head loss, SDPA's flash
kernel, the compiled block and fused AdamW on the GPU (issue 40). Every test is marked `cuda`
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
                               "cluster.ranks=2", "algo=edit", "algo.interval=2", "train.steps=4",
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


# ---------------------------------------------------------------------- issue 40: what makes the step fast
def test_fused_head_loss_on_cuda_matches_plain_with_less_memory() -> None:
    """bf16 autocast on the GPU: the fused chunked loss (eager and compiled kernel) gives the plain loss and
    gradients, and its peak memory is below the plain path's (the [tokens, vocab] logits never exist)."""
    from edit_train.model.lm_loss import ChunkedCrossEntropy

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    n, h, v = 4096, 512, 32768
    hidden = (torch.randn(n, h, generator=g) / h ** 0.5).to(dev).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.02).to(dev).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).to(dev)
    eager, compiled = ChunkedCrossEntropy(1024), ChunkedCrossEntropy(1024)
    compiled.compile()

    def run(fn):  # type: ignore[no-untyped-def]
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), hidden.grad.clone(), weight.grad.clone(), torch.cuda.max_memory_allocated() - base

    plain = run(lambda: torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight).float(), labels))
    for fused in (run(lambda: eager(hidden, weight, labels)), run(lambda: compiled(hidden, weight, labels))):
        torch.testing.assert_close(fused[0], plain[0], rtol=1e-4, atol=1e-4)
        for a, b in zip(fused[1:3], plain[1:3]):
            torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-4)
        assert fused[3] < plain[3], (fused[3], plain[3])


def test_attention_on_the_flash_kernel_on_cuda() -> None:
    """Only SDPA's flash backend allowed: bf16 with our layout and grouped-query heads runs on it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from edit_train.model.config import ModelConfig
    from edit_train.model.transformer import Attention

    cfg = ModelConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    attn = Attention(cfg).cuda()
    x = torch.randn(2, 512, cfg.hidden_size, device="cuda", requires_grad=True)
    outs = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        x.grad = None
        with sdpa_kernel([backend]), torch.autocast("cuda", dtype=torch.bfloat16):
            y = attn(x)
        y.float().square().sum().backward()
        outs[backend] = (y.float(), x.grad.clone())
    for a, b in zip(outs[SDPBackend.FLASH_ATTENTION], outs[SDPBackend.MATH]):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


def test_compiled_block_on_cuda_has_no_graph_break() -> None:
    """Dynamo's trace of the decoder block on the GPU (bf16, grouped experts, fused head loss, full
    checkpointing): no graph break — the CUDA-only branches (compute capability lookup) included."""
    import dataclasses

    from edit_train.model import CausalLM
    from edit_train.model.config import ModelConfig
    from edit_train.train.parallel import apply_compile, apply_layer_options

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = dataclasses.replace(ModelConfig(), expert_impl="auto", first_k_dense_replace=0, loss_chunk=32)
    model = CausalLM(cfg).cuda()
    apply_layer_options(model, "full", False, torch.device("cuda"), torch.bfloat16)  # checks experts, checkpoints
    apply_compile(model, backend="eager")  # dynamo's trace only: seconds, not inductor's minutes
    ids = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(ids, ids)
    out.loss.backward()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert {b.experts.last_impl for b in model.moe_blocks()} == {"grouped"}


def test_trainer_uses_fused_adamw_on_cuda_and_resumes(tmp_path, small_corpus) -> None:
    """AdamW fused on the GPU; a resumed run puts its step counters back on the device (where fused reads them)."""
    run = tmp_path / "run"
    first = _trainer(tiny_overrides(run, small_corpus, "train.device=cuda", "train.steps=2", "checkpoint.every=2"))
    assert first.optimizer.defaults["fused"] is True
    first.run()
    second = _trainer(tiny_overrides(run, small_corpus, "train.device=cuda", "train.steps=4", "resume=auto"))
    steps = [st["step"] for st in second.optimizer.state.values()]
    assert steps and all(s.is_cuda for s in steps)
    assert second.run()["completed"]
