"""Per-rank GPU memory plan of a launch, from the config alone (model built on the meta device).

Every figure is bytes on one rank of a cluster that shards one replica over ``cluster.ranks`` ranks
(FSDP2, fp32 sharded master weights), planned as if the rank were a CUDA device. What a rank holds all the
time (the *static* terms):

* ``params``        fp32 shard: ``4 P / S``
* ``inner_optimizer`` AdamW ``exp_avg`` + ``exp_avg_sq``: ``8 P / S``
* ``outer_state``   local SGD only: anchor ``4 P / S`` + outer optimizer state (SGD with momentum: one
                    buffer, without: none; other torch.optim classes: counted as two); on the host when
                    ``algo.outer.offload`` (then only one unit's anchor + state is staged on the device)
* ``codec``         local SGD with a lossy ``sync.compression`` and ``sync.error_feedback``: the residuals
                    kept between syncs, ``4 P / S``

and what a step holds for a while (the *transient* terms):

* ``param_compute`` compute copies: with ``precision=bf16`` and S > 1, FSDP2 gathers bf16 units — the
                    current and the prefetched one, ``2 * 2 * max_unit``; unsharded bf16 runs autocast: the
                    bf16 working copies of the weights, ``2 P`` (with ``grad_accum > 1`` and no ``train.compile``
                    kept through the whole optimizer step, `PrecisionPolicy.optimizer_step`); S > 1 in fp32 gathers fp32
                    units, ``2 * 4 * max_unit``; otherwise 0
* ``grads``         fp32 sharded gradients ``4 P / S`` (+ the unsharded gradient of one unit before its
                    reduce-scatter, ``c * max_unit`` with c the compute dtype's bytes, when S > 1)
* ``activations``   for ``t = batch_size * seq_len`` tokens of one micro-batch (see ``activation_bytes``)
* ``unit_grads``    the gradients of one unit computed before they are added to (or reduce-scattered into)
                    ``grads``: ``4 max_unit`` unsharded (``c max_unit`` when S > 1)
* ``layer_activations`` the largest decoder layer's activations: what the backward of the first layer (the
                    last one backward reaches, when every other gradient exists) holds, or its recompute
* ``sync``          local SGD, while a layer-wise sync runs inside the forward: the undo record of every unit
                    until the vote (parameters + anchor + outer state, ``4 (1 + k) P / S`` with k the outer
                    buffers on the device), this cluster's Δ of every unit, computed once at the norm exchange
                    and held until the unit is applied (``4 P / S``, on the parameters' device), and the other
                    clusters' contributions of the unit being applied and the one in flight, ``2 n 4 max_unit / S``
                    for n clusters
* ``frozen_rows``   expert subsets (the rule's ``expert_subsets``): the rows of the experts this cluster does not
                    own, copied before each optimizer step and written back after it (``train/expert_subsets.py``),
                    ``4 F / S`` for F such elements (the most any cluster holds); no optimizer state is saved (one
                    AdamW state per stacked tensor)

These do not all peak together. The plan is the static terms plus the largest of three phases:

* ``forward_backward``: activations + compute copies + one unit's gradients (+ all the gradients from the
  second micro-batch on, ``grad_accum > 1``)
* ``backward_end``: all the gradients + one unit's gradients + one layer's activations (+ the working
  copies when they are kept) + the frozen rows' copy
* ``sync`` (local SGD): ``forward_backward`` + ``sync``

Measured on the CPU allocator (tests/model/test_memplan_peak.py) the plan is within 10 % of a step's peak. ``fits``
compares the total with 90% of ``--gpu-mem-gb`` GiB (the rest is for the CUDA context, NCCL buffers and
allocator fragmentation).
"""

from __future__ import annotations

from typing import Any

import torch

from edit_train.local_sgd.errors import ClusterError
from edit_train.model.config import ModelConfig

USABLE_FRACTION = 0.9
GIB = 1024 ** 3

