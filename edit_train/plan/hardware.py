"""What the planner knows without torch: a model preset's parameters per sync unit, its training FLOPs per
token, and accelerators (dense bf16 peak, memory).

The counts follow the model code exactly (`edit_train/model/transformer.py`, `moe.py`): the sync units are
the ones `round.build_units` makes — the root (what no FSDP unit owns: the final norm), the embeddings, each
decoder layer (Ling 2.0's MTP layers after them), the head — so the bytes a sync moves can be computed per unit
as `federation` does. `tests/plan/test_plan.py` checks, for every preset, the units against the model's,
the totals against `model.presets.count_params` and the FLOPs against `train.mfu.flops_per_token`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from edit_train.config_tree import CONF_DIR
from edit_train.peaks import lookup_peak

# Memory per device (vendor data sheets); the peak FLOP/s come from the one table in `edit_train/peaks.py`.
MEMORY_GB: dict[str, float] = {
    "b200": 192, "h200": 141, "h100": 80, "h800": 80, "h20": 96, "a100": 80, "a800": 80, "l40s": 48, "l40": 48,
    "l4": 24, "rtx4090": 24, "mi300x": 192, "mi250x": 128,
}
DEFAULT_MFU = 0.35  # what an accelerator type turns into a step time when no step time was measured


@dataclass(frozen=True)
class ModelFacts:
    """A preset's numbers the planner needs."""

    name: str
    layers: int
    units: tuple[tuple[str, int], ...]  # (sync unit, parameters) in forward order
    total_params: int
    active_params: int
    # (6 * active-non-embedding + 6 * M * V * H, 12 * (L + M) * d_attn, tie) -> per seq_len (M: MTP layers)
    flops_per_token_at: tuple[int, int, int]
    experts: int = 0  # routed experts per MoE layer
    expert_sizes: tuple[int, ...] = ()  # per sync unit, one routed expert's elements (its gate/up/down rows; 0: none)

    @property
    def unit_sizes(self) -> list[int]:
        return [n for _, n in self.units]

    def flops_per_token(self, seq_len: int) -> float:
        dense, attn, _ = self.flops_per_token_at
        return float(dense + attn * seq_len)


def load_preset(name: str, conf_dir: str | Path = CONF_DIR) -> dict[str, Any]:
    """`conf/model/<name>.yaml` as a dict (no OmegaConf, no torch); a clear error for an unknown name."""
    path = Path(conf_dir) / "model" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (Path(conf_dir) / "model").glob("*.yaml"))
        raise ValueError(f"model: unknown preset {name!r}; choose one of {', '.join(known)}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"model: {path} is not a mapping")
    return data


_DEFAULTS = {"vocab_size": 320, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_shared_experts": 1,
             "num_experts_per_tok": 2, "moe_intermediate_size": 128, "intermediate_size": 384,
             "first_k_dense_replace": 1, "tie_word_embeddings": False, "use_qk_norm": False,
             "num_nextn_predict_layers": 0}


def model_facts(preset: str | dict[str, Any], name: str = "") -> ModelFacts:
    """Parameters per sync unit, totals and FLOPs per token of a preset name or a dict of ModelConfig fields."""
    raw = load_preset(preset) if isinstance(preset, str) else dict(preset)
    c = {**_DEFAULTS, **{k: v for k, v in raw.items() if k in _DEFAULTS}}
    h, v, n_layers = int(c["hidden_size"]), int(c["vocab_size"]), int(c["num_hidden_layers"])
    heads, kv, hd = int(c["num_attention_heads"]), int(c["num_key_value_heads"]), int(c["head_dim"])
    experts, shared, top_k = int(c["num_experts"]), int(c["num_shared_experts"]), int(c["num_experts_per_tok"])
    moe_i, dense_i = int(c["moe_intermediate_size"]), int(c["intermediate_size"])
    attn = h * (heads + 2 * kv) * hd + heads * hd * h + (2 * hd if c["use_qk_norm"] else 0)  # QK-norm: 2 RMSNorms
    norms = 2 * h
    mtp = int(c["num_nextn_predict_layers"])  # MTP layers: decoder layers after the main ones (units of their own)
    units: list[tuple[str, int]] = []
    tied = bool(c["tie_word_embeddings"])
    units.append(("root", h))  # the final norm (the root owns what no unit does)
    if not tied:
        units.append(("word_embeddings", v * h))
    inactive = 0
    per_expert: dict[str, int] = {}
    for i in range(n_layers + mtp):
        if experts > 0 and i >= int(c["first_k_dense_replace"]):
            routed = experts * 3 * h * moe_i
            mlp = h * experts + routed + (3 * h * shared * moe_i if shared > 0 else 0)
            inactive += routed // experts * (experts - top_k)
            per_expert[f"layers.{i}"] = 3 * h * moe_i
        else:
            mlp = 3 * h * dense_i
        extra = 2 * h * h + 3 * h if i >= n_layers else 0  # an MTP layer's eh_proj, enorm, hnorm, final_layernorm
        units.append((f"layers.{i}", attn + norms + mlp + extra))
    if tied:
        units[0] = ("root", h + v * h)  # the shared table belongs to the root then
    else:
        units.append(("lm_head", v * h))
    total = sum(n for _, n in units)
    active = total - inactive
    embedding = 0 if tied else v * h
    return ModelFacts(name or (preset if isinstance(preset, str) else "custom"), n_layers, tuple(units), total,
                      active, (6 * (active - embedding) + 6 * mtp * v * h, 12 * (n_layers + mtp) * heads * hd,
                               int(tied)),
                      experts if per_expert else 0, tuple(per_expert.get(name, 0) for name, _ in units))


def accelerator(kind: str) -> dict[str, float]:
    key = kind.lower().replace(" ", "").replace("-", "").replace("_", "")
    for name, memory_gb in MEMORY_GB.items():  # specific names before their prefixes (h200 before h20)
        peak = lookup_peak(name)
        if (key == name or key.startswith(name)) and peak is not None:
            return {"peak_flops": peak, "memory_gb": memory_gb}
    raise ValueError(f"accelerator {kind!r} is not in the table; give the cluster a measured step_s instead "
                     f"(or one of {', '.join(sorted(MEMORY_GB))})")


def step_seconds(facts: ModelFacts, kind: str, tokens_per_rank: int, seq_len: int, mfu: float = DEFAULT_MFU) -> float:
    """Seconds of one optimizer step on one accelerator of `kind` at utilisation `mfu` (no measurement)."""
    return facts.flops_per_token(seq_len) * tokens_per_rank / (accelerator(kind)["peak_flops"] * mfu)


def memory_per_rank_gb(facts: ModelFacts, ranks: int, local_sgd: bool, frozen: int = 0) -> float:
    """Rough resident state per rank (fp32 master + grads + AdamW, + anchor and outer momentum for local SGD),
    without activations, + the fp32 copy of `frozen` expert-row elements that expert subsets hold through each
    optimizer step (no optimizer state saved: one AdamW state per stacked tensor): `edit-train-info` has the
    exact plan."""
    per_param = 4 + 4 + 8 + (8 if local_sgd else 0)
    return (facts.total_params * per_param + 4 * frozen) / max(ranks, 1) / 1e9
