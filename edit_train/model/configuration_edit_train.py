"""The BailingMoe config class an exported directory ships for ``transformers`` (``trust_remote_code``).

``edit-train-export`` copies this file and ``modeling_edit_train.py`` next to ``config.json`` and names them in
its ``auto_map``, so stock ``transformers`` (which has no ``bailing_moe`` model type) loads the directory with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``. Written for edit-train from the
``config.json`` contract (``edit_train/model/hf.py``), not copied from Ling's code: the keys and their defaults
are BailingMoe's. vLLM and SGLang build their config from this class too (``--trust-remote-code``) and read its
attributes, some with no default (SGLang: ``rope_scaling``), so every key is always set.

Self-contained: it imports only ``transformers`` (``transformers`` copies it into its modules cache). Not
imported by edit-train itself.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class BailingMoeConfig(PretrainedConfig):
    """BailingMoe (Ling) hyper-parameters; every default is BailingMoe's (what a key left out means)."""

    model_type = "bailing_moe"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(self, vocab_size: int = 30592, hidden_size: int = 1024, intermediate_size: int | None = None,
                 num_hidden_layers: int = 24, num_attention_heads: int = 16, num_key_value_heads: int = 0,
                 hidden_act: str = "silu", use_qkv_bias: bool = False, use_bias: bool = True,
                 rms_norm_eps: float = 1e-5, norm_head: bool = False, tie_word_embeddings: bool = False,
                 initializer_range: float = 0.02, max_position_embeddings: int = 16384, rope_theta: float = 10000.0,
                 rope_scaling: dict[str, Any] | None = None, num_experts: int | None = 16,
                 num_shared_experts: int | None = 0, num_experts_per_tok: int = 2, norm_topk_prob: bool = True,
                 moe_intermediate_size: int | None = None, first_k_dense_replace: int = 0,
                 head_dim: int | None = None, use_cache: bool = True, pad_token_id: int | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 score_function: str = "softmax", moe_router_enable_expert_bias: bool = False, n_group: int = 0,
                 topk_group: int = 0, routed_scaling_factor: float = 1.0, use_qk_norm: bool = False,
                 partial_rotary_factor: float = 1.0, num_nextn_predict_layers: int = 0,
                 mtp_loss_scaling_factor: float = 0.0, **kwargs: Any) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads  # 0: one k/v head per q head
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.use_qkv_bias = use_qkv_bias
        self.use_bias = use_bias
        self.rms_norm_eps = rms_norm_eps
        self.norm_head = norm_head
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        # always present, null included: SGLang reads config.rope_scaling with no default. transformers 5 makes
        # it an alias of rope_parameters, which its __init__ standardises ({"rope_type": "default", ...} for
        # null) and which must exist for the alias to read; 4.x keeps a plain attribute.
        if isinstance(getattr(type(self), "rope_scaling", None), property):
            self.rope_parameters = rope_scaling
        else:
            self.rope_scaling = rope_scaling
        self.num_experts = num_experts  # 0 (or null): every layer is a dense MLP
        self.num_shared_experts = num_shared_experts  # 0 (or null): no shared experts
        self.num_experts_per_tok = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.moe_intermediate_size = moe_intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.use_cache = use_cache
        # BailingMoeV2 (Ling 2.0) keys; the defaults are Ling 1's model (an export of a V2 model writes every one)
        self.score_function = score_function
        self.moe_router_enable_expert_bias = moe_router_enable_expert_bias
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.use_qk_norm = use_qk_norm
        self.partial_rotary_factor = partial_rotary_factor
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.mtp_loss_scaling_factor = mtp_loss_scaling_factor
        super().__init__(tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)