ACTIVATION_FORMULA = (
    "bytes per token; c = compute-dtype bytes, r = residual-stream bytes (4 under autocast/fp32, 2 under FSDP "
    "bf16), q/kv = query/kv heads x head_dim. Attention A_att = (r+4)H + c(H + 4q + 4kv + q) + 4 n_heads; "
    "MoE A_moe = (r+4)H + 4H + 8E + c(k(2H + 3I) + H + 3 I_shared); dense MLP A_mlp = (r+4)H + c(H + 3 I_dense); "
    "embedding + head A_out = 2rH + cV + 8V (logits, fp32 logits, their gradient); with model.loss_chunk = C > 0 "
    "(the fused head loss) A_out = 2rH + rH per token (the head's input and its gradient) plus, once, "
    "4VH (the head's fp32 weight gradient) + min(C, t) V (2c + 4) (one chunk's logits, fp32 buffer, gradient; "
    "4 bytes in fp32, where they are one tensor). "
    "none: t(sum_l A_l + A_out); full: t(L rH + max_l A_l + A_out); "
    "moe: t(sum_l (A_att + (rH if MoE else A_mlp)) + A_moe + A_out); t = batch_size x seq_len"
)


def _unit_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of each FSDP unit (embeddings, each decoder layer, head) and of the whole model."""
    from edit_train.model.transformer import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg)
    units = {"word_embeddings": sum(p.numel() for p in model.word_embeddings.parameters())}
    for i, layer in enumerate(model.layers):
        units[f"layers.{i}"] = sum(p.numel() for p in layer.parameters())
    if not cfg.tie_word_embeddings:
        units["lm_head"] = sum(p.numel() for p in model.lm_head.parameters())
    units["total"] = sum(p.numel() for p in model.parameters())
    return units


def activation_bytes(cfg: ModelConfig, tokens: int, checkpointing: str, compute_bytes: int,
                     residual_bytes: int, one_layer: bool = False) -> int:
    """Activation memory of one micro-batch of ``tokens`` tokens (the estimate in ``ACTIVATION_FORMULA``);
    ``one_layer``: the largest decoder layer's alone (what its backward, or its recompute, holds)."""
    c, r, h = compute_bytes, residual_bytes, cfg.hidden_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    a_att = (r + 4) * h + c * (h + 4 * q + 4 * kv + q) + 4 * cfg.num_attention_heads
    a_moe = ((r + 4) * h + 4 * h + 8 * cfg.num_experts
             + c * (cfg.num_experts_per_tok * (2 * h + 3 * cfg.moe_intermediate_size) + h
                    + 3 * cfg.num_shared_experts * cfg.moe_intermediate_size))
    a_mlp = (r + 4) * h + c * (h + 3 * cfg.intermediate_size)
    v = cfg.vocab_size
    head_once = 0
    if cfg.loss_chunk > 0:
        a_head = 2 * r * h
        chunk_bytes = 4 if c == 4 else 2 * c + 4  # fp32: logits, buffer and gradient are one tensor
        head_once = 4 * v * h + min(cfg.loss_chunk, tokens) * v * chunk_bytes
    else:
        a_head = r * h + c * v + 8 * v
    is_moe = [cfg.num_experts > 0 and i >= cfg.first_k_dense_replace for i in range(cfg.num_hidden_layers)]
    mtp = cfg.num_nextn_predict_layers  # each an MoE layer (its [e; h] input: 2h more) with one more head pass
    is_moe += [True] * mtp
    per_layer = [a_att + (a_moe if m else a_mlp) for m in is_moe]
    if mtp:
        per_layer[-mtp:] = [a + 2 * r * h for a in per_layer[-mtp:]]
        a_head *= 1 + mtp
    if one_layer:
        return int(tokens * max(per_layer, default=0))
    if checkpointing == "full":
        per_tok = len(is_moe) * r * h + max(per_layer, default=0)
    elif checkpointing == "moe":
        per_tok = (sum(a_att + (r * h if m else a_mlp) for m in is_moe)
                   + (a_moe if any(is_moe) else 0))
    else:
        per_tok = sum(per_layer)
    return int(tokens * (per_tok + r * h + a_head) + head_once)


