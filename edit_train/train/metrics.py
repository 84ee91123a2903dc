"""Metric sinks: `metrics.jsonl` (the contract of docs/architecture.md §5), W&B, and a console summary.

Every rank may write to the one `metrics.jsonl`: each event is a single `os.write` on an O_APPEND
descriptor, which the kernel keeps whole for regular files.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become None (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class Sink(Protocol):
    def log(self, event: str, record: dict[str, Any]) -> None: ...

    def close(self, summary: dict[str, Any] | None = None) -> None: ...


class JsonlSink:
    """Append one JSON object per line with an `"event"` key."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(self, event: str, record: dict[str, Any]) -> None:
        line = json.dumps(_clean({"event": event, **record}), separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class MetricsLogger:
    """Fan an event out to every sink."""

    def __init__(self, sinks: list[Any]) -> None:
        self.sinks = sinks

    def log(self, event: str, **record: Any) -> None:
        for sink in self.sinks:
            sink.log(event, record)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        for sink in self.sinks:
            try:
                sink.close(summary)
            except Exception as exc:  # a failing tracker must not lose the run's own files
                log.warning("closing %s failed: %s", type(sink).__name__, exc)
