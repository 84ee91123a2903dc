"""Shared CLI plumbing: config composition with one-line errors, logging."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def one_line(exc: BaseException) -> str:
    """Collapse an exception (and its cause chain) into one informative line."""
    parts: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        for line in str(cur).splitlines():
            line = line.strip()
            if line and not line.startswith(("full_key", "reference_type", "object_type", "To append",
                                             "Set the environment")) and "$VALUE" not in line and line not in parts:
                parts.append(line)
                break
        cur = cur.__cause__ or cur.__context__
    return " — ".join(parts) or type(exc).__name__


def compose(overrides: list[str]) -> Any:
    """Compose the Hydra config (as `edit-train` would) and return a typed `Config`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from edit_train.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        dcfg = hydra_compose(config_name="config", overrides=overrides)
    return OmegaConf.to_object(dcfg)


def setup_logging(rank: int = 0) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "[%(asctime)s edit-train] %(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True)
    for noisy in ("wandb", "urllib3", "torch.distributed.elastic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("WANDB_SILENT", "true")
