"""The LM head's loss at Ling's 126k vocabulary: peak memory of forward + backward, plain vs the fused chunked
loss (`model.loss_chunk`, edit_train/model/lm_loss.py), measured on the CPU.

Plain is what `CausalLM` runs with `model.loss_chunk=0`: `F.cross_entropy(F.linear(h, W).float(), labels)`,
which holds the `[tokens, vocab]` logits, their fp32 copy, the log-softmax and its gradient. The fused loss goes
through `chunk` tokens at a time. Peak = the CPU allocator's peak of live bytes above the baseline (inputs and
weight excluded) during one forward + backward (benchmarks/_memory.py: torch profiler `[memory]` events, no
timing, deterministic). Each row also has `predicted_bytes`, the term edit_train/memplan.py plans for the head
(fp32: c = 4) and the wall time of the step (informational: a shared box; `loadavg` is recorded).

    python benchmarks/lm_loss_memory.py [--quick] [--tokens 1024] [--vocab 126464] [--hidden 256]
                                        [--chunks 1024 512 256 128 64] [--out results/lm_loss_memory.json]
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

import _common as C
from _memory import CPU_PEAK_METHOD, cpu_peak_bytes
from edit_train.model.lm_loss import linear_cross_entropy


def head_loss(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """The loss as `CausalLM` computes it: plain for chunk 0, else the fused chunked loss."""
    if chunk == 0:
        return F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=-100)
    return linear_cross_entropy(h, w, labels, chunk)


def predicted_bytes(tokens: int, vocab: int, hidden: int, chunk: int) -> int:
    """memplan's head term beyond the hidden states, in fp32: plain 4 V + 8 V per token (logits, fp32 logits,
    their gradient); fused 4 H per token (the input's gradient) + 4 V H (the weight's) + min(chunk, tokens) 4 V
    (one chunk's logits, which in fp32 are also its buffer and its gradient)."""
    if chunk == 0:
        return tokens * 12 * vocab
    return tokens * 4 * hidden + 4 * vocab * hidden + min(chunk, tokens) * vocab * 4


def measure(tokens: int, vocab: int, hidden: int, chunk: int, iters: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g) / hidden ** 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)

    def step() -> float:
        h.grad = w.grad = None
        loss = head_loss(h, w, labels, chunk)
        loss.backward()
        return float(loss.detach())

    loss = step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    h.grad = w.grad = None
    peak = cpu_peak_bytes(step)
    return {"chunk": chunk, "variant": "plain" if chunk == 0 else "fused", "loss": loss, "peak_bytes": peak,
            "peak_mib": peak / 2 ** 20, "predicted_bytes": predicted_bytes(tokens, vocab, hidden, chunk),
            "step_s_median": statistics.median(times)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = C.parser(__doc__, out="lm_loss_memory.json")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=126464)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 512, 256, 128, 64])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="256 tokens, a 32k vocabulary, one timed iteration")
    args = C.parse(ap, argv)
    if args.quick:
        args.tokens, args.vocab, args.iters = 256, 32768, 1
        args.chunks = [c for c in args.chunks if c <= 256] or [64]
    if args.smoke:
        args.tokens, args.vocab, args.hidden, args.iters, args.chunks = 64, 1024, 32, 1, [32]
    torch.set_num_threads(args.threads)
    rows = [measure(args.tokens, args.vocab, args.hidden, c, args.iters) for c in [0, *args.chunks]]
    plain = rows[0]
    print(f"tokens={args.tokens} vocab={args.vocab} hidden={args.hidden} fp32, threads={args.threads}")
    print(f"{'variant':<8}{'chunk':>7}{'peak MiB':>11}{'x plain':>9}{'plan MiB':>10}{'step s':>9}{'loss':>12}")
    for r in rows:
        r["loss_abs_diff_vs_plain"] = abs(r["loss"] - plain["loss"])
        print(f"{r['variant']:<8}{r['chunk']:>7}{r['peak_mib']:>11.1f}{r['peak_bytes'] / plain['peak_bytes']:>9.3f}"
              f"{r['predicted_bytes'] / 2 ** 20:>10.1f}{r['step_s_median']:>9.3f}{r['loss']:>12.6f}")
    result = {"benchmark": "lm_loss_memory", "device": "cpu", "cpu": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(), "threads": args.threads,
              "torch": torch.__version__, "dtype": "float32", "tokens": args.tokens, "vocab": args.vocab,
              "hidden": args.hidden, "quick": args.quick, "memory_method": CPU_PEAK_METHOD, "rows": rows}
    print(f"wrote {C.write_json(args.out, result)}")
    return result


if __name__ == "__main__":
    main()
