"""MoE block: our sorted dropless dispatch vs the per-expert boolean-mask dispatch of the public BailingMoe
training path, forward + backward, same weights and inputs.

The reference (``MaskedMoE``) routes exactly like ``BailingMoeSparseMoeBlock`` in training mode::

    x = x.repeat_interleave(k, dim=0)
    for i in range(E):
        y[flat_idx == i] = expert_i(x[flat_idx == i])
    y = (y.view(N, k, H) * w.unsqueeze(-1)).sum(1)

with its experts held as one ``nn.Linear`` triple per expert (as in the public model), whose weights are
copied from our stacked parameters. Router (fp32 gate + softmax + top-k) and shared experts are the same
code in both, so only the dispatch differs.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` minus the memory allocated before the step. On CPU
the peak of live bytes held by torch's CPU allocator during one forward+backward, reconstructed from the
torch profiler's ``[memory]`` allocation/free events (``profile_memory=True``) — allocator-level, not RSS.

    python benchmarks/moe_block.py [--quick] [--out FILE.json] [--device cpu|cuda] [--batch 8 --seq 256]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from edit_train.model.config import ModelConfig
from edit_train.model.moe import DenseMLP, MoEBlock
from edit_train.model.presets import load_preset

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "moe_block.json"


class MaskedMoE(nn.Module):
    """Reference MoE block: per-expert ``nn.Linear`` experts and one boolean mask per expert."""

    def __init__(self, ours: MoEBlock) -> None:
        super().__init__()
        self.ours = ours  # router + shared experts are shared with our block
        e, i, h = ours.experts.gate_proj.shape
        self.experts = nn.ModuleList(DenseMLP(h, i) for _ in range(e))
        with torch.no_grad():
            for idx, ex in enumerate(self.experts):
                ex.gate_proj.weight.copy_(ours.experts.gate_proj[idx])
                ex.up_proj.weight.copy_(ours.experts.up_proj[idx])
                ex.down_proj.weight.copy_(ours.experts.down_proj[idx])
        self.to(ours.experts.gate_proj.device)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, _, topk_idx, topk_weight = self.ours.route(x)
        k = topk_idx.shape[-1]
        xr = x.repeat_interleave(k, dim=0)
        flat_idx = topk_idx.reshape(-1)
        y = torch.empty_like(xr)
        for i, expert in enumerate(self.experts):
            y[flat_idx == i] = expert(xr[flat_idx == i]).to(y.dtype)
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if self.ours.shared_experts is not None:
            y = y + self.ours.shared_experts(x)
        return y.reshape(shape)

    def stacked_grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(torch.stack([getattr(ex, n).weight.grad for ex in self.experts])
                     for n in ("gate_proj", "up_proj", "down_proj"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fwd_bwd(block: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    block.zero_grad(set_to_none=True)
    x.grad = None
    y = block(x)
    y.backward(dy)
    return y


def time_pair(a: nn.Module, b: nn.Module, x: torch.Tensor, dy: torch.Tensor, iters: int, warmup: int
              ) -> tuple[list[float], list[float]]:
    """Per-iteration fwd+bwd seconds of ``a`` and ``b``, interleaved (a, b, b, a, ...) so that both see the
    same machine conditions (shared CPUs are noisy)."""
    device = x.device
    for _ in range(warmup):
        fwd_bwd(a, x, dy)
        fwd_bwd(b, x, dy)
    times: dict[int, list[float]] = {0: [], 1: []}
    for it in range(iters):
        pair = ((0, a), (1, b)) if it % 2 == 0 else ((1, b), (0, a))
        for key, block in pair:
            _sync(device)
            t0 = time.perf_counter()
            fwd_bwd(block, x, dy)
            _sync(device)
            times[key].append(time.perf_counter() - t0)
    return times[0], times[1]


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
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    block.zero_grad(set_to_none=True)
    x.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fwd_bwd(block, x, dy)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = sorted((e["ts"], e["args"]["Bytes"]) for e in trace.get("traceEvents", [])
                    if e.get("name") == "[memory]" and "Bytes" in e.get("args", {}))
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, "cpu allocator peak live bytes above baseline during fwd+bwd (torch profiler [memory] events)"


def bench_config(name: str, cfg: ModelConfig, device: torch.device, batch: int, seq: int,
                 iters: int, warmup: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    cfg.router_aux_loss_coef = 0.0
    cfg.router_z_loss_coef = 0.0
    ours = MoEBlock(cfg).to(device)
    ours.reset_parameters(cfg.initializer_range)
    ours.train()
    ref = MaskedMoE(ours)
    x = torch.randn(batch, seq, cfg.hidden_size, device=device, requires_grad=True)
    dy = torch.randn(batch, seq, cfg.hidden_size, device=device)

    # correctness on the same weights / inputs
    y_ours = fwd_bwd(ours, x, dy).detach()
    gx_ours = x.grad.clone()
    g_ours = [p.grad.clone() for p in (ours.experts.gate_proj, ours.experts.up_proj, ours.experts.down_proj)]
    y_ref = fwd_bwd(ref, x, dy).detach()
    gx_ref = x.grad.clone()
    g_ref = ref.stacked_grads()
    max_diff = {
        "output": (y_ours - y_ref).abs().max().item(),
        "grad_input": (gx_ours - gx_ref).abs().max().item(),
        "grad_experts": max((a - b).abs().max().item() for a, b in zip(g_ours, g_ref)),
    }
    agree = all(v < 1e-4 for v in max_diff.values())

    t_ours, t_ref = time_pair(ours, ref, x, dy, iters, warmup)
    m_ours, mem_method = peak_memory(ours, x, dy)
    m_ref, _ = peak_memory(ref, x, dy)
    med_ours, med_ref = statistics.median(t_ours), statistics.median(t_ref)
    return {
        "config": name, "tokens": batch * seq, "batch": batch, "seq": seq,
        "hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_shared_experts": cfg.num_shared_experts,
        "iters": iters,
        "ours_median_ms": med_ours * 1e3, "reference_median_ms": med_ref * 1e3,
        "ours_min_ms": min(t_ours) * 1e3, "reference_min_ms": min(t_ref) * 1e3,
        "speedup": med_ref / med_ours,
        "speedup_median_of_pairs": statistics.median(r / o for o, r in zip(t_ours, t_ref)),
        "ours_peak_mem_mb": m_ours / 2**20, "reference_peak_mem_mb": m_ref / 2**20,
        "mem_method": mem_method,
        "outputs_agree": agree, "max_abs_diff": max_diff,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a few seconds)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"])
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    iters = args.iters or (5 if args.quick else 20)
    warmup = 2 if args.quick else 3
    rows = [bench_config(n, load_preset(n), device, args.batch, args.seq, iters, warmup) for n in args.configs]

    hdr = f"{'config':<8}{'tokens':>8}{'E':>4}{'k':>3}{'ours ms':>10}{'ref ms':>10}{'speedup':>9}" \
          f"{'ours MB':>10}{'ref MB':>10}  agree"
    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['config']:<8}{r['tokens']:>8}{r['num_experts']:>4}{r['top_k']:>3}"
              f"{r['ours_median_ms']:>10.2f}{r['reference_median_ms']:>10.2f}{r['speedup']:>8.2f}x"
              f"{r['ours_peak_mem_mb']:>10.1f}{r['reference_peak_mem_mb']:>10.1f}  {r['outputs_agree']}")
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