def memory_plan(model: ModelConfig, *, shard_size: int, batch_size: int, seq_len: int, precision: str = "fp32",
                checkpointing: str = "none", local_sgd: bool = False, outer_optimizer: str = "SGD",
                outer_momentum: float = 0.0, offload: bool = False, gpu_mem_gb: float | None = None,
                grad_accum: int = 1, clusters: int = 1, codec_residual: bool = False, compiled: bool = False,
                frozen_rows: int = 0) -> dict[str, Any]:
    """The per-rank plan (bytes) described in the module docstring."""
    units = _unit_params(model)
    p_total = units.pop("total")
    max_unit = max(units.values())
    s = shard_size
    bf16 = precision == "bf16"
    c = 2 if bf16 else 4
    fsdp_mp = bf16 and s > 1
    r = 2 if fsdp_mp else 4
    if s > 1:
        param_compute = 2 * c * max_unit
    else:
        param_compute = 2 * p_total if bf16 else 0
    # the working copies live through the optimizer step (eager: a compiled layer casts inside its graph)
    copies_kept = s == 1 and bf16 and grad_accum > 1 and not compiled
    outer_states = 0
    if local_sgd:
        outer_states = 1 + ((1 if outer_momentum > 0 else 0) if outer_optimizer == "SGD" else 2)
    outer_bytes = 4 * outer_states * p_total / s
    grads = 4 * p_total / s + (c * max_unit if s > 1 else 0)
    unit_grads = (c if s > 1 else 4) * max_unit
    activations = activation_bytes(model, batch_size * seq_len, checkpointing, c, r)
    layer_activations = activation_bytes(model, batch_size * seq_len, checkpointing, c, r, one_layer=True)
    sync = 0.0
    if local_sgd:
        on_device = 0 if offload else outer_states  # the undo record's anchor + outer state
        # undo record + this cluster's held Δ of every unit (round.py: once per unit, held until applied) +
        # the others' contributions of the unit being applied and the one in flight
        sync = 4 * (1 + on_device) * p_total / s + 4 * p_total / s + 2 * clusters * 4 * max_unit / s
    plan: dict[str, float] = {
        "params": 4 * p_total / s,
        "param_compute": param_compute,
        "grads": grads,
        "inner_optimizer": 8 * p_total / s,
        "outer_state": (4 * outer_states * max_unit / s) if offload else outer_bytes,
        "codec": 4 * p_total / s if local_sgd and codec_residual else 0,
        "activations": activations,
        "unit_grads": unit_grads,
        "layer_activations": layer_activations,
        "sync": sync,
        "frozen_rows": 4 * frozen_rows / s,
    }
    static = plan["params"] + plan["inner_optimizer"] + plan["outer_state"] + plan["codec"]
    forward_backward = activations + param_compute + unit_grads + (grads if grad_accum > 1 else 0)
    phases = {"forward_backward": forward_backward,
              "backward_end": grads + unit_grads + layer_activations + (param_compute if copies_kept else 0)
              + plan["frozen_rows"]}
    if local_sgd:
        phases["sync"] = forward_backward + sync
    peak_phase = max(phases, key=lambda k: phases[k])
    total = int(static + phases[peak_phase])
    out: dict[str, Any] = {
        "bytes": {k: int(v) for k, v in plan.items()},
        "phases": {k: int(static + v) for k, v in phases.items()},
        "peak_phase": peak_phase,
        "total_bytes": total,
        "total_gib": round(total / GIB, 3),
        "host_bytes": {"outer_state": int(outer_bytes) if offload else 0},
        "outer_state_offloaded": bool(offload and local_sgd),
        "precision": precision,
        "fsdp_mixed_precision": fsdp_mp,
        "activation_checkpointing": checkpointing,
        "tokens_per_microbatch": batch_size * seq_len,
        "grad_accum": grad_accum,
        "largest_unit_params": int(max_unit),
        "activation_formula": ACTIVATION_FORMULA,
    }
    if gpu_mem_gb is not None:
        usable = gpu_mem_gb * GIB * USABLE_FRACTION
        out["gpu_mem_gb"] = gpu_mem_gb
        out["usable_bytes"] = int(usable)
        out["fits"] = total <= usable
    return out


