"""The Ling-style MoE causal LM (pure torch)."""

from edit_train.model.config import ModelConfig
from edit_train.model.presets import count_params, load_preset
from edit_train.model.transformer import CausalLM, CausalLMOutput

__all__ = ["ModelConfig", "CausalLM", "CausalLMOutput", "load_preset", "count_params"]
