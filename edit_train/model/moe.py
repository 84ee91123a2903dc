"""Mixture-of-Experts block of the Ling (BailingMoe) model: router, routed experts, losses.

Dispatch is *dropless* and sorted: every (token, slot) assignment is sorted by expert, the tokens are
gathered once, each expert runs its SwiGLU on one contiguous slice, and the weighted outputs are scattered
back with a single ``index_add_``. No capacity factor, no token is ever dropped.

Pure torch; nothing here knows about distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edit_train.model.config import ModelConfig


class DenseMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Linear):
    """The router (``mlp.gate``): a bias-free linear layer whose logits are always computed in fp32."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__(hidden_size, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> fp32 [N, E]
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


class RoutedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as stacked parameters.

    ``gate_proj``/``up_proj`` are ``[E, I, H]`` and ``down_proj`` is ``[E, H, I]``: expert ``e`` is exactly an
    ``nn.Linear`` stack whose weights are ``gate_proj[e]``, ``up_proj[e]`` and ``down_proj[e]``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dropless sorted dispatch.

        Args:
            x: ``[N, H]`` tokens.
            topk_idx: ``[N, k]`` expert index of each routing slot.
            topk_weight: ``[N, k]`` routing weight of each slot.

        Returns:
            ``(y [N, H], counts [E])`` where ``counts`` is the number of tokens each expert processed.
        """
        n, k = topk_idx.shape
        flat_idx = topk_idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)  # slot positions grouped by expert
        token_idx = order // k  # the token each sorted slot belongs to
        counts = torch.bincount(flat_idx, minlength=self.num_experts)
        w_sorted = topk_weight.reshape(-1).index_select(0, order)

        dtype = x.dtype
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        weights = [p if p.dtype == dtype else p.to(dtype)
                   for p in (self.gate_proj, self.up_proj, self.down_proj)]
        xs = x.to(dtype).index_select(0, token_idx)  # each token once per slot, grouped by expert
        with torch.autocast(device_type=device_type, enabled=False):
            ys = _GroupedSwiGLU.apply(xs, w_sorted.to(dtype), *weights, counts.tolist())
        y = ys.new_zeros(n, x.shape[-1]).index_add_(0, token_idx, ys)
        return y, counts


def _slices(counts: list[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, end)`` of every non-empty expert in the sorted slot order."""
    out, start = [], 0
    for e, c in enumerate(counts):
        if c:
            out.append((e, start, start + c))
        start += c
    return out


class _GroupedSwiGLU(torch.autograd.Function):
    """``w[:, None] * down_e(silu(gate_e(x)) * up_e(x))`` over expert-sorted slots, with a hand-written backward.

    One matmul per expert and projection written straight into preallocated buffers (no cat/split/stack),
    the element-wise SwiGLU done once over all slots, and the weight gradients written straight into
    ``[E, ...]`` tensors. Saves ``xs, gate, up`` and the un-weighted output; ``silu(gate) * up`` is recomputed.
    """

    @staticmethod
    def forward(ctx, xs, w, gate_proj, up_proj, down_proj, counts):  # type: ignore[override]
        slices = _slices(counts)
        s, hdim = xs.shape
        idim = gate_proj.shape[1]
        g = xs.new_empty(s, idim)
        u = xs.new_empty(s, idim)
        for e, a, b in slices:
            torch.mm(xs[a:b], gate_proj[e].t(), out=g[a:b])
            torch.mm(xs[a:b], up_proj[e].t(), out=u[a:b])
        h = F.silu(g).mul_(u)
        out = xs.new_empty(s, hdim)
        for e, a, b in slices:
            torch.mm(h[a:b], down_proj[e].t(), out=out[a:b])
        ctx.slices = slices
        ctx.save_for_backward(xs, w, gate_proj, up_proj, down_proj, g, u, out)
        return out * w.unsqueeze(-1)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        xs, w, gate_proj, up_proj, down_proj, g, u, out = ctx.saved_tensors
        slices = ctx.slices
        need_x, need_w, need_g, need_u, need_d = ctx.needs_input_grad[:5]
        dy = dy.contiguous()
        dw = (dy * out).sum(-1) if need_w else None
        dout = dy * w.unsqueeze(-1)
        sig = torch.sigmoid(g)
        silu_g = g * sig
        # down projection
        dh = torch.empty_like(g)
        d_down = torch.zeros_like(down_proj) if need_d else None
        h = silu_g * u if need_d else None
        for e, a, b in slices:
            torch.mm(dout[a:b], down_proj[e], out=dh[a:b])
            if need_d:
                torch.mm(dout[a:b].t(), h[a:b], out=d_down[e])
        del h
        # SwiGLU: h = silu(g) * u
        du = dh * silu_g
        dg = dh.mul_(u).mul_(sig.mul_(1.0 + g * (1.0 - sig)))  # dh * u * silu'(g)
        del silu_g, sig
        dxs = torch.empty_like(xs) if need_x else None
        d_gate = torch.zeros_like(gate_proj) if need_g else None
        d_up = torch.zeros_like(up_proj) if need_u else None
        for e, a, b in slices:
            if need_x:
                torch.mm(dg[a:b], gate_proj[e], out=dxs[a:b])
                dxs[a:b].addmm_(du[a:b], up_proj[e])
            if need_g:
                torch.mm(dg[a:b].t(), xs[a:b], out=d_gate[e])
            if need_u:
                torch.mm(du[a:b].t(), xs[a:b], out=d_up[e])
        return dxs, dw, d_gate, d_up, d_down, None


