"""A toy federation: the same training loop (a 3-unit MLP, plain SGD, a deterministic batch per cluster and
step) run by clusters that are threads of this process (`federation.inproc`) or separate processes (gloo
lanes and a real Lighthouse), and the closed-form EDiT reference it must equal.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from edit_train.cluster.group import RankGroup
from edit_train.federation import heal
from edit_train.federation.inproc import ClusterKilled, InProcessFederation
from edit_train.federation.registry import TransportRequest, make_transport
from edit_train.local_sgd.sync.algorithms import LocalSGD, LocalSGDConfig
from edit_train.local_sgd.errors import SyncAborted
from edit_train.local_sgd.sync.outer import OuterConfig
from edit_train.local_sgd.aggregation.rules import EditNormConfig, RuleConfig
from edit_train.local_sgd.aggregation.verified import VerifiedConfig
from edit_train.local_sgd.protocols import Transport
from edit_train.local_sgd.sync.schedule import ScheduleConfig

LR = 0.05
H = 4


_INIT = threading.Lock()  # the global RNG: clusters that are threads must not interleave their inits


def toy_model() -> nn.Sequential:
    with _INIT:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))


def units_of(model: nn.Sequential) -> list[nn.Module]:
    return [model[0], model[2], model[4]]


def batch(cluster: int, step: int, shared: bool = False) -> tuple[Tensor, Tensor]:
    """Cluster `cluster`'s batch of step `step`: its own task, or (`shared`) one task for all (other data)."""
    g = torch.Generator().manual_seed(1000 * cluster + step)
    x = torch.randn(8, 6, generator=g)
    w = torch.randn(6, 3, generator=torch.Generator().manual_seed(7 + (0 if shared else cluster)))
    return x, torch.tanh(x @ w) * (1.0 if shared else 1.0 + 0.5 * cluster)


def config(mode: str, rule: str = "edit_norm", syncs: int = 3, phi: float = 0.05, warmup: int = 10,
           **outer: Any) -> LocalSGDConfig:
    """EDiT over `syncs` intervals of H steps; no anomaly flag can fire in so few syncs (warm-up 10), so the
    weights are the closed-form softmax; φ small enough that clipping acts on some modules."""
    penalty = RuleConfig(name=rule, clip_threshold=phi, verified=VerifiedConfig(warmup_syncs=warmup, sketch_dim=256),
                            edit_norm=EditNormConfig(warmup_syncs=warmup))
    return LocalSGDConfig(schedule=ScheduleConfig(interval=H), outer=OuterConfig(**{"lr": 0.7, "momentum": 0.8,
                          "nesterov": True, **outer}), rule=penalty, mode=mode, total_steps=syncs * H)


@dataclass
class Outcome:
    anchors: list[list[Tensor]] = field(default_factory=list)  # per unit
    params: list[Tensor] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    snapshots: dict[Any, dict[str, Any]] = field(default_factory=dict)  # step -> state before its after_step;
    # "aborted" -> state when a sync_aborted event was emitted (after the rollback)
    killed: bool = False
    steps: int = 0
    algo: LocalSGD | None = None


def state_of(algo: LocalSGD) -> dict[str, Any]:
    """Anchor, outer optimizer state and live parameters (clones)."""
    assert algo.driver is not None
    outer = algo.driver.core.outer
    feedback = getattr(algo.t, "feedback", None)
    return {"outer": {k: v.clone() for k, v in outer.state_dict().items()},
            "params": [p.detach().clone() for p in algo.replica.model.parameters()],
            "anchor": [[a.clone() for a in outer.anchors[u.name]] for u in algo.replica.units],
            "residuals": feedback.keys() if feedback is not None else []}


