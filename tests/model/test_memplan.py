"""The per-rank memory plan (edit_train/memplan.py, `edit-train-info --gpu-mem-gb`) and the MFU arithmetic
(edit_train/train/mfu.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from edit_train.memplan import GIB, activation_bytes, memory_plan
from edit_train.model import CausalLM, count_params
from edit_train.model.config import ModelConfig
from edit_train.model.presets import load_preset
from edit_train.train.mfu import device_peak_flops, flops_per_token, lookup_peak, mfu
from edit_train.train.parallel import apply_layer_options

pytestmark = pytest.mark.usefixtures("torch_one_thread")


# ------------------------------------------------------------------------------------------- memory plan
def test_state_terms_scale_with_shards_and_offload() -> None:
    cfg = load_preset("small")
    p = count_params(cfg)["total_params"]
    one = memory_plan(cfg, shard_size=1, batch_size=2, seq_len=64, local_sgd=True, outer_momentum=0.8)
    four = memory_plan(cfg, shard_size=4, batch_size=2, seq_len=64, local_sgd=True, outer_momentum=0.8)
    off = memory_plan(cfg, shard_size=4, batch_size=2, seq_len=64, local_sgd=True, outer_momentum=0.8,
                      offload=True)
    b1, b4 = one["bytes"], four["bytes"]
    assert b1["params"] == 4 * p and b1["inner_optimizer"] == 8 * p and b1["grads"] == 4 * p
    assert b1["outer_state"] == 8 * p  # fp32 anchor + Nesterov momentum buffer
    assert b4["params"] == p  # 4 bytes / 4 shards
    assert b4["inner_optimizer"] == 2 * p and b4["outer_state"] == 2 * p
    assert off["bytes"]["outer_state"] < b4["outer_state"] / 4  # only one unit staged on the device
    assert off["host_bytes"]["outer_state"] == 2 * p and off["outer_state_offloaded"]
    ddp = memory_plan(cfg, shard_size=1, batch_size=2, seq_len=64, local_sgd=False)
    assert ddp["bytes"]["outer_state"] == 0
    no_mom = memory_plan(cfg, shard_size=1, batch_size=2, seq_len=64, local_sgd=True, outer_momentum=0.0)
    assert no_mom["bytes"]["outer_state"] == 4 * p  # the anchor alone
    static = sum(one["bytes"][k] for k in ("params", "inner_optimizer", "outer_state", "codec"))
    phases = one["phases"]
    assert one["total_bytes"] == max(phases.values()) == phases[one["peak_phase"]]
    b = one["bytes"]  # a sync's undo records and contributions ride the forward
    assert phases["sync"] - phases["forward_backward"] == b["sync"] and phases["sync"] > static
    assert b["sync"] >= 12 * p  # parameters + anchor + momentum of every unit until the vote
    assert off["bytes"]["sync"] < b4["sync"]  # offloaded: the undo record's anchor and state are on the host


def test_bf16_compute_copies() -> None:
    cfg = load_preset("small")
    p = count_params(cfg)["total_params"]
    auto = memory_plan(cfg, shard_size=1, batch_size=2, seq_len=64, precision="bf16")
    assert auto["bytes"]["param_compute"] == 2 * p and not auto["fsdp_mixed_precision"]  # autocast cache
    fsdp = memory_plan(cfg, shard_size=4, batch_size=2, seq_len=64, precision="bf16")
    assert fsdp["fsdp_mixed_precision"] and fsdp["bytes"]["param_compute"] == 4 * fsdp["largest_unit_params"]
    assert memory_plan(cfg, shard_size=1, batch_size=2, seq_len=64)["bytes"]["param_compute"] == 0


def test_fits() -> None:
    cfg = load_preset("ling_1b")
    plan = memory_plan(cfg, shard_size=1, batch_size=1, seq_len=512, precision="bf16", gpu_mem_gb=80)
    assert plan["fits"] and plan["usable_bytes"] == int(80 * GIB * 0.9)
    assert not memory_plan(cfg, shard_size=1, batch_size=1, seq_len=512, gpu_mem_gb=8)["fits"]
    assert "fits" not in memory_plan(cfg, shard_size=1, batch_size=1, seq_len=512)


def _saved_bytes(cfg: ModelConfig, mode: str, batch: int, seq: int) -> int:
    """Bytes autograd keeps from the forward pass (distinct storages, parameters excluded)."""
    torch.manual_seed(0)
    model = CausalLM(cfg)
    apply_layer_options(model, mode)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids)
    return sum(seen.values())


@pytest.mark.parametrize("mode", ["none", "moe"])
def test_activation_estimate_bounds_what_autograd_saves(mode: str) -> None:
    """The estimate is an upper bound within 60% of the bytes autograd really keeps (fp32, tiny model)."""
    cfg = load_preset("tiny")
    saved = _saved_bytes(cfg, mode, 4, 128)
    est = activation_bytes(cfg, 4 * 128, mode, 4, 4)
    assert saved <= est <= 1.6 * saved, (saved, est)


def test_checkpointing_shrinks_activations() -> None:
    cfg = load_preset("ling_1b")
    none, moe, full = (activation_bytes(cfg, 4096, m, 2, 4) for m in ("none", "moe", "full"))
    assert full < moe < none
    plain = dataclasses.replace(cfg, loss_chunk=0)  # full logits: linear in tokens
    assert activation_bytes(plain, 8192, "none", 2, 4) == 2 * activation_bytes(plain, 4096, "none", 2, 4)
    # the fused head loss: one chunk and the head's weight gradient, whatever the tokens
    once = 4 * cfg.vocab_size * cfg.hidden_size + cfg.loss_chunk * cfg.vocab_size * (2 * 2 + 4)
    assert activation_bytes(cfg, 8192, "none", 2, 4) - once == 2 * (none - once)


def test_ling_lite_slice_is_ling_lite_layers_on_one_gpu(capsys) -> None:
    """Ling-Lite's layer widths exactly, as many layers as an 80 GB GPU holds with fp32 AdamW state at the
    benchmark's 2 x 4096 tokens (bf16, no checkpointing) — one more does not fit; edit-train-info reports it."""
    from edit_train.cli.info import main

    lite, piece = load_preset("ling_lite"), load_preset("ling_lite_slice")
    assert dataclasses.replace(piece, num_hidden_layers=lite.num_hidden_layers) == lite
    shape = {"shard_size": 1, "batch_size": 2, "seq_len": 4096, "precision": "bf16", "gpu_mem_gb": 80}
    assert memory_plan(piece, **shape)["fits"]
    assert not memory_plan(dataclasses.replace(piece, num_hidden_layers=piece.num_hidden_layers + 2), **shape)["fits"]
    main(["model=ling_lite_slice", "train.precision=bf16", "train.batch_size=2", "train.seq_len=4096",
          "model.num_hidden_layers=3", "algo=ddp", "--gpu-mem-gb", "80"])  # the depth is an ordinary override
    info = json.loads(capsys.readouterr().out.strip())
    per_layer = (count_params(lite)["total_params"] - 2 * lite.vocab_size * lite.hidden_size - lite.hidden_size) // 28
    assert info["total_params"] == 3 * per_layer + 2 * lite.vocab_size * lite.hidden_size + lite.hidden_size
    assert info["memory_plan"]["fits"] and info["memory_plan"]["tokens_per_microbatch"] == 8192


