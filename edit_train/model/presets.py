"""Model presets (``conf/model/*.yaml``) and parameter counting on the meta device."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from edit_train.config_tree import CONF_DIR
from edit_train.model.config import ModelConfig

PRESET_DIR = Path(CONF_DIR) / "model"


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str) -> ModelConfig:
    """``conf/model/{name}.yaml`` merged over the ``ModelConfig`` defaults, validated."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}: no {path}; available presets: "
                         f"{', '.join(available_presets()) or '(none)'}")
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, ModelConfig)
    cfg.validate()
    return cfg


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Total and active (per token) parameter counts, built on the meta device (no memory used).

    ``active_params`` counts only ``num_experts_per_tok`` of the ``num_experts`` routed experts of each MoE
    layer; shared experts, router, attention, norms, embeddings (once, even if tied) and head all count.
    ``non_embedding_active_params`` leaves out the embeddings and the (untied) head. The MTP layers
    (``num_nextn_predict_layers``) are part of every count and also counted alone (``mtp_params``,
    ``mtp_active_params``): a model card's figures are the main model's, i.e. the counts minus those.
    """
    from edit_train.model.moe import MoEBlock
    from edit_train.model.transformer import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())  # parameters() de-duplicates tied weights

    def inactive(module: torch.nn.Module) -> int:
        n = 0
        for sub in module.modules():
            if isinstance(sub, MoEBlock):
                per_expert = sum(p.numel() for p in sub.experts.parameters()) // cfg.num_experts
                n += per_expert * (cfg.num_experts - cfg.num_experts_per_tok)
        return n

    embedding = model.word_embeddings.weight.numel()
    if model.lm_head.weight is not model.word_embeddings.weight:
        embedding += model.lm_head.weight.numel()
    mtp_layers = list(model.layers)[cfg.num_hidden_layers:]
    mtp = sum(p.numel() for layer in mtp_layers for p in layer.parameters())
    mtp_inactive = sum(inactive(layer) for layer in mtp_layers)
    active = total - inactive(model)
    return {"total_params": int(total), "active_params": int(active),
            "non_embedding_active_params": int(active - embedding),
            "mtp_params": int(mtp), "mtp_active_params": int(mtp - mtp_inactive)}
