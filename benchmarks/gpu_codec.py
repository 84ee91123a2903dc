"""The pseudo-gradient codec on one GPU: encode (with the sender's own tensor) and one decode for int8, element
top-k and grouped top-k, best of 20 with CUDA synchronisation, on two unit sizes of the tiny/small models; checks
that the GPU payload equals the CPU one byte for byte and that decode(payload) equals the sender's own tensor.

    python benchmarks/gpu_codec.py        # needs CUDA; writes $OUT/gpu_codec.json (OUT defaults to benchmarks/results)
"""
import json, os, time, torch
from edit_train.codec.dense import CompressionConfig, quantize_own, dequantize
if not torch.cuda.is_available():
    raise SystemExit("gpu_codec: no CUDA device here; run it on a GPU machine")
dev = torch.device("cuda"); out = []
for name, (d, b, g) in {"int8": (0, 0, 0), "topk 15%/4b": (0.15, 4, 1), "topk 25%/2b/g8": (0.25, 2, 8)}.items():
    cfg = CompressionConfig("int8", 256, "bf16", True) if name == "int8" else \
        CompressionConfig("topk", 256, "bf16", True, d, b, topk_group=g)
    for n in (492800, 3543552):
        x = torch.randn(n, device=dev) * 1e-3
        p, own = quantize_own(x, cfg)
        assert p.device.type == "cuda" and torch.equal(dequantize(p, n, cfg), own), name
        cpu = quantize_own(x.cpu(), cfg)
        same = torch.equal(cpu[0], p.cpu())
        best = {}
        for what, fn in (("encode_us", lambda: quantize_own(x, cfg)), ("decode_us", lambda: dequantize(p, n, cfg))):
            ts = []
            for _ in range(20):
                torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
            best[what] = 1e6 * min(ts)
        out.append({"scheme": name, "numel": n, **best, "bytes": p.numel(), "payload_equals_cpu": same})
        print(out[-1])
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": out}, open(os.environ.get("OUT", "benchmarks/results") + "/gpu_codec.json", "w"), indent=1)
