"""JSON from outside (a peer, a file), parsed totally: a size cap and a nesting bound, both checked before
`json.loads` builds anything, and every failure a `ValueError` with a one-line reason.

The standard parser recurses once per `[` / `{`: a document 200k levels deep raises RecursionError (or worse,
in a thread with a small stack). `depth()` measures nesting without recursion and without building
anything: strings are cut out (so brackets inside them do not count), the brackets left are summed.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64  # nothing edit-train writes nests deeper than about 8

# a JSON string, in the unrolled form (linear, no backtracking): for valid JSON the strings are exactly
# these, left to right; for invalid JSON json.loads fails before it reaches anything mis-scanned here
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def depth(data: bytes) -> int:
    """The deepest nesting of arrays / objects in the JSON text `data` (0 for a scalar)."""
    if data.count(b"[") + data.count(b"{") == 0:
        return 0
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def loads(data: bytes | bytearray | memoryview, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse UTF-8 JSON of at most `max_bytes` bytes nested at most `max_depth` deep; ValueError otherwise."""
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes, more than the {max_bytes} allowed")
    data = bytes(data)
    if data.count(b"[") + data.count(b"{") > max_depth and depth(data) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:  # not reachable after depth(); kept so that no input escapes as another error
        raise ValueError("nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError; too many digits in an integer
        raise ValueError(f"not JSON ({str(exc).splitlines()[0] if str(exc) else 'malformed'})") from None
