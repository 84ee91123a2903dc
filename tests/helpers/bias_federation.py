"""A federation of small Ling 2.0 models (sigmoid routing, an expert bias) in one process, for algo.expert_bias
(issue 68): each cluster a thread running the trainer's loop in miniature (forward, backward, the outer algorithm's
calls, the optimizer step, the model's per-step bias update), its `RoutedCounts` and `BiasHook` the trainer's
(`train/routing.py`). Site i's tokens come from its own half of the vocabulary, whose embeddings and router rows
are set so that its traffic goes to its own half of the experts (`disjoint`), or every site sees the same mix.
`single` trains one cluster on both halves' tokens (each step: every site's batch)."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from edit_train.cluster.group import RankGroup
from edit_train.cluster.mesh import fsdp_units
from edit_train.federation import heal
from edit_train.federation.inproc import InProcessFederation
from edit_train.local_sgd.sync.algorithms import LocalSGD, LocalSGDConfig
from edit_train.local_sgd.moe.experts import RoutedCounts
from edit_train.local_sgd.sync.outer import OuterConfig
from edit_train.local_sgd.aggregation.rules import RuleConfig
from edit_train.local_sgd.sync.schedule import ScheduleConfig
from edit_train.model import CausalLM
from edit_train.model.config import ModelConfig
from edit_train.model.expert_params import sync_pieces
from edit_train.train.routing import expert_bias_hook

V, E, K, B, T = 64, 8, 2, 16, 16  # vocabulary, experts, top-k, batch, sequence
RATE = 0.005
_INIT = threading.Lock()


def model_config(rate: float = RATE) -> ModelConfig:
    return ModelConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, num_experts=E, num_experts_per_tok=K,
                       moe_intermediate_size=16, intermediate_size=32, first_k_dense_replace=0,
                       score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_bias_update_rate=rate, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)


def make_model(disjoint: bool = True) -> CausalLM:
    """Seeded; `disjoint`: the first half of the vocabulary scores experts 0..E/2-1 high, the second half the rest
    (dimension 0 of the embeddings ±2, of the routers' rows ±1.5), with a random tilt per token and expert."""
    with _INIT:
        torch.manual_seed(0)
        model = CausalLM(model_config())
        if disjoint:
            with torch.no_grad():
                emb = model.word_embeddings.weight
                emb.copy_(torch.randn_like(emb))
                emb[: V // 2, 0] = 2.0
                emb[V // 2:, 0] = -2.0
                for block in model.moe_blocks():
                    w = block.gate.weight
                    w[: E // 2, 0] = 1.5
                    w[E // 2:, 0] = -1.5
                    w[:, 1:] = torch.randn(E, w.shape[1] - 1) * 0.15
    return model


def batch(site: int, step: int, sites: int) -> Tensor:
    """Site `site`'s tokens at `step`: its half of the vocabulary (site parity), skewed towards a few tokens."""
    g = torch.Generator().manual_seed(1000 * site + step)
    half = V // 2
    lo = (site % 2) * half
    x = (torch.rand(B, T + 1, generator=g) ** 2 * half).long().clamp_max(half - 1)
    return x + lo


def routed(model: CausalLM, lie: Callable[[Tensor], Tensor] | None = None,
           seen: list[Tensor] | None = None) -> RoutedCounts:
    """The trainer's RoutedCounts (train/routing.py, one rank); `lie` changes what it reports, `seen` records it."""
    def take() -> Tensor:
        counts = model.expert_counts().clone()
        model.reset_expert_counts()
        if lie is not None:
            counts = lie(counts)
        if seen is not None:
            seen.append(counts.clone())
        return counts
    return RoutedCounts(take, sync_pieces(model))


def config(rule: str, syncs: int, interval: int) -> LocalSGDConfig:
    return LocalSGDConfig(schedule=ScheduleConfig(interval=interval),
                          outer=OuterConfig(lr=0.7, momentum=0.0, nesterov=False),
                          rule=RuleConfig(name="uniform"), mode="at_end", total_steps=syncs * interval,
                          tokens_per_step=B * T, max_tokens_per_step=B * T, expert_bias=rule)


@dataclass
class Site:
    events: list[dict[str, Any]] = field(default_factory=list)
    bias: Tensor | None = None  # the live bias at the end [layers, E]
    anchor: Tensor | None = None
    seen: list[Tensor] = field(default_factory=list)  # the counts it reported, per sync
    biases: list[Tensor] = field(default_factory=list)  # live bias after each step
    algo: LocalSGD | None = None
    saved: dict[str, Any] | None = None  # stop_at's checkpoint


def train_site(index: int, transport: Any, cfg: LocalSGDConfig, sites: int, out: Site, disjoint: bool = True,
               lie: Callable[[Tensor], Tensor] | None = None, stop_at: int | None = None,
               resume: dict[str, Any] | None = None) -> Site:
    """`stop_at`: leave after that many steps (a checkpoint in `out.saved`: the model's and optimizer's state
    dicts, the sync state's tensors and JSON, as `train/checkpoint.py` keeps them); `resume`: start from one."""
    torch.set_num_threads(1)
    model = make_model(disjoint)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def emit(event: str, **kw: Any) -> None:
        out.events.append({"event": event, **kw})

    algo = LocalSGD(cfg, model, fsdp_units(model), transport, (heal.encode, heal.decode), emit=emit,
                    cluster_index=index, optimizer=opt, routed_counts=routed(model, lie, out.seen),
                    bias_hook=expert_bias_hook(model, model.config))
    out.algo = algo
    step = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optim"])
        algo.state.load(resume["tensors"], json.loads(resume["json"]))
        step = resume["step"]
    adopted = algo.join()
    step = adopted if adopted is not None else step
    while not algo.should_stop(step):
        if stop_at is not None and step == stop_at:
            out.saved = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict()),
                         "tensors": copy.deepcopy(algo.state.tensors()), "json": json.dumps(algo.state.json()),
                         "step": step}
            algo.close()
            return out
        x = batch(index, step, sites)
        loss = _loss(model, x)
        loss.backward()
        algo.after_backward(step)
        opt.step()
        model.update_expert_bias(algo.bias_load(step))  # the trainer's call
        opt.zero_grad()
        outcome = algo.after_step(step, 0.01)
        out.biases.append(expert_bias_hook(model, model.config).get().clone())
        step = outcome.adopt_step if outcome.adopt_step is not None else step + 1
    algo.finish()
    out.bias = expert_bias_hook(model, model.config).get().clone()
    out.anchor = algo.bias.anchor.clone() if algo.bias is not None and algo.bias.anchor is not None else None
    algo.close()
    return out


def _loss(model: CausalLM, x: Tensor) -> Tensor:
    return model(x[:, :-1], labels=x[:, 1:]).loss


def run_federation(rule: str, sites: int = 2, syncs: int = 8, interval: int = 8, disjoint: bool = True,
                   lies: dict[int, Callable[[Tensor], Tensor]] | None = None, stop_at: int | None = None,
                   resume: list[dict[str, Any]] | None = None) -> list[Site]:
    hub = InProcessFederation(min_clusters=sites, join_timeout_s=30.0, timeout_s=60.0)
    names = [f"c{i}" for i in range(sites)]
    transports = [hub.transport(n, RankGroup()) for n in names]
    cfg = config(rule, syncs, interval)
    outs = [Site() for _ in names]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            train_site(i, transports[i], cfg, sites, outs[i], disjoint, (lies or {}).get(i), stop_at,
                       resume[i] if resume is not None else None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(sites)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return outs


def run_single(sites: int = 2, steps: int = 64, interval: int = 8, disjoint: bool = True) -> list[Tensor]:
    """One cluster trained on every site's tokens (each step: all the sites' batches), the per-step bias update
    from the whole load. Returns its routed counts per `interval` steps ([layers, E] each), as a sync reads them."""
    torch.set_num_threads(1)
    model = make_model(disjoint)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    model.reset_expert_counts()
    for step in range(steps):
        x = torch.cat([batch(i, step, sites) for i in range(sites)])
        _loss(model, x).backward()
        opt.step()
        model.update_expert_bias()
        opt.zero_grad()
        if (step + 1) % interval == 0:
            out.append(model.expert_counts().clone())
            model.reset_expert_counts()
    return out


def maxvio_tail(per_interval: list[list[float]], last: int) -> float:
    """MaxVio averaged over the layers and the `last` intervals."""
    tail = per_interval[-last:]
    return sum(sum(v) / len(v) for v in tail) / len(tail)


def federation_maxvio(site: Site) -> list[list[float]]:
    """The federation's MaxVio per layer at each sync (the `sync` events)."""
    return [e["expert_bias"]["maxvio"]["federation"] for e in site.events if e["event"] == "sync"]


def last_maxvio(site: Site) -> list[float]:
    """The federation's MaxVio per layer at the last sync (the `sync` event)."""
    syncs = [e for e in site.events if e["event"] == "sync"]
    return syncs[-1]["expert_bias"]["maxvio"]["federation"]


__all__ = ["run_federation", "run_single", "last_maxvio", "maxvio_tail", "federation_maxvio", "make_model", "batch"]