def frozen_expert_rows(cfg: Any) -> int:
    """Expert subsets (the rule's `expert_subsets`, a static map): the most expert-row elements any configured
    cluster holds frozen — the experts it does not own, every MoE layer (0: off)."""
    from edit_train.config import cluster_specs
    from edit_train.model.expert_params import EXPERT_PARAMS
    from edit_train.model.moe import MoEBlock
    from edit_train.model.transformer import CausalLM
    from edit_train.plan.subsets import cluster_map
    from edit_train.train.expert_subsets import subsets_spec

    spec = subsets_spec(cfg)
    if not (spec and cfg.model.num_experts):
        return 0
    with torch.device("meta"):
        model = CausalLM(cfg.model)
    per_expert = sum(getattr(b.experts, n)[0].numel() for b in model.modules() if isinstance(b, MoEBlock)
                     for n in EXPERT_PARAMS)
    owned, _ = cluster_map(spec, len(cluster_specs(cfg)), cfg.model.num_experts)
    return max((len(o) - sum(o)) * per_expert for o in owned)


def plan_for_config(cfg: Any, gpu_mem_gb: float | None = None) -> dict[str, Any]:
    """``memory_plan`` for a composed ``Config`` (train/cluster/algo sections)."""
    from edit_train.config import cluster_specs, outer_step

    t, o, sync = cfg.train, outer_step(cfg).config, cfg.sync  # the outer step's momentum: unset takes the default
    return memory_plan(cfg.model, shard_size=cfg.cluster.ranks, batch_size=t.batch_size,
                       seq_len=t.seq_len, precision=t.precision,
                       checkpointing=getattr(t, "activation_checkpointing", "none"),
                       local_sgd=cfg.algo.local_sgd, outer_optimizer=o.optimizer, outer_momentum=o.momentum,
                       offload=o.offload, gpu_mem_gb=gpu_mem_gb, grad_accum=t.grad_accum,
                       clusters=max(len(cluster_specs(cfg)), 1),
                       codec_residual=sync.compression != "none" and sync.error_feedback, compiled=t.compile,
                       frozen_rows=frozen_expert_rows(cfg))


class OutOfMemory(ClusterError):
    """A cluster ran out of device memory: it stops with one line (`out_of_memory_line`), exit 1, and the other
    clusters of the federation go on without it (as after any `ClusterError`)."""


def out_of_memory_line(cfg: Any, step: int | None, device: torch.device) -> str:
    """What ran out, what the plan said this rank needs, and what to change."""
    plan = plan_for_config(cfg)
    have = ""
    if device.type == "cuda":
        have = f" of the device's {torch.cuda.get_device_properties(device).total_memory / GIB:.1f} GiB"
    where = f"at step {step}" if step is not None else "while building the model"
    fixes = ["train.activation_checkpointing=full" if cfg.train.activation_checkpointing != "full" else None,
             "algo.outer.offload=true" if cfg.algo.local_sgd and not cfg.algo.outer.offload else None,
             f"a smaller train.batch_size (now {cfg.train.batch_size}; train.grad_accum keeps the tokens per step)"]
    return (f"out of device memory {where}: the memory plan says {plan['total_gib']:.1f} GiB per rank{have} "
            f"(peak: {plan['peak_phase']}); to fit, set {', '.join(f for f in fixes if f)} "
            f"(`edit-train-info --gpu-mem-gb N` prints the plan)")
