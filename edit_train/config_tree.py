"""Where the Hydra config tree is: the package `edit_train.conf`.

The tree is the repository's top-level conf/ directory; pyproject.toml maps it to `edit_train.conf`, so a
wheel installs it as edit_train/conf/ and an editable install points the package at conf/ in the checkout.
It is located by its import spec, without importing it (no __pycache__ in a tree users copy). A checkout
put on PYTHONPATH without being installed has no such mapping: its conf/ is found beside edit_train/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

CONFIG_NAME = "config.yaml"


def locate() -> Path:
    """The directory holding config.yaml and the group folders (algo/, model/, ...)."""
    try:
        spec = importlib.util.find_spec("edit_train.conf")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / CONFIG_NAME).is_file():
            return Path(location).resolve()
    return Path(__file__).resolve().parents[1] / "conf"


CONF_DIR = str(locate())
