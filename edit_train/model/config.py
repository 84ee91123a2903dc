"""Model configuration. Field names follow the public BailingMoe (Ling) config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    vocab_size: int = 320
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    intermediate_size: int = 384  # width of the dense MLP used by the first `first_k_dense_replace` layers
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    norm_head: bool = True
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # training-time MoE knobs (not part of the HF config)
    router_aux_loss_coef: float = 0.01  # Switch balance loss alpha
    router_z_loss_coef: float = 1e-4  # router z-loss beta
    routing_warmup_steps: int = 0  # stochastic routing warmup W (Ling eq. 3); 0 = off
    init_from: str | None = None  # HF-style directory to initialise weights from (later issue)
    expert_impl: str = "auto"  # routed experts: auto | grouped (torch._grouped_mm) | sorted (per-expert loop)
    loss_chunk: int = 0  # > 0: LM head + cross-entropy fused, this many tokens at a time (lm_loss.py); 0 = full logits

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        def bad(field: str, why: str) -> None:
            raise ValueError(f"model.{field}: {why}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                bad(name, f"must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            bad("num_key_value_heads", f"{self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}")
        if self.num_experts > 0 and not 1 <= self.num_experts_per_tok <= self.num_experts:
            bad("num_experts_per_tok", f"must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            bad("first_k_dense_replace", f"must be in [0, num_hidden_layers], got {self.first_k_dense_replace}")
        if self.expert_impl not in ("auto", "grouped", "sorted"):
            bad("expert_impl", f"must be auto, grouped or sorted, got {self.expert_impl!r}")
        if self.loss_chunk < 0:
            bad("loss_chunk", f"must be >= 0 (0 = full logits, N = the fused head loss over N tokens at a time), "
                f"got {self.loss_chunk}")
        if self.routing_warmup_steps < 0:
            bad("routing_warmup_steps", "must be >= 0")
