"""Peak allocator memory of a piece of work on the CPU, where torch keeps no allocator statistics.

The torch profiler with ``profile_memory=True`` records every allocation and free of torch's CPU allocator as a
``[memory]`` event with its signed byte count; replaying them in time order gives the peak of live bytes above
what was live before the work started — allocator-level, not RSS, and deterministic for a given program (no
timing involved), so a test may compare two peaks. Benchmarks import this module as ``_memory``
(``python benchmarks/<name>.py`` puts this folder on ``sys.path``; tests insert it).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CPU_PEAK_METHOD = "cpu allocator peak live bytes above baseline (torch profiler [memory] events)"


def cpu_peak_bytes(work: Callable[[], Any]) -> int:
    """Peak of live CPU-allocator bytes while ``work()`` runs, above those live when it started."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
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
    return peak