def train_cluster(index: int, transport: Transport, cfg: LocalSGDConfig, *, flush_each_step: bool = False,
                  snapshot_at: tuple[int, ...] = (), after_at: tuple[int, ...] = (), out: Outcome | None = None,
                  wrap: Callable[[Transport, Callable[[], int]], Transport] | None = None,
                  shared_task: bool = False, lr: float = LR, probe: bool = False,
                  ascent: tuple[int, int] = (0, 0), routed: Callable[[int], Any] | None = None,
                  step_s: float = 0.01) -> Outcome:
    """The loop of `train/trainer.py` in miniature (a layer-wise sync that lost a cluster re-runs the
    forward). `out` collects events while it runs; `wrap(transport, step)` may stand between the cluster and
    its transport (a Byzantine fault); in the `ascent` window of steps it climbs its loss instead (a wrong
    update it reports, sketches and sends consistently). `snapshot_at` steps are captured before their `after_step`, `after_at`
    steps after it (and its flush). `probe`: the usefulness probe scores updates on a batch of this cluster's
    own task that it never trains on. `routed(index)`: the cluster's `RoutedCounts` (tests/local_sgd/test_expert_sync.py).
    `step_s`: the compute seconds each step reports (what an A-EDiT schedule plans its intervals from)."""
    torch.set_num_threads(1)
    out = out if out is not None else Outcome()
    current = [0]
    if wrap is not None:
        transport = wrap(transport, lambda: current[0])
    model = toy_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def emit(event: str, **kw: Any) -> None:
        out.events.append({"event": event, **kw})
        if event == "sync_aborted" and out.algo is not None:
            out.snapshots.setdefault("aborted", state_of(out.algo))

    held_out = batch(index, 10_000, shared_task)
    probe_loss = (lambda: float(nn.functional.mse_loss(model(held_out[0]), held_out[1]))) if probe else None
    algo = LocalSGD(cfg, model, units_of(model), transport, (heal.encode, heal.decode), emit=emit,
                    cluster_index=index, optimizer=opt, probe_loss=probe_loss,
                    routed_counts=routed(index) if routed is not None else None)
    out.algo = algo
    try:
        adopted = algo.join()
        step = adopted if adopted is not None else 0
        while not algo.should_stop(step):
            current[0] = step
            x, y = batch(index, step, shared_task)
            try:
                loss = nn.functional.mse_loss(model(x), y)
            except SyncAborted:
                loss = nn.functional.mse_loss(model(x), y)
            (-loss if ascent[0] <= step < ascent[1] else loss).backward()
            algo.after_backward(step)
            opt.step()
            opt.zero_grad()
            if step in snapshot_at:
                out.snapshots[step] = state_of(algo)
            outcome = algo.after_step(step, step_s)
            if flush_each_step:
                algo.flush()
            if step in after_at:
                out.snapshots[("after", step)] = state_of(algo)
            step = outcome.adopt_step if outcome.adopt_step is not None else step + 1
        algo.finish()
    except ClusterKilled:
        out.killed = True
        return out
    assert algo.driver is not None
    out.anchors = [[a.clone() for a in algo.driver.core.outer.anchors[u.name]] for u in algo.replica.units]
    out.params = [p.detach().clone() for p in model.parameters()]
    out.steps = step
    algo.close()
    return out


