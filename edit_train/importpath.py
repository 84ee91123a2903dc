"""Objects named by import path ("package.module:attr") in config: a rule of your own (`algo.rule.name`), a
transport (`sync.transport`). Imported on first use; a bad name is one line naming the config key."""

from __future__ import annotations

import importlib
from typing import Any


def load(spec: str, key: str, kind: str, known: list[str]) -> Any:
    """The attribute `spec` = "module:attr" names; ValueError naming `key` (and the `known` built-ins) if it
    is not one or does not load."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{key}: unknown {kind} {spec!r}; choose one of {known} or name your own as "
                         "'package.module:attr'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{key}: cannot load {spec!r} ({exc}); is its module on PYTHONPATH?") from None
