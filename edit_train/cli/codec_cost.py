"""The codec's cost on this host, for `edit-train plan calibrate`: the real encoder and decoder of each
compression (`codec/dense.py`, top-k through `codec/sparse.py`'s fused CPU codec where numba is
installed) timed on one thread at two tensor sizes; a line through the two medians gives seconds per call and
per value. The planner (numpy only) cannot run torch, so this lives beside the CLI and hands it plain numbers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

from edit_train.plan.traffic import Codec

SIZES = (1 << 16, 1 << 19)  # values: both take the kernels a model's big units take (sparse_fused.SPECIALIZE_MIN)
REPS = 5


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def round_trips(x, cfg, reps: int) -> tuple[list[float], list[float], int]:  # noqa: ANN001 - torch, compress
    """Seconds of `reps` encodes (`quantize_own`) and decodes (`dequantize`) of flat `x` under `cfg`, and the
    payload's bytes."""
    from edit_train.codec.dense import dequantize, quantize_own

    enc, dec, n = [], [], x.numel()
    for _ in range(reps):
        t0 = time.perf_counter()
        payload, _ = quantize_own(x, cfg)
        t1 = time.perf_counter()
        dequantize(payload, n, cfg)
        dec.append(time.perf_counter() - t1)
        enc.append(t1 - t0)
    return enc, dec, int(payload.numel())


def time_codec(codec: Codec, sizes: tuple[int, int] = SIZES, reps: int = REPS) -> dict[str, list[float]]:
    """{"encode": [s per call, s per value], "decode": [...]} of `codec` on one thread."""
    import torch

    from edit_train.codec import sparse
    from edit_train.codec.dense import CompressionConfig

    cfg = CompressionConfig(codec.scheme, codec.block_size, codec.scale_dtype, True, codec.density, codec.bits,
                            codec.unsent, codec.group)
    cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if cfg.sparse:
            sparse.warm(cfg.format)  # compiles the format's kernels once (numba caches them on disk)
        points = []
        for n in sizes:
            x = torch.randn(n, generator=torch.Generator().manual_seed(n))
            round_trips(x, cfg, 1)  # first use
            enc, dec, _ = round_trips(x, cfg, reps)
            points.append((n, _median(enc), _median(dec)))
    finally:
        torch.set_num_threads(threads)
    (n0, e0, d0), (n1, e1, d1) = points
    out = {}
    for key, a, b in (("encode", e0, e1), ("decode", d0, d1)):
        per_value = max((b - a) / (n1 - n0), 0.0)
        out[key] = [max(a - per_value * n0, 0.0), per_value]
    return out


def time_codecs(codecs: Iterable[Codec], say: Callable[[str], None] | None = None) -> dict[str, dict[str, list[float]]]:
    """`time_codec` for every lossy codec (by label); fp8 only where this torch build has float8. `say`: told
    which codec is being timed, before each (a few seconds apiece)."""
    from edit_train.codec.dense import fp8_supported

    todo: dict[str, Codec] = {}
    for c in codecs:
        if c.lossy and c.label not in todo and not (c.scheme == "fp8" and not fp8_supported()):
            todo[c.label] = c
    out: dict[str, dict[str, list[float]]] = {}
    for i, (label, c) in enumerate(todo.items(), start=1):
        if say is not None:
            say(f"timing the {label} codec ({i} of {len(todo)})")
        out[label] = time_codec(c)
    return out


_COMPILE = """
import sys, time, torch
from edit_train.codec import sparse, sparse_fused
from edit_train.codec.sparse_format import SparseFormat
torch.set_num_threads(1)
f = SparseFormat.of(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
n = sparse_fused.SPECIALIZE_MIN
sparse.decode(sparse.encode_own(torch.zeros(1), f)[0], 1, f)  # the generic kernels: not what a new format costs
t0 = time.process_time()
sparse.decode(sparse.encode_own(torch.zeros(n), f)[0], n, f)
print(time.process_time() - t0)
"""


def compile_seconds(codec: Codec, timeout_s: float = 600.0, say: Callable[[str], None] | None = None,
                    every_s: float = 15.0) -> float:
    """CPU seconds one process spends compiling a top-k format's kernels it has never compiled (numba's cache
    pointed at an empty directory in a child process, so nothing of this host's cache is used or touched);
    0.0 where the fused codec does not run (no numba). `say`: told when it starts and every `every_s` seconds
    while the child compiles (tens of seconds)."""
    from edit_train.codec import compiled

    if not codec.sparse or not compiled.available():
        return 0.0
    with tempfile.TemporaryDirectory(prefix="edit-train-compile-") as tmp:
        env = {**os.environ, "NUMBA_CACHE_DIR": tmp, "OMP_NUM_THREADS": "1"}
        args = [str(codec.block_size), str(codec.density), str(codec.bits), codec.scale_dtype, str(codec.group)]
        if say is not None:
            say(f"timing how long a new top-k format ({codec.label}) takes to compile, in a child process")
        t0 = time.monotonic()
        with subprocess.Popen([sys.executable, "-c", _COMPILE, *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) as proc:
            while True:
                left = timeout_s - (time.monotonic() - t0)
                try:
                    stdout, stderr = proc.communicate(timeout=max(min(every_s, left), 0.01))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - t0 >= timeout_s:
                        proc.kill()
                        proc.communicate()
                        raise
                    if say is not None:
                        say(f"still compiling ({time.monotonic() - t0:.0f} s)")
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, stdout, stderr)
    return float(stdout.strip().splitlines()[-1])