def run_inproc(names: list[str], cfg: LocalSGDConfig, *, hub: InProcessFederation | None = None,
               before: Callable[[InProcessFederation], None] | None = None, **kw: Any) -> dict[str, Outcome]:
    """Every cluster a thread of this process; `kw` goes to `train_cluster` (`compression`, `link` to the
    transports)."""
    hub = hub or InProcessFederation(min_clusters=1, join_timeout_s=30.0, timeout_s=30.0)
    tkw = {k: kw.pop(k) for k in ("compression", "link") if k in kw}
    wraps = kw.pop("wraps", {})
    outs: dict[str, Outcome] = kw.pop("outs", {})  # a cluster's Outcome to fill while it runs (default: a new one)
    ascents = kw.pop("ascent", {})
    spec = kw.pop("transport", None)  # a transport by name or import path (federation/registry.py), over `hub`
    if spec is not None:
        InProcessFederation.install(hub)
        transports = {n: make_transport(spec, TransportRequest(n, RankGroup(), True, **tkw)) for n in names}
    else:
        transports = {n: hub.transport(n, RankGroup(), **tkw) for n in names}
    if before is not None:
        before(hub)
    results: dict[str, Outcome] = {}
    errors: list[BaseException] = []

    def one(i: int, n: str) -> None:
        try:
            results[n] = train_cluster(i, transports[n], cfg, wrap=wraps.get(n), ascent=ascents.get(n, (0, 0)),
                                       out=outs.get(n), **kw)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, n), daemon=True) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    assert all(not t.is_alive() for t in threads), "a cluster thread hung"
    return results


# ------------------------------------------------------------------------------------- closed form
def local_deltas(anchor: list[list[Tensor]], n: int, k: int, shared: bool = False, lr: float = LR,
                 ) -> list[list[list[Tensor]]]:
    """[cluster][unit][tensor]: Δᵢ = θ̄ − θᵢ of each of `n` clusters after interval `k`'s H local SGD steps from
    `anchor` on its own batches."""
    deltas = []
    for i in range(n):
        m = toy_model()
        with torch.no_grad():
            for u, a in zip(units_of(m), anchor):
                for p, t in zip(u.parameters(), a):
                    p.copy_(t)
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        for step in range(k * H, (k + 1) * H):
            x, y = batch(i, step, shared)
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        deltas.append([[a - p.detach() for a, p in zip(au, u.parameters())] for au, u in zip(anchor, units_of(m))])
    return deltas


def reference(n: int, syncs: int, rule: str, lr: float = 0.7, mu: float = 0.8, nesterov: bool = True,
              phi: float = 0.05, temperature: float = 1.0) -> list[list[Tensor]]:
    """The anchor after `syncs` EDiT syncs of `n` clusters, computed directly from the math
    (docs/sync_math.md): H local SGD steps from the anchor, Δᵢ = θ̄ − θᵢ, weights (uniform, or softmax of
    −xᵢ/(T·m) with xᵢ = ‖Δᵢ‖/H and m the lower median), Δ = Σ wᵢΔᵢ clipped to φ, Nesterov SGD on θ̄."""
    model = toy_model()
    anchor = [[p.detach().clone() for p in u.parameters()] for u in units_of(model)]
    bufs: list[list[Tensor] | None] = [None] * len(anchor)
    for k in range(syncs):
        deltas = local_deltas(anchor, n, k)
        for j in range(len(anchor)):
            norms = [math.sqrt(sum(float(d.double().pow(2).sum()) for d in deltas[i][j])) for i in range(n)]
            if rule == "uniform":
                w = [1.0 / n] * n
            else:
                x = [g / H for g in norms]
                med = sorted(x)[(n - 1) // 2]
                e = [math.exp(-(xi - min(x)) / (temperature * med)) for xi in x]
                w = [ei / sum(e) for ei in e]
            total = [sum(deltas[i][j][t] * w[i] for i in range(n)) for t in range(len(anchor[j]))]
            sq = sum(float(t.double().pow(2).sum()) for t in total)
            coef = min(1.0, phi / (math.sqrt(sq) + 1e-6))
            g = [t * coef for t in total] if coef != 1.0 else total
            if mu > 0:
                bufs[j] = [t.clone() for t in g] if bufs[j] is None else [mu * b + t for b, t in zip(bufs[j], g)]
                g = [t + mu * b for t, b in zip(g, bufs[j])] if nesterov else list(bufs[j])
            anchor[j] = [a - lr * t for a, t in zip(anchor[j], g)]
    return anchor


def max_diff(a: list[list[Tensor]], b: list[list[Tensor]]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for ua, ub in zip(a, b) for x, y in zip(ua, ub))
