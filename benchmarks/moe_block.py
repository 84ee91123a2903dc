"""MoE block: our sorted dropless dispatch vs the per-expert boolean-mask dispatch of the public BailingMoe
training path, forward + backward, same weights and inputs.

The reference (``MaskedMoE``) routes exactly like ``BailingMoeSparseMoeBlock`` in training mode::

    x = x.repeat_interleave(k, dim=0)
    for i in range(E):
        y[flat_idx == i] = expert_i(x[flat_idx == i])
    y = (y.view(N, k, H) * w.unsqueeze(-1)).sum(1)

with its experts held as one ``nn.Linear`` triple per expert (as in the public model), whose weights are
copied from our stacked parameters ("reference"); a second variant indexes our stacked parameters directly
("reference_stacked"). Router (fp32 gate + softmax + top-k) and shared experts are the same code in all of
them, so only the dispatch differs; the ``/routed`` rows drop the shared experts to isolate the dispatch.
Outputs and gradients (input and expert weights) are checked to agree before timing. Runs are interleaved
(rotating order) so that all variants see the same machine load; medians and minima are reported.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` minus the memory allocated before the step. On CPU
the peak of live bytes held by torch's CPU allocator during one forward+backward, reconstructed from the
torch profiler's ``[memory]`` allocation/free events (``profile_memory=True``) — allocator-level, not RSS.

    python benchmarks/moe_block.py [--quick] [--out FILE.json] [--device cpu|cuda] [--batch 8 --seq 256]
                                   [--configs tiny small] [--iters N] [--threads T] [--no-routed-only]
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import _common as C
from _memory import CPU_PEAK_METHOD, cpu_peak_bytes
from edit_train.model.config import ModelConfig
from edit_train.model.moe import DenseMLP, MoEBlock
from edit_train.model.presets import load_preset



class MaskedMoE(nn.Module):
    """Reference MoE block: one boolean mask per expert, as in the public BailingMoe training path.

    ``stacked=False`` (the default reference): the experts are an ``nn.ModuleList`` of per-expert
    ``nn.Linear`` triples, as in the public model, holding copies of our stacked weights.
    ``stacked=True``: the experts read our stacked parameters directly (``F.linear(x, gate_proj[i])``); the
    per-expert parameter indexing then adds a full-size gradient buffer per expert in backward.
    """

    def __init__(self, ours: MoEBlock, stacked: bool = False) -> None:
        super().__init__()
        self.ours = ours  # router + shared experts are shared with our block
        self.stacked = stacked
        e, i, h = ours.experts.gate_proj.shape
        self.experts = nn.ModuleList()
        if not stacked:
            self.experts.extend(DenseMLP(h, i) for _ in range(e))
            with torch.no_grad():
                for idx, ex in enumerate(self.experts):
                    ex.gate_proj.weight.copy_(ours.experts.gate_proj[idx])
                    ex.up_proj.weight.copy_(ours.experts.up_proj[idx])
                    ex.down_proj.weight.copy_(ours.experts.down_proj[idx])
            self.to(ours.experts.gate_proj.device)

    def expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if not self.stacked:
            return self.experts[i](x)
        ex = self.ours.experts
        return F.linear(F.silu(F.linear(x, ex.gate_proj[i])) * F.linear(x, ex.up_proj[i]), ex.down_proj[i])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, _, topk_idx, topk_weight = self.ours.route(x)
        k = topk_idx.shape[-1]
        xr = x.repeat_interleave(k, dim=0)
        flat_idx = topk_idx.reshape(-1)
        y = torch.empty_like(xr)
        for i in range(self.ours.num_experts):
            y[flat_idx == i] = self.expert(i, xr[flat_idx == i]).to(y.dtype)
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if self.ours.shared_experts is not None:
            y = y + self.ours.shared_experts(x)
        return y.reshape(shape)

    def expert_grads(self) -> tuple[torch.Tensor, ...]:
        names = ("gate_proj", "up_proj", "down_proj")
        if self.stacked:
            return tuple(getattr(self.ours.experts, n).grad for n in names)
        return tuple(torch.stack([getattr(ex, n).weight.grad for ex in self.experts]) for n in names)


class MatmulFloor(nn.Module):
    """Only the routed experts' matmuls of one fwd+bwd (3 forward + 6 backward per expert, same per-expert
    token counts as the real routing), nothing else: a lower bound for any dispatch of these experts."""

    def __init__(self, ours: MoEBlock, counts: list[int]) -> None:
        super().__init__()
        e, i, h = ours.experts.gate_proj.shape
        dev = ours.experts.gate_proj.device
        self.wg = ours.experts.gate_proj.detach()
        self.wd = ours.experts.down_proj.detach()
        self.bufs = [(torch.randn(c, h, device=dev), torch.randn(c, i, device=dev)) for c in counts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for e, (xe, ge) in enumerate(self.bufs):
                if xe.shape[0] == 0:
                    continue
                torch.mm(xe, self.wg[e].t()), torch.mm(xe, self.wg[e].t()), torch.mm(ge, self.wd[e].t())
                torch.mm(xe, self.wd[e]), torch.mm(xe.t(), ge)  # d(down): dh, dW_down
                torch.mm(ge.t(), xe), torch.mm(ge.t(), xe)  # dW_gate, dW_up
                torch.mm(ge, self.wg[e]), torch.mm(ge, self.wg[e])  # dx
        return x * 1.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fwd_bwd(block: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    block.zero_grad(set_to_none=True)
    x.grad = None
    y = block(x)
    y.backward(dy)
    return y


def time_blocks(blocks: list[nn.Module], x: torch.Tensor, dy: torch.Tensor, iters: int, warmup: int
                ) -> list[list[float]]:
    """Per-iteration fwd+bwd seconds of each block, interleaved with a rotating order so that all of them
    see the same machine conditions (shared CPUs are noisy)."""
    device = x.device
    for _ in range(warmup):
        for block in blocks:
            fwd_bwd(block, x, dy)
    times: list[list[float]] = [[] for _ in blocks]
    for it in range(iters):
        for j in range(len(blocks)):
            key = (it + j) % len(blocks)
            _sync(device)
            t0 = time.perf_counter()
            fwd_bwd(blocks[key], x, dy)
            _sync(device)
            times[key].append(time.perf_counter() - t0)
    return times


def peak_memory(block: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[int, str]:
    device = x.device
    if device.type == "cuda":
        fwd_bwd(block, x, dy)
        block.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fwd_bwd(block, x, dy)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, "cuda max_memory_allocated - baseline"
    block.zero_grad(set_to_none=True)
    x.grad = None
    return cpu_peak_bytes(lambda: fwd_bwd(block, x, dy)), CPU_PEAK_METHOD + " during fwd+bwd"


def bench_config(name: str, cfg: ModelConfig, device: torch.device, batch: int, seq: int,
                 iters: int, warmup: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    cfg.router_aux_loss_coef = 0.0
    cfg.router_z_loss_coef = 0.0
    ours = MoEBlock(cfg).to(device)
    ours.reset_parameters(cfg.initializer_range)
    ours.train()
    refs = {"reference": MaskedMoE(ours), "reference_stacked": MaskedMoE(ours, stacked=True)}
    x = torch.randn(batch, seq, cfg.hidden_size, device=device, requires_grad=True)
    dy = torch.randn(batch, seq, cfg.hidden_size, device=device)

    # correctness on the same weights / inputs
    names = ("gate_proj", "up_proj", "down_proj")
    y_ours = fwd_bwd(ours, x, dy).detach()
    gx_ours = x.grad.clone()
    g_ours = [getattr(ours.experts, n).grad.clone() for n in names]
    max_diff: dict[str, float] = {}
    for ref in refs.values():
        y_ref = fwd_bwd(ref, x, dy).detach()
        diffs = {
            "output": (y_ours - y_ref).abs().max().item(),
            "grad_input": (gx_ours - x.grad).abs().max().item(),
            "grad_experts": max((a - b).abs().max().item() for a, b in zip(g_ours, ref.expert_grads())),
        }
        for key, val in diffs.items():
            max_diff[key] = max(max_diff.get(key, 0.0), val)
    agree = all(v < 1e-4 for v in max_diff.values())

    floor = MatmulFloor(ours, ours.last_expert_load.tolist())
    t_ours, t_floor, *t_refs = time_blocks([ours, floor, *refs.values()], x, dy, iters, warmup)
    row = {
        "config": name, "tokens": batch * seq, "batch": batch, "seq": seq,
        "hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_shared_experts": cfg.num_shared_experts,
        "iters": iters,
        "ours_median_ms": statistics.median(t_ours) * 1e3, "ours_min_ms": min(t_ours) * 1e3,
        "routed_matmul_floor_median_ms": statistics.median(t_floor) * 1e3,
        "routed_matmul_floor_min_ms": min(t_floor) * 1e3,
    }
    m_ours, mem_method = peak_memory(ours, x, dy)
    row["ours_peak_mem_mb"] = m_ours / 2**20
    for ref_name, t_ref in zip(refs, t_refs):
        row[f"{ref_name}_median_ms"] = statistics.median(t_ref) * 1e3
        row[f"{ref_name}_min_ms"] = min(t_ref) * 1e3
        row[f"{ref_name}_speedup"] = statistics.median(t_ref) / statistics.median(t_ours)
        row[f"{ref_name}_speedup_median_of_pairs"] = statistics.median(r / o for o, r in zip(t_ours, t_ref))
        row[f"{ref_name}_speedup_min"] = min(t_ref) / min(t_ours)
        row[f"{ref_name}_peak_mem_mb"] = peak_memory(refs[ref_name], x, dy)[0] / 2**20
    row["speedup"] = row["reference_speedup"]
    row.update(mem_method=mem_method, outputs_agree=agree, max_abs_diff=max_diff)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = C.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a few seconds)")
    ap.add_argument("--out", type=Path, default=C.RESULTS_DIR / "moe_block.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"])
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--no-routed-only", action="store_true",
                    help="skip the extra rows that time the blocks without their shared experts")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = C.parse(ap, argv)
    if args.smoke:  # the tiny block, a few tokens, one timed iteration
        args.quick, args.configs, args.batch, args.seq, args.iters = True, ["tiny"], 1, 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    iters = args.iters or (5 if args.quick else 20)
    warmup = 2 if args.quick else 3
    rows = []
    for n in args.configs:
        cfg = load_preset(n)
        rows.append(bench_config(n, cfg, device, args.batch, args.seq, iters, warmup))
        if cfg.num_shared_experts and not args.no_routed_only:  # isolate the dispatch: no shared experts
            cfg = dataclasses.replace(cfg, num_shared_experts=0)
            rows.append(bench_config(f"{n}/routed", cfg, device, args.batch, args.seq, iters, warmup))

    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} iters={iters}")
    hdr = (f"{'config':<13}{'tokens':>7}{'E':>4}{'k':>3}{'ours ms':>9}{'ref ms':>9}{'speedup':>9}"
           f"{'min-spd':>9}{'refS ms':>9}{'speedupS':>9}{'ours MB':>9}{'ref MB':>8}{'refS MB':>8}{'mm-floor':>9}  agree")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['config']:<13}{r['tokens']:>7}{r['num_experts']:>4}{r['top_k']:>3}"
              f"{r['ours_median_ms']:>9.2f}{r['reference_median_ms']:>9.2f}{r['reference_speedup']:>8.2f}x"
              f"{r['reference_speedup_min']:>8.2f}x"
              f"{r['reference_stacked_median_ms']:>9.2f}{r['reference_stacked_speedup']:>8.2f}x"
              f"{r['ours_peak_mem_mb']:>9.1f}{r['reference_peak_mem_mb']:>8.1f}"
              f"{r['reference_stacked_peak_mem_mb']:>8.1f}{r['routed_matmul_floor_median_ms']:>9.2f}"
              f"  {r['outputs_agree']}")
    print("ms = median fwd+bwd wall time (interleaved runs); speedup = median ratio, min-spd = ratio of minima; "
          "ref = per-expert nn.Linear experts (public BailingMoe layout), refS = reference indexing our "
          "stacked params; '/routed' rows: same block without its shared experts (dispatch only); mm-floor = median ms of just the routed experts' matmuls (a lower bound)")
    print(f"memory: {rows[0]['mem_method']}")
    result = {
        "benchmark": "moe_block",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "quick": args.quick,
        "target_speedup": 1.5,
        "results": rows,
    }
    print(f"wrote {C.write_json(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
