"""edit-train works offline and downloads nothing: the one line for a Hugging Face Hub name (``org/name``) given
where a local path is needed (``data.tokenizer``, ``model.init_from``), saying how to point at a local copy."""

from __future__ import annotations

import re
from pathlib import Path

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def looks_like_hub_name(spec: str) -> bool:
    """``org/name`` (a Hub repository id) rather than a path: two plain name parts, no file suffix, not on disk."""
    return bool(_HUB_NAME.match(str(spec))) and not Path(str(spec)).suffix and not Path(str(spec)).exists()


def offline_hint(spec: str, key: str, file: str = "") -> str:
    what = f" {file}" if file else ""
    return (f"{key}={spec} looks like a Hugging Face Hub name, but edit-train works offline and downloads nothing; "
            f"fetch it once where there is network (huggingface-cli download {spec}{what} --local-dir DIR) and set "
            f"{key}=DIR{'/' + file if file else ''}")
