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
    # Ling 2.0 (BailingMoeV2) architecture; every default keeps the Ling 1 (BailingMoe) model exactly as it was
    score_function: str = "softmax"  # router scores: softmax (Ling 1) | sigmoid (Ling 2.0)
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias (buffer) that
    # chooses the experts, never weighs them; updated once per optimizer step from that step's load
    moe_router_bias_update_rate: float = 1e-3  # u: bias += u * sign(mean load - load)
    moe_router_bias_update_zero_mean: bool = True  # subtract the update's mean, so the bias keeps mean zero
    n_group: int = 0  # experts in n_group groups, a token routed within its topk_group best groups; 0 = no groups
    topk_group: int = 0
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by it
    use_qk_norm: bool = False  # RMSNorm over each head's query and key (before RoPE)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims of each head (0.5: half RoPE)
    num_nextn_predict_layers: int = 0  # MTP layers: layer j predicts token t+2+j from the hidden state and token t+1+j
    mtp_loss_scaling_factor: float = 0.1  # loss = ce + factor * mean of the MTP layers' cross-entropies

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
        if self.score_function not in ("softmax", "sigmoid"):
            bad("score_function", f"must be softmax or sigmoid, got {self.score_function!r}")
        if self.moe_router_bias_update_rate < 0:
            bad("moe_router_bias_update_rate", f"must be >= 0, got {self.moe_router_bias_update_rate}")
        if self.n_group < 0 or self.topk_group < 0:
            bad("n_group", f"n_group and topk_group must be >= 0, got {self.n_group} and {self.topk_group}")
        if self.n_group > 0 and self.num_experts > 0:
            if self.num_experts % self.n_group:
                bad("n_group", f"{self.n_group} must divide num_experts={self.num_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                bad("topk_group", f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
            per_group = self.num_experts // self.n_group
            if per_group < 2:
                bad("n_group", f"each group needs at least 2 experts (a group scores its best two), got {per_group}")
            if self.topk_group * per_group < self.num_experts_per_tok:
                bad("topk_group", f"{self.topk_group} groups of {per_group} experts cannot hold "
                    f"num_experts_per_tok={self.num_experts_per_tok}")
        elif self.topk_group > 0 and self.n_group == 0:
            bad("topk_group", "needs n_group > 0")
        if not self.routed_scaling_factor > 0:
            bad("routed_scaling_factor", f"must be > 0, got {self.routed_scaling_factor}")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or int(rotary) != rotary or int(rotary) % 2:
            bad("partial_rotary_factor", f"must be in (0, 1] with head_dim * factor an even integer, got "
                f"{self.partial_rotary_factor} (head_dim={self.head_dim})")
        if self.num_nextn_predict_layers < 0:
            bad("num_nextn_predict_layers", f"must be >= 0, got {self.num_nextn_predict_layers}")
        if self.num_nextn_predict_layers > 0 and self.num_experts == 0:
            bad("num_nextn_predict_layers", "an MTP layer is an MoE layer: needs num_experts > 0")
        if self.mtp_loss_scaling_factor < 0:
            bad("mtp_loss_scaling_factor", f"must be >= 0, got {self.mtp_loss_scaling_factor}")

    @property
    def rotary_dim(self) -> int:
        """The dims of each head that RoPE rotates (the first ``head_dim * partial_rotary_factor``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def ling2_router(self) -> bool:
        """Whether the router departs from Ling 1's plain softmax top-k (sigmoid, bias, groups or scaling)."""
        return (self.score_function != "softmax" or self.moe_router_enable_expert_bias or self.n_group > 0
                or self.routed_scaling_factor != 1.0)
