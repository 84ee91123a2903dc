"""Shared CLI plumbing: config composition with one-line errors, logging."""

from __future__ import annotations

import difflib
import logging
import os
import sys
from typing import Any, NoReturn

# The config tree: the repository's top-level conf/, shipped in the wheel as the package edit_train.conf
# (edit_train/config_tree.py finds it in an editable install, a wheel install and a bare checkout).
from edit_train.config_tree import CONF_DIR


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _unknown_key_hint(exc: BaseException) -> str | None:
    """`train.stpes=10`: the key does not exist; name the closest one that does (`did you mean train.steps?`)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if not isinstance(exc, (ConfigAttributeError, ConfigKeyError)) or " not in " not in str(exc):
        return None
    full_key, key, parent = getattr(exc, "full_key", None), getattr(exc, "key", None), getattr(exc, "parent_node", None)
    from edit_train.retired import retired_hint

    if full_key and retired_hint(str(full_key)):
        return retired_hint(str(full_key))
    if not full_key or key is None or parent is None or not hasattr(parent, "keys"):
        return None
    prefix = str(full_key)[:-len(str(key))].rstrip(".") if str(full_key).endswith(str(key)) else ""
    known = [str(k) for k in parent.keys() if str(k) != "hydra"]
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    where = f"in {prefix}" if prefix else "at the top level"
    if close:
        return f"{full_key}: no such config key {where}; did you mean {prefix + '.' if prefix else ''}{close[0]}?"
    listed = ", ".join(sorted(known)[:15]) + (", …" if len(known) > 15 else "")
    return f"{full_key}: no such config key {where} (it has: {listed})"


def _config_hint(exc: BaseException) -> str | None:
    """Say a bad group choice or an unset mandatory key the way a user fixes it."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import MissingMandatoryValue

    if isinstance(exc, MissingConfigException) and exc.options is not None and exc.missing_cfg_file:
        group, _, name = str(exc.missing_cfg_file).rpartition("/")
        if group:
            close = difflib.get_close_matches(name, list(exc.options), n=1)
            return (f"{group}={name}: no such {group} option" + (f" (did you mean {group}={close[0]}?)" if close else "")
                    + f"; choose one of {', '.join(sorted(exc.options))}")
    unknown = _unknown_key_hint(exc)
    if unknown:
        return unknown
    if isinstance(exc, MissingMandatoryValue):
        key = getattr(exc, "full_key", None) or "a value"
        if key == "data.source":
            return ("data.source: must be set with data=text, e.g. data.source='/path/to/corpus/**/*.txt' "
                    "(a glob, a directory or a .jsonl file)")
        return f"{key}: must be set (the config leaves it ???)"
    return None


def one_line(exc: BaseException) -> str:
    """Collapse an exception (and its cause chain) into one informative line."""
    link: BaseException | None = exc
    while link is not None:  # a Hydra/OmegaConf error a user fixes by choosing or setting something
        hint = _config_hint(link)
        if hint:
            return hint
        link = link.__cause__ if link.__cause__ is not link else None
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
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)  # `raise … from None`: not
    return " — ".join(parts) or type(exc).__name__


def equal_clusters(overrides: list[str]) -> list[str]:
    """`cluster.count=N` without `cluster=` or `cluster.slowdown=`: N equal clusters. The default preset
    (`hetero_2x1`) gives its two clusters a slowdown each; that list does not carry over to N clusters.
    Returns the override that says so (appended to the user's)."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o and not o.startswith("-")}
    if "cluster.count" in keys and not keys & {"cluster", "cluster.slowdown", "cluster.clusters"}:
        return ["cluster.slowdown=[]"]
    return []


# Hydra's flags that take a value (`--cfg job`, `--info defaults`, `--config-name NAME`, ...): that value is no override
_VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun")


def add_overrides(argv: list[str], added: list[str]) -> list[str]:
    """`argv` (Hydra's command line: flags and overrides) with `added` next to the user's own overrides. Hydra reads
    the overrides as one run of positional arguments: `--cfg job cluster.count=3` with `cluster.slowdown=[]` put in
    front of `--cfg` is `unrecognized arguments: cluster.count=3`. So they go right after the last override, or
    first when the command line holds none (before any flag, whose optional value they would otherwise become)."""
    if not added:
        return list(argv)
    last, skip = -1, False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in _VALUE_FLAGS and i + 1 < len(argv) and not argv[i + 1].startswith("-") and (
                arg not in ("--info", "-i") or "=" not in argv[i + 1])
        else:
            last = i
    return [*argv[:last + 1], *added, *argv[last + 1:]]


def compose(overrides: list[str]) -> Any:
    """Compose the Hydra config (as `edit-train` would) and return a typed `Config`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from edit_train.config import register_configs
    from edit_train.retired import renamed_overrides
    from edit_train.sim.switch import real_preset

    register_configs()
    GlobalHydra.instance().clear()
    overrides = renamed_overrides(list(overrides))
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        dcfg = hydra_compose(config_name="config",
                             overrides=[*overrides, *equal_clusters(overrides), *real_preset(overrides)])
    return OmegaConf.to_object(dcfg)


def setup_logging(rank: int = 0) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "[%(asctime)s edit-train] %(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True)
    # "torch": what a complete torch import sets itself; one cut short by Ctrl-C leaves it to the root's INFO, and
    # its exit hooks then log FakeTensor's cache statistics under our name
    for noisy in ("wandb", "urllib3", "torch", "torch.distributed.elastic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name in filter(None, os.environ.get("EDIT_TRAIN_DEBUG", "").split(",")):  # e.g. edit_train.local_sgd.sync.probe
        logging.getLogger(name.strip()).setLevel(logging.DEBUG)
    os.environ.setdefault("WANDB_SILENT", "true")
    if not os.environ.get("RUST_LOG"):
        os.environ["RUST_LOG"] = "warn"  # torchft's Lighthouse logs every quorum at INFO otherwise
