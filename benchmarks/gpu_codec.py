"""The pseudo-gradient codec on one GPU: encode (with the sender's own tensor) and one decode for int8, element
top-k and grouped top-k, best of 20 with CUDA synchronisation, on two unit sizes of the tiny/small models; checks
that the GPU payload equals the CPU one byte for byte and that decode(payload) equals the sender's own tensor.

    python -m benchmarks gpu_codec            # needs CUDA; writes $OUT/gpu_codec.json (OUT: benchmarks/results)
    python -m benchmarks gpu_codec --quick    # without a GPU: the same rows on the CPU, small units, 2 repeats
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from edit_train.codec.dense import CompressionConfig, dequantize, quantize_own

SCHEMES = {"int8": (0, 0, 0), "topk 15%/4b": (0.15, 4, 1), "topk 25%/2b/g8": (0.25, 2, 8)}


def rows(dev: torch.device, sizes: tuple[int, ...], repeats: int) -> list[dict[str, object]]:
    def wait() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    out: list[dict[str, object]] = []
    for name, (d, b, g) in SCHEMES.items():
        cfg = CompressionConfig("int8", 256, "bf16", True) if name == "int8" else \
            CompressionConfig("topk", 256, "bf16", True, d, b, topk_group=g)
        for n in sizes:
            x = torch.randn(n, device=dev) * 1e-3
            p, own = quantize_own(x, cfg)
            assert p.device.type == dev.type and torch.equal(dequantize(p, n, cfg), own), name
            same = torch.equal(quantize_own(x.cpu(), cfg)[0], p.cpu())
            best = {}
            for what, fn in (("encode_us", lambda: quantize_own(x, cfg)), ("decode_us", lambda: dequantize(p, n, cfg))):
                times = []
                for _ in range(repeats):
                    wait()
                    t0 = time.perf_counter()
                    fn()
                    wait()
                    times.append(time.perf_counter() - t0)
                best[what] = 1e6 * min(times)
            out.append({"scheme": name, "numel": n, **best, "bytes": p.numel(), "payload_equals_cpu": same})
            print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="without a GPU: the CPU, small units (a smoke run)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")) / "gpu_codec.json")
    args = C.parse(ap, argv)
    args.quick = args.quick or args.smoke
    if not torch.cuda.is_available() and not args.quick:
        print("gpu_codec: no CUDA device here; run it on a GPU machine (or --quick for a CPU smoke run)",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda") if torch.cuda.is_available() and not args.quick else torch.device("cpu")
    found = rows(dev, (4096,) if args.quick else (492800, 3543552), 2 if args.quick else 20)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    C.write_json(args.out, {"device": name, "torch": torch.__version__, "rows": found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
