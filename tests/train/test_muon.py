"""Issue 51: `train.optimizer=muon` — Muon's orthogonalised update on the layers' 2-D matrices (bit-identical to
torch.optim.Muon) and per expert matrix on 3-D expert stacks; AdamW on embeddings, head, norms; checkpoint
round trip; one-line config errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edit_train.config import Config, ConfigError, TrainConfig, validate
from edit_train.train.muon import ADJUST_LR, MuonAdamW, orthogonalised, uses_muon
from edit_train.train.optim import build_optimizer
from edit_train.train.state import load_optimizer_tensors, optimizer_tensors

LR, WD, MOM = 0.02, 0.1, 0.95


class Toy(nn.Module):
    """The names and shapes Muon sorts by: embeddings, a layer's norm, attention and router matrices, an expert
    stack, the head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        self.word_embeddings = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.Module()])
        layer = self.layers[0]
        layer.norm = nn.LayerNorm(8)
        layer.dense = nn.Linear(8, 12, bias=True)
        layer.gate = nn.Linear(8, 4, bias=False)  # the router
        layer.experts = nn.Parameter(torch.randn(4, 8, 6, generator=g))
        self.lm_head = nn.Linear(8, 16, bias=False)

    def loss(self, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        tok = torch.randint(0, 16, (5,), generator=g)
        x = self.layers[0].norm(self.word_embeddings(tok))
        h = self.layers[0].dense(x).sum() + self.layers[0].gate(x).square().sum()
        e = torch.einsum("td,edf->tef", x, self.layers[0].experts).tanh().sum()
        return h + e + self.lm_head(x).logsumexp(-1).sum()


def _train(model: Toy, opt: torch.optim.Optimizer, seeds: range) -> None:
    for s in seeds:
        opt.zero_grad(set_to_none=True)
        model.loss(s).backward()
        opt.step()


def _muon(model: Toy) -> MuonAdamW:
    t = TrainConfig(lr=LR, weight_decay=WD, optimizer="muon", muon_momentum=MOM)
    opt = build_optimizer(model.named_parameters(), t, torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    return opt


def test_which_parameters_muon_takes() -> None:
    model = Toy()
    took = sorted(n for n, p in model.named_parameters() if uses_muon(n, p))
    assert took == ["layers.0.dense.weight", "layers.0.experts", "layers.0.gate.weight"]


def test_2d_matrices_step_exactly_as_torch_muon_and_the_rest_as_adamw() -> None:
    ours, ref = Toy(), Toy()
    opt = _muon(ours)
    ref_mats = [ref.layers[0].dense.weight, ref.layers[0].gate.weight]
    torch_muon = torch.optim.Muon(ref_mats, lr=LR, weight_decay=WD, momentum=MOM, adjust_lr_fn=ADJUST_LR)
    rest = [p for n, p in ref.named_parameters() if not uses_muon(n, p)]
    adamw = torch.optim.AdamW(rest, lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8,
                              fused=True)  # as train/optim.py builds it on the CPU
    ref_expert = ref.layers[0].experts
    for s in range(3):
        for o in (opt, torch_muon, adamw):
            o.zero_grad(set_to_none=True)
        ours.loss(s).backward()
        ref.loss(s).backward()
        opt.step()
        torch_muon.step()
        adamw.step()
        ref_expert.grad = None
        with torch.no_grad():  # keep the expert stack out of this comparison (next test)
            ref_expert.copy_(ours.layers[0].experts)
    for (n, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n


def test_an_expert_stack_steps_per_expert_matrix() -> None:
    """The 3-D expert weight's update: each expert's matrix gets the 2-D Muon update of its own gradient."""
    ours = Toy()
    opt = _muon(ours)
    experts = [nn.Parameter(m.detach().clone()) for m in ours.layers[0].experts.unbind(0)]
    per = torch.optim.Muon(experts, lr=LR, weight_decay=WD, momentum=MOM, adjust_lr_fn=ADJUST_LR)
    for s in range(3):
        opt.zero_grad(set_to_none=True)
        ours.loss(s).backward()
        grads = ours.layers[0].experts.grad.unbind(0)
        for p, g in zip(experts, grads):
            p.grad = g.clone()
        opt.step()
        per.step()
    assert torch.equal(ours.layers[0].experts.detach(), torch.stack([p.detach() for p in experts]))


def test_the_orthogonalised_update_shape_on_2d_and_3d() -> None:
    g = torch.Generator().manual_seed(1)
    m2, m3 = torch.randn(12, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    o2, o3 = orthogonalised(m2), orthogonalised(m3)
    assert o2.shape == m2.shape and o3.shape == m3.shape
    for o in (o2, *o3.unbind(0)):  # Newton–Schulz: singular values pushed into ~[0.5, 1.5] (torch's docstring)
        sv = torch.linalg.svdvals(o.float())
        assert float(sv.min()) > 0.3 and float(sv.max()) < 1.6


def test_checkpoint_round_trip_continues_bit_identically() -> None:
    a = Toy()
    opt_a = _muon(a)
    _train(a, opt_a, range(2))
    saved_params = {n: p.detach().clone() for n, p in a.named_parameters()}
    saved = {k: v.clone() for k, v in optimizer_tensors(opt_a, a).items()}  # as written to disk
    assert "layers.0.experts/momentum_buffer" in saved and "lm_head.weight/exp_avg" in saved
    _train(a, opt_a, range(2, 4))
    b = Toy()
    with torch.no_grad():
        for n, p in b.named_parameters():
            p.copy_(saved_params[n])
    opt_b = _muon(b)
    load_optimizer_tensors(opt_b, b, saved)
    _train(b, opt_b, range(2, 4))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    sd = opt_b.state_dict()  # torch's own format also round-trips (the halves stay linked)
    opt_c = _muon(Toy())
    opt_c.load_state_dict(sd)
    assert opt_c.adamw is not None and opt_c.adamw.state is opt_c.state
    assert {id(g) for g in opt_c.adamw.param_groups} <= {id(g) for g in opt_c.param_groups}


def test_lr_set_on_param_groups_reaches_both_halves() -> None:
    opt = _muon(Toy())
    for group in opt.param_groups:
        group["lr"] = 1e-4
    assert opt.adamw is not None and all(g["lr"] == 1e-4 for g in opt.adamw.param_groups)


@pytest.mark.parametrize("overrides,match", [
    ({"optimizer": "sgd"}, "train.optimizer"),
    ({"optimizer": "muon", "muon_momentum": 1.0}, "train.muon_momentum"),
])
def test_bad_optimizer_settings_are_one_line(overrides: dict, match: str) -> None:
    cfg = Config()
    for k, v in overrides.items():
        setattr(cfg.train, k, v)
    with pytest.raises(ConfigError, match=match) as e:
        validate(cfg)
    assert "\n" not in str(e.value)


def test_muon_takes_sharded_clusters() -> None:
    cfg = Config()
    cfg.train.optimizer, cfg.cluster.ranks = "muon", 2
    validate(cfg)  # FSDP2 shards: the 2-D updates are gathered whole (test below)


def _sharded_steps(rank: int, world: int) -> dict[str, float]:
    """Two Muon steps of the tiny MoE model, unsharded and sharded by FSDP2 over `world` gloo ranks, on the same
    batch on every rank; per parameter the largest difference of the sharded one (gathered) from the unsharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from edit_train.cli.common import compose
    from edit_train.cluster.mesh import fsdp_units
    from edit_train.model import CausalLM

    cfg = compose(["logger=none", "model=tiny"])
    torch.manual_seed(0)
    ref = CausalLM(cfg.model)
    torch.manual_seed(0)
    model = CausalLM(cfg.model)
    mesh = init_device_mesh("cpu", (world,))
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    t = TrainConfig(lr=LR, weight_decay=WD, optimizer="muon", muon_momentum=MOM)
    opts = [build_optimizer(m.named_parameters(), t, torch.device("cpu")) for m in (ref, model)]
    x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for m, opt in zip((ref, model), opts):
            opt.zero_grad(set_to_none=True)
            m(x, x).loss.backward()
            opt.step()
    out = {}
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        whole = q.full_tensor() if hasattr(q, "full_tensor") else q
        out[name] = float((p.detach() - whole.detach()).abs().max())
        out[name + "#sharded"] = float(hasattr(q, "placements") and q.to_local().shape != q.shape)
        out[name + "#muon"] = float(uses_muon(name, p))
    return out


def test_a_sharded_cluster_steps_as_one_rank() -> None:
    """FSDP2 over 2 ranks: every 2-D matrix's update gathered whole and orthogonalised, each rank keeping its
    rows; the expert stacks per local expert. The parameters after two steps are the unsharded run's (fp32 sums
    of the same numbers in another order aside). Orthogonalising only a rank's own rows would be far off."""
    from mp_utils import run_ranks

    res = run_ranks(_sharded_steps, 2)
    assert res[0] == res[1]
    names = [k for k in res[0] if "#" not in k]
    muon_sharded = [n for n in names if res[0][n + "#muon"] and res[0][n + "#sharded"]]
    assert len(muon_sharded) >= 10  # attention, router and expert matrices, sharded by rows
    assert any(n.endswith("experts.gate_proj") for n in muon_sharded)
    worst = max(names, key=lambda n: res[0][n])
    assert res[0][worst] <= 1e-5, (worst, res[0][worst])


def test_muon_with_sparse_top_k_gets_a_line_saying_what_it_measured() -> None:
    from edit_train.cli.common import compose
    from edit_train.train.build import pairing_warning

    line = pairing_warning(compose(["train.optimizer=muon", "sync.compression=topk"]))
    assert line is not None and "1.20-1.29" in line and "docs/compression.md" in line
    assert pairing_warning(compose(["train.optimizer=muon", "sync.compression=int8"])) is None
    assert pairing_warning(compose(["sync.compression=topk"])) is None