def balance_loss(probs: torch.Tensor, counts: torch.Tensor, num_experts_per_tok: int,
                 coef: float) -> torch.Tensor:
    """Switch-style balance loss ``coef * E * sum_i f_i * P_i``.

    ``f_i`` is the fraction of (token, slot) assignments routed to expert ``i`` (``counts / (N*k)``, no
    gradient) and ``P_i`` the mean router probability of expert ``i`` over the tokens.
    """
    n, e = probs.shape
    f = counts.to(torch.float32) / max(n * num_experts_per_tok, 1)
    p = probs.float().mean(0)
    return coef * e * torch.sum(f * p)


def z_loss(logits: torch.Tensor, coef: float) -> torch.Tensor:
    """Router z-loss ``coef * mean_tokens(logsumexp(logits)^2)`` on the fp32 pre-softmax logits."""
    return coef * torch.logsumexp(logits.float(), dim=-1).square().mean()


class MoEBlock(nn.Module):
    """Routed experts + optional shared experts, with balance / z losses and stochastic routing warmup.

    After each forward the block holds ``aux_loss``, ``z_loss`` (scalar tensors, part of the graph) and
    ``last_expert_load`` (detached LongTensor ``[E]``: tokens routed to each expert).
    """

    def __init__(self, cfg: ModelConfig, stats_momentum: float = 0.99) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.aux_coef = cfg.router_aux_loss_coef
        self.z_coef = cfg.router_z_loss_coef
        self.warmup_steps = cfg.routing_warmup_steps
        self.stats_momentum = stats_momentum
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.num_shared_experts > 0:
            self.shared_experts = DenseMLP(cfg.hidden_size, cfg.num_shared_experts * cfg.moe_intermediate_size)
        else:
            self.shared_experts = None
        # running (detached) statistics of the router logits, used by the routing warmup noise
        self.register_buffer("logit_mean", torch.zeros(()), persistent=False)
        self.register_buffer("logit_std", torch.ones(()), persistent=False)
        self.step = 0
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.last_expert_load: torch.Tensor | None = None

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=std)
        self.experts.reset_parameters(std)
        if self.shared_experts is not None:
            for lin in (self.shared_experts.gate_proj, self.shared_experts.up_proj,
                        self.shared_experts.down_proj):
                nn.init.normal_(lin.weight, mean=0.0, std=std)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.logit_mean.fill_(0.0)
            self.logit_std.fill_(1.0)

    def set_step(self, step: int) -> None:
        self.step = int(step)

    def warmup_alpha(self) -> float:
        """Mixing coefficient ``a = i / W`` of the routing warmup (1.0 = logits untouched)."""
        if self.warmup_steps <= 0:
            return 1.0
        return min(max(self.step / self.warmup_steps, 0.0), 1.0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router for flattened tokens ``x [N, H]``.

        Returns ``(logits, probs, topk_idx, topk_weight)``: fp32 clean logits ``[N, E]``, fp32 routing
        probabilities ``[N, E]`` (after the warmup mixing, if any), and the top-k choice ``[N, k]``.
        """
        logits = self.gate(x)
        routing_logits = logits
        if self.training:
            if self.warmup_steps > 0:
                with torch.no_grad():
                    m = self.stats_momentum
                    self.logit_mean.mul_(m).add_((1 - m) * logits.mean())
                    if logits.numel() > 1:
                        self.logit_std.mul_(m).add_((1 - m) * logits.std())
            a = self.warmup_alpha()
            if a < 1.0:
                noise = self.logit_mean + self.logit_std * torch.randn_like(logits)
                routing_logits = a * logits + (1.0 - a) * noise
        probs = torch.softmax(routing_logits, dim=-1)
        topk_weight, topk_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob and self.top_k > 1:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        return logits, probs, topk_idx, topk_weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, probs, topk_idx, topk_weight = self.route(x)
        y, counts = self.experts(x, topk_idx, topk_weight)
        self.last_expert_load = counts.detach()
        self.aux_loss = balance_loss(probs, counts, self.top_k, self.aux_coef)
        self.z_loss = z_loss(logits, self.z_coef)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape).to(hidden_states.dtype)
