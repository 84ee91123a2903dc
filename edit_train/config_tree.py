"""Where the Hydra config tree is: the package `edit_train.conf`.

The tree is the repository's top-level conf/ directory; pyproject.toml maps it to `edit_train.conf`, so a
wheel installs it as edit_train/conf/ and an editable install points the package at conf/ in the checkout.
It is located by its import spec, without importing it (no __pycache__ in a tree users copy). A checkout's
own conf/ beside edit_train/ comes first: the tree always belongs to the code that reads it (a checkout on
PYTHONPATH while another checkout is installed editable would otherwise read the installed one's conf/)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

CONFIG_NAME = "config.yaml"


def locate() -> Path:
    """The directory holding config.yaml and the group folders (algo/, model/, ...)."""
    beside = Path(__file__).resolve().parents[1] / "conf"
    if (beside / CONFIG_NAME).is_file():
        return beside
    try:
        spec = importlib.util.find_spec("edit_train.conf")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / CONFIG_NAME).is_file():
            return Path(location).resolve()
    return Path(__file__).resolve().parents[1] / "conf"


CONF_DIR = str(locate())
