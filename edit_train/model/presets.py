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
    """
    from edit_train.model.moe import MoEBlock
    from edit_train.model.transformer import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())  # parameters() de-duplicates tied weights
    inactive = 0
    for module in model.modules():
        if isinstance(module, MoEBlock):
            routed = sum(p.numel() for p in module.experts.parameters())
            per_expert = routed // cfg.num_experts
            inactive += per_expert * (cfg.num_experts - cfg.num_experts_per_tok)
    return {"total_params": int(total), "active_params": int(total - inactive)}