def test_ling_mini_2_slice_is_ling_mini_2_layers_on_one_gpu() -> None:
    """Ling-mini-2.0's layers exactly (the dense layer 0, MoE layers, the MTP layer), as many as an 80 GB GPU holds
    with fp32 AdamW state at the benchmark's 2 x 4096 tokens (bf16, no checkpointing) — one more does not fit; it
    builds (on the meta device) with the layer mix of the full model."""
    mini, piece = load_preset("ling_mini_2"), load_preset("ling_mini_2_slice")
    assert dataclasses.replace(piece, num_hidden_layers=mini.num_hidden_layers) == mini
    shape = {"shard_size": 1, "batch_size": 2, "seq_len": 4096, "precision": "bf16", "gpu_mem_gb": 80}
    assert memory_plan(piece, **shape)["fits"]
    assert not memory_plan(dataclasses.replace(piece, num_hidden_layers=piece.num_hidden_layers + 1), **shape)["fits"]
    with torch.device("meta"):
        model = CausalLM(piece)
    assert [type(layer).__name__ for layer in model.layers] == ["DecoderLayer"] * 4 + ["MTPLayer"]
    assert [layer.is_moe for layer in model.layers] == [False, True, True, True, True]
    assert sum(p.numel() for p in model.parameters()) == count_params(piece)["total_params"]


