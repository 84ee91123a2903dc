"""Mixture-of-Experts block of the Ling (BailingMoe) model: router, routed experts, losses.

Dispatch is *dropless* and sorted: every (token, slot) assignment is sorted by expert (stable argsort), the
tokens are gathered once, each expert runs its SwiGLU on one contiguous slice (a loop over experts, not
tokens; empty experts skipped), and the weighted outputs are combined back per token. No capacity factor, no
token is ever dropped. Forward and backward of the routed experts are one hand-written autograd Function
(``_SortedMoE``) in which every data movement is a gather — scatter-adds (``index_add_``) are slow on CPU.

Ling 2.0 (BailingMoeV2, ``MoEBlock.route_ling2``): sigmoid scores, an aux-loss-free expert bias that only chooses
(``Router.expert_bias``, a persistent buffer), group-limited top-k and a routed scaling factor. The bias's life:
``CausalLM.update_expert_bias`` moves it once per optimizer step (the trainer calls it after the step, from the
step's load summed over the cluster's ranks); checkpoints carry it (model buffers), so a resume is exact; the
cross-cluster sync and healing move parameters (and optimizer / outer state) only, never buffers, so each cluster
keeps its own bias for the whole run (a healed cluster keeps the one it had); an export of the clusters' common
anchor writes the clusters' mean bias (``train/export.py``), the simplest rule.

Pure torch; nothing here knows about distribution.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from edit_train.model.config import ModelConfig
from edit_train.model.experts import grouped_experts, resolve_impl, working_copy


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
    """The router (``mlp.gate``): a bias-free linear layer whose logits are computed in (at least) fp32.

    With ``expert_bias`` it also holds ``expert_bias`` (fp32 ``[E]``, a persistent buffer: checkpointed and
    exported as BailingMoeV2's ``mlp.gate.expert_bias``, never seen by an optimizer), which ``MoEBlock.route``
    adds to the scores to choose the experts (aux-loss-free balancing) and ``update_expert_bias`` moves.
    """

    def __init__(self, hidden_size: int, num_experts: int, expert_bias: bool = False) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> fp32 [N, E]
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.to(dtype), self.weight.to(dtype))


class RoutedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as stacked parameters.

    ``gate_proj``/``up_proj`` are ``[E, I, H]`` and ``down_proj`` is ``[E, H, I]``: expert ``e`` is exactly an
    ``nn.Linear`` stack whose weights are ``gate_proj[e]``, ``up_proj[e]`` and ``down_proj[e]``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, impl: str = "sorted") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.impl = impl  # model.expert_impl: auto | grouped | sorted (see experts.py)
        self.last_impl: str | None = None  # the implementation the last forward ran
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dropless dispatch: the sorted reference path, or grouped matmuls (``experts.py``) per ``impl``.

        Args:
            x: ``[N, H]`` tokens.
            topk_idx: ``[N, k]`` expert index of each routing slot.
            topk_weight: ``[N, k]`` routing weight of each slot.

        Returns:
            ``(y [N, H], counts [E])``: ``y[n] = sum_j topk_weight[n, j] * expert_{topk_idx[n, j]}(x[n])`` and
            ``counts`` the number of tokens each expert processed.
        """
        dtype = x.dtype
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        weights = [working_copy(p, dtype) for p in (self.gate_proj, self.up_proj, self.down_proj)]
        impl = resolve_impl(self.impl, x.device, dtype, tuple(self.gate_proj.shape[1:]))
        self.last_impl = impl
        with torch.autocast(device_type=device_type, enabled=False):
            if impl == "grouped":
                return grouped_experts(x.to(dtype), topk_idx, topk_weight.to(dtype), *weights)
            return _sorted_experts(x.to(dtype), topk_idx, topk_weight.to(dtype), weights, self.num_experts)


@torch.compiler.disable  # data-dependent Python loop over the counts: under torch.compile it stays eager
def _sorted_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                    weights: list[torch.Tensor], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat_idx = topk_idx.reshape(-1)
    order = torch.argsort(flat_idx, stable=True)  # flat slot of each sorted position, grouped by expert
    counts = torch.bincount(flat_idx, minlength=num_experts)
    plan = _Plan(order, topk_idx.shape[1], counts.tolist())  # the host sync the grouped path avoids
    return _SortedMoE.apply(x, topk_weight, *weights, plan), counts


class _Plan:
    """Index bookkeeping of one dispatch (no gradients): sorted order, its inverse, per-expert slices."""

    def __init__(self, order: torch.Tensor, top_k: int, counts: list[int]) -> None:
        self.order = order
        self.top_k = top_k
        self.token_idx = order // top_k  # token of each sorted position
        self.inv_order = torch.empty_like(order)
        self.inv_order[order] = torch.arange(order.numel(), device=order.device)
        self.slices: list[tuple[int, int, int]] = []  # (expert, start, end) of every non-empty expert
        self.empty: list[int] = []
        start = 0
        for e, c in enumerate(counts):
            if c:
                self.slices.append((e, start, start + c))
            else:
                self.empty.append(e)
            start += c


class _SortedMoE(torch.autograd.Function):
    """``y[n] = sum_j w[n, j] * down_e(silu(gate_e(x[n])) * up_e(x[n]))``, ``e = topk_idx[n, j]``.

    Forward and backward are written by hand so that

    * every data movement is a gather (no scatter-add);
    * the work is blocked per expert: an expert's slice of tokens goes through its matmuls, SwiGLU and
      gradients while it is hot in cache, with matmuls writing straight into preallocated buffers (no cat /
      split / stack) and weight gradients landing directly in ``[E, ...]`` tensors;
    * only the gathered tokens and ``gate(x)``, ``up(x)`` (expert-sorted) are saved; ``silu(gate) * up`` is
      recomputed, and the routing-weight gradient is taken as ``<down^T dy, h>`` so that the expert outputs
      need not be kept.
    """

    @staticmethod
    def forward(ctx, x, w, gate_proj, up_proj, down_proj, plan):  # type: ignore[override]
        s = plan.order.numel()
        n, k = w.shape
        idim, hdim = gate_proj.shape[1], x.shape[-1]
        xs = x.index_select(0, plan.token_idx)
        g = x.new_empty(s, idim)
        u = x.new_empty(s, idim)
        out = x.new_empty(s, hdim)
        for e, a, b in plan.slices:
            xe = xs[a:b]
            ge = torch.mm(xe, gate_proj[e].t(), out=g[a:b])
            ue = torch.mm(xe, up_proj[e].t(), out=u[a:b])
            torch.mm(F.silu(ge).mul_(ue), down_proj[e].t(), out=out[a:b])
        # combine: y[n] = sum_j w[n, j] * out[inv_order[n*k + j]]  (k gathers, no scatter)
        inv = plan.inv_order.view(n, k)
        y = out.index_select(0, inv[:, 0]).mul_(w[:, :1])
        if k > 1:
            tmp = torch.empty_like(y)
            for j in range(1, k):
                y.addcmul_(torch.index_select(out, 0, inv[:, j], out=tmp), w[:, j:j + 1])
        ctx.plan = plan
        ctx.save_for_backward(xs, w, gate_proj, up_proj, down_proj, g, u)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        xs, w, gate_proj, up_proj, down_proj, g, u = ctx.saved_tensors
        plan: _Plan = ctx.plan
        need_x, need_w, need_g, need_u, need_d = ctx.needs_input_grad[:5]
        n, k = w.shape
        w_sorted = w.reshape(-1).index_select(0, plan.order).unsqueeze(-1)
        # dL/d(slot output) of every sorted slot; each expert's slice is then overwritten by its dL/dx
        dxs = dy.index_select(0, plan.token_idx)
        dw_sorted = dxs.new_empty(dxs.shape[0]) if need_w else None
        d_gate = torch.empty_like(gate_proj) if need_g else None
        d_up = torch.empty_like(up_proj) if need_u else None
        d_down = torch.empty_like(down_proj) if need_d else None
        for e, a, b in plan.slices:
            do, ge, ue, we = dxs[a:b], g[a:b], u[a:b], w_sorted[a:b]
            silu_g = F.silu(ge)
            h = silu_g * ue
            dh = torch.mm(do, down_proj[e])  # down^T dy, before the routing weight
            if need_w:
                torch.linalg.vecdot(dh, h, out=dw_sorted[a:b])  # dL/dw = <dy, down(h)> = <down^T dy, h>
            dh.mul_(we)
            if need_d:
                torch.mm(do.t(), h.mul_(we), out=d_down[e])  # (w dy)^T h = dy^T (w h); h is dead after
            du = torch.mul(dh, silu_g, out=h)
            dg = torch.ops.aten.silu_backward.grad_input(dh.mul_(ue), ge, grad_input=silu_g)
            if need_g:
                torch.mm(dg.t(), xs[a:b], out=d_gate[e])
            if need_u:
                torch.mm(du.t(), xs[a:b], out=d_up[e])
            if need_x:
                torch.mm(dg, gate_proj[e], out=do).addmm_(du, up_proj[e])
        for grad in (d_gate, d_up, d_down):
            if grad is not None and plan.empty:
                grad[plan.empty] = 0
        dw = dw_sorted.index_select(0, plan.inv_order).view(n, k) if need_w else None
        dx = None
        if need_x:
            inv = plan.inv_order.view(n, k)
            dx = dxs.index_select(0, inv[:, 0])
            if k > 1:
                tmp = torch.empty_like(dx)
                for j in range(1, k):
                    dx.add_(torch.index_select(dxs, 0, inv[:, j], out=tmp))
        return dx, dw, d_gate, d_up, d_down, None


def balance_loss(probs: torch.Tensor, counts: torch.Tensor, num_experts_per_tok: int,
                 coef: float) -> torch.Tensor:
    """Switch-style balance loss ``coef * E * sum_i f_i * P_i``.

    ``f_i`` is the fraction of (token, slot) assignments routed to expert ``i`` (``counts / (N*k)``, no
    gradient) and ``P_i`` the mean router probability of expert ``i`` over the tokens.
    """
    n, e = probs.shape
    dtype = torch.promote_types(probs.dtype, torch.float32)
    f = counts.to(dtype) / max(n * num_experts_per_tok, 1)
    p = probs.to(dtype).mean(0)
    return coef * e * torch.sum(f * p)


def bias_update(load: torch.Tensor, rate: float, zero_mean: bool = True) -> torch.Tensor:
    """The aux-loss-free bias update of one optimizer step: ``rate * sign(mean(load) - load)`` (an overloaded
    expert's bias falls, an underloaded one's rises, a balanced one's stays), minus its own mean when
    ``zero_mean`` (so a bias that starts at zero keeps mean zero). ``load`` is the step's tokens per expert."""
    load = load.to(torch.float32)
    delta = rate * torch.sign(load.mean() - load)
    if zero_mean:
        delta = delta - delta.mean()
    return delta


def group_limited_mask(scores: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Boolean ``[N, E]``: the experts of each token's ``topk_group`` best groups. The ``E`` experts form
    ``n_group`` contiguous groups; a group's score is the sum of its two best expert scores (BailingMoeV2 /
    DeepSeek-V3's rule)."""
    n, e = scores.shape
    grouped = scores.view(n, n_group, e // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, n_group]
    chosen = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return keep.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)


def z_loss(logits: torch.Tensor, coef: float) -> torch.Tensor:
    """Router z-loss ``coef * mean_tokens(logsumexp(logits)^2)`` on the fp32 pre-softmax logits."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return coef * torch.logsumexp(logits.to(dtype), dim=-1).square().mean()


class MoEBlock(nn.Module):
    """Routed experts + optional shared experts, with balance / z losses and stochastic routing warmup.

    After each forward the block holds ``aux_loss``, ``z_loss`` (scalar tensors, part of the graph) and
    ``last_expert_load`` (detached LongTensor ``[E]``: tokens routed to each expert). Every training forward
    also adds its counts to ``routed_tokens`` (a non-persistent int64 ``[E]`` buffer on the block's device, so
    no host sync) until ``reset_buffers``: the tokens each expert was routed since the caller last read them.
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
        self.ling2 = cfg.ling2_router  # False: exactly Ling 1's softmax top-k, as before these fields existed
        self.score_function = cfg.score_function
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.bias_rate = cfg.moe_router_bias_update_rate
        self.bias_zero_mean = cfg.moe_router_bias_update_zero_mean
        self.gate = Router(cfg.hidden_size, cfg.num_experts, expert_bias=cfg.moe_router_enable_expert_bias)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                     impl=cfg.expert_impl)
        if cfg.num_shared_experts > 0:
            self.shared_experts = DenseMLP(cfg.hidden_size, cfg.num_shared_experts * cfg.moe_intermediate_size)
        else:
            self.shared_experts = None
        # running (detached) statistics of the router logits, used by the routing warmup noise
        # (folded in once per optimizer step, in ``set_step``, so a recomputed forward sees the same stats)
        self.register_buffer("logit_mean", torch.zeros(()), persistent=False)
        self.register_buffer("logit_std", torch.ones(()), persistent=False)
        self.register_buffer("routed_tokens", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)
        if cfg.moe_router_enable_expert_bias:  # this optimizer step's tokens per expert (the bias update's input)
            self.register_buffer("step_tokens", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)
        else:
            self.step_tokens: torch.Tensor | None = None
        self.step = 0
        self._batch_stats: tuple[torch.Tensor, torch.Tensor] | None = None
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
            self.routed_tokens.zero_()
            if self.step_tokens is not None:
                self.step_tokens.zero_()
            if self.gate.expert_bias is not None:
                self.gate.expert_bias.zero_()
        self._batch_stats = None

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor | None = None) -> None:
        """One optimizer step's bias update (``bias_update``) from ``load`` (default: the tokens this block routed
        since the last update, ``step_tokens``), which is then cleared. No-op without an expert bias."""
        bias = self.gate.expert_bias
        if bias is None or self.step_tokens is None:
            return
        load = self.step_tokens if load is None else load
        bias.add_(bias_update(load.to(bias.device), self.bias_rate, self.bias_zero_mean))
        self.step_tokens.zero_()

    def set_step(self, step: int) -> None:
        """Set the optimizer step (drives the warmup) and fold the last batch's logit statistics into the
        running ``logit_mean`` / ``logit_std`` (EMA with ``stats_momentum``)."""
        self.step = int(step)
        if self._batch_stats is not None:
            mean, std = self._batch_stats
            m = self.stats_momentum
            with torch.no_grad():
                self.logit_mean.mul_(m).add_((1 - m) * mean)
                self.logit_std.mul_(m).add_((1 - m) * std)
            self._batch_stats = None

    def warmup_alpha(self) -> float:
        """Mixing coefficient ``a = i / W`` of the routing warmup (1.0 = logits untouched)."""
        if self.warmup_steps <= 0:
            return 1.0
        return min(max(self.step / self.warmup_steps, 0.0), 1.0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router for flattened tokens ``x [N, H]``.

        Returns ``(logits, probs, topk_idx, topk_weight)``: fp32 clean logits ``[N, E]``, fp32 routing
        probabilities ``[N, E]`` (after the warmup mixing, if any), and the top-k choice ``[N, k]``.

        Stochastic routing warmup (Ling eq. 3): while training at step ``i < W`` the routing logits are
        ``a * s + (1 - a) * (mu + sigma * eps)`` with ``a = i / W``, ``eps ~ N(0, I)`` and ``mu, sigma`` the
        running (detached) mean / std of the logits.
        """
        logits = self.gate(x)
        routing_logits = logits
        if self.training and self.warmup_alpha() < 1.0:
            a = self.warmup_alpha()
            flat = logits.detach()
            self._batch_stats = (flat.mean(), flat.std() if flat.numel() > 1 else flat.new_ones(()))
            noise = self.logit_mean + self.logit_std * torch.randn_like(logits)
            routing_logits = a * logits + (1.0 - a) * noise
        if self.ling2:
            return (logits, *self.route_ling2(routing_logits))
        probs = torch.softmax(routing_logits, dim=-1)
        topk_weight, topk_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob and self.top_k > 1:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        return logits, probs, topk_idx, topk_weight

    def route_ling2(self, routing_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """BailingMoeV2's routing of fp32 logits ``[N, E]``: scores ``s`` (sigmoid or softmax); the choice is made
        on ``s + expert_bias`` (when the bias is on), within each token's ``topk_group`` best groups (when
        ``n_group > 0``); the weights are the chosen experts' *unbiased* scores, renormalised to sum 1 when
        ``norm_topk_prob`` (``+1e-20``, as the reference), times ``routed_scaling_factor``.

        Returns ``(probs, topk_idx, topk_weight)``; ``probs`` (what the balance loss averages) are the scores
        normalised over the experts (for softmax: the scores themselves)."""
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(routing_logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        else:
            scores = probs = torch.softmax(routing_logits, dim=-1)
        choice = scores.detach()
        if self.gate.expert_bias is not None:
            choice = choice + self.gate.expert_bias
        if self.n_group > 0:
            keep = group_limited_mask(choice, self.n_group, self.topk_group)
            choice = choice.masked_fill(~keep, float("-inf"))
        topk_idx = torch.topk(choice, self.top_k, dim=-1).indices
        topk_weight = scores.gather(1, topk_idx)
        if self.norm_topk_prob and self.top_k > 1:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            topk_weight = topk_weight * self.routed_scaling_factor
        return probs, topk_idx, topk_weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, probs, topk_idx, topk_weight = self.route(x)
        y, counts = self.experts(x, topk_idx, topk_weight)
        self.last_expert_load = counts.detach()  # CausalLM.forward adds it to routed_tokens (outside any
        # checkpointed or compiled region: an in-place update there would break the recompute)
        if self.gate.expert_bias is not None:  # the bias balances: no auxiliary loss
            self.aux_loss = torch.zeros((), dtype=torch.float32, device=x.device)
        else:
            self.aux_loss = balance_loss(probs, counts, self.top_k, self.aux_coef)
        self.z_loss = z_loss(logits, self.z_coef)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape).to(hidden_states.dtype)