def test_info_prints_memory_plan(monkeypatch, capsys) -> None:
    from edit_train.cli.info import main

    main(["model=ling_1b", "train.precision=bf16", "train.activation_checkpointing=full", "--gpu-mem-gb", "80"])
    info = json.loads(capsys.readouterr().out.strip())
    assert 0.9e9 < info["total_params"] < 1.2e9 and 0.3e9 < info["active_params"] < 0.5e9
    plan = info["memory_plan"]
    assert plan["fits"] is True and plan["activation_checkpointing"] == "full"
    assert set(plan["bytes"]) == {"params", "param_compute", "grads", "inner_optimizer", "outer_state", "codec",
                                  "activations", "unit_grads", "layer_activations", "sync", "frozen_rows"}
    assert plan["total_bytes"] == plan["phases"][plan["peak_phase"]]
    main(["model=ling_lite", "--gpu-mem-gb=24"])
    assert json.loads(capsys.readouterr().out.strip())["memory_plan"]["fits"] is False
    with pytest.raises(SystemExit) as exc:
        main(["model=tiny", "--gpu-mem-gb", "lots"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu-mem-gb" in err[0]


# ------------------------------------------------------------------------------------------------ MFU
def test_flops_per_token_formula() -> None:
    cfg = load_preset("tiny")
    active = count_params(cfg)["active_params"]
    embedding = cfg.vocab_size * cfg.hidden_size
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * 128
    assert flops_per_token(cfg, 128, active) == 6 * (active - embedding) + attn


@pytest.mark.parametrize("mtp", [1, 2])
def test_flops_per_token_counts_the_mtp_layers(mtp: int) -> None:
    """Each MTP layer adds its own active parameters (a decoder layer with its MoE block, eh_proj, norms: read off
    the model), one more pass through the shared V x H head on every token, and a layer's attention."""
    base = dataclasses.replace(load_preset("tiny_v2"), num_nextn_predict_layers=0)
    cfg = dataclasses.replace(base, num_nextn_predict_layers=mtp)
    with torch.device("meta"):
        model = CausalLM(cfg)
    layer = model.layers[cfg.num_hidden_layers]
    experts = sum(p.numel() for p in layer.mlp.experts.parameters())
    layer_active = sum(p.numel() for p in layer.parameters()) - experts * (
        cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts
    head = cfg.vocab_size * cfg.hidden_size
    d_attn = cfg.num_attention_heads * cfg.head_dim
    seq = 128
    without = flops_per_token(base, seq, count_params(base)["active_params"])
    got = flops_per_token(cfg, seq, count_params(cfg)["active_params"])
    assert got - without == mtp * (6 * layer_active + 6 * head + 12 * d_attn * seq)
    assert without == 6 * (count_params(base)["active_params"] - head) + 12 * cfg.num_hidden_layers * d_attn * seq


def test_the_mtp_layer_runs_the_shared_head_once_more_per_token() -> None:
    """What the `6 * M * V * H` term counts, measured: torch's FLOP counter sees the head's matmuls (forward and
    backward) once per token for the main model and once more per MTP layer."""
    from torch.utils.flop_counter import FlopCounterMode

    for mtp in (0, 1, 2):
        cfg = dataclasses.replace(load_preset("tiny_v2"), num_nextn_predict_layers=mtp)
        torch.manual_seed(0)
        model = CausalLM(cfg)
        x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        with FlopCounterMode(display=False) as counter:
            model(x, x).loss.backward()
        head = sum(counter.get_flop_counts()["CausalLM.lm_head"].values())
        assert head == 6 * (1 + mtp) * cfg.vocab_size * cfg.hidden_size * x.numel(), mtp


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362.05e12), ("NVIDIA L4", 121e12),
    ("AMD Instinct MI300X", 1307.4e12), ("NVIDIA B200", 2.25e15), ("Some Future GPU", None),
])
def test_peak_table(name: str, peak: float | None) -> None:
    assert lookup_peak(name) == peak


def test_mfu_on_cpu_needs_an_override() -> None:
    cpu = torch.device("cpu")
    assert device_peak_flops(cpu) is None and mfu(1000.0, 1e9, None, 1) is None
    assert device_peak_flops(cpu, 2e12) == 2e12
    assert mfu(1000.0, 1e9, 2e12, 2) == pytest.approx(0.25)  # 1e12 FLOP/s over two 2e12 devices
