"""Reading a training checkpoint as whole models: where the checkpoints are, and every parameter's full tensor.

Layouts (``train/checkpoint.py`` writes them): ``checkpoints/step_NNNNNNNN/`` (a lone cluster, or an old run whose
clusters shared one world, as ddp's do) and ``checkpoints/<cluster>/step_NNNNNNNN/`` (a federation). In a step directory
rank ``r`` keeps its FSDP2 shard of every parameter in ``rank{r}-model.safetensors`` (``param/<name>``, dim 0,
``torch.chunk`` semantics) and, with local SGD, of the anchor θ̄ in ``rank{r}-outer.safetensors``
(``<unit>/anchor/<i>``, see :func:`anchor_names`); concatenating the ranks' shards in rank order rebuilds a tensor.

:class:`CheckpointParams` is a lazy mapping: a parameter is gathered when it is asked for, each rank file opened
only for that read, so an export streams a checkpoint of any size through about one parameter of memory.
Nothing unpickles: tensors through ``safetensors``, state through JSON with a size cap.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from edit_train.model.config import ModelConfig
from edit_train.model.hf import buffer_shapes, param_shapes
from edit_train.train.checkpoint import (MANIFEST, MAX_STATE_BYTES, STEP_RE, CheckpointError, CheckpointManager,
                                         read_json)

log = logging.getLogger(__name__)

STEP_ENTRY_RE = re.compile(r"^step_\d{8}(\.tmp)?$")  # a checkpoint, complete or being written


# ------------------------------------------------------------------------------------------ locating
def _has_step_entries(d: Path) -> bool:
    return d.is_dir() and any(STEP_ENTRY_RE.match(p.name) for p in d.iterdir())


def cluster_dirs(root: Path) -> dict[str, Path]:
    """{cluster name: checkpoints/<cluster>} of a multi-cluster checkpoint root, in natural order (c2 < c10);
    empty for a single-cluster root, which holds step_NNNNNNNN directories itself."""
    if not root.is_dir() or _has_step_entries(root):
        return {}
    found = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and _has_step_entries(p)]
    natural = lambda p: tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name))  # noqa: E731
    return {p.name: p for p in sorted(found, key=natural)}


def run_dir_of(source: Path) -> Path | None:
    """The run directory a source lies in (the parent of its `checkpoints/`), None when it cannot tell."""
    return source if (source / "checkpoints").is_dir() else next(
        (up.parent for up in [source, *source.parents] if up.name == "checkpoints"), None)


def step_of(step_dir: Path) -> int | None:
    return int(m.group(1)) if (m := STEP_RE.match(step_dir.name)) else None


def resolve_step_dir(source: Path, step: int | None) -> Path:
    """The checkpoint directory of a single-cluster layout (a step directory, or a root holding step
    directories): `step`, or the newest that verifies against its manifest (CheckpointError / ValueError)."""
    m = STEP_RE.match(source.name)
    if m or (source / MANIFEST).is_file():
        if step is not None and m and int(m.group(1)) != step:
            raise ValueError(f"--step {step} disagrees with the checkpoint directory {source}")
        if not (source / MANIFEST).is_file():
            raise ValueError(f"{source / MANIFEST}: missing; the checkpoint is incomplete (crashed while saving?)")
        CheckpointManager(source.parent).verify(source)
        return source
    root = source / "checkpoints" if (source / "checkpoints").is_dir() else source
    mgr = CheckpointManager(root)
    steps = mgr.list_steps()
    if not steps:
        raise ValueError(f"{source}: no complete checkpoint found (looked in {root}); train with "
                         f"checkpoint.at_end=true or checkpoint.every=N")
    if step is not None:
        if step not in steps:
            raise ValueError(f"--step {step}: no complete checkpoint in {root} (available: {', '.join(map(str, steps))})")
        mgr.verify(mgr.step_dir(step))
        return mgr.step_dir(step)
    latest = mgr.latest_valid()
    if latest is None:
        raise ValueError(f"{root}: every checkpoint fails verification (corrupt or truncated); nothing to export")
    return latest


def common_step(clusters: dict[str, Path], step: int | None) -> int:
    """The newest step every cluster completed and whose checkpoints all verify (or `step`, checked)."""
    mgrs = {name: CheckpointManager(d) for name, d in clusters.items()}
    steps = {name: mgr.list_steps() for name, mgr in mgrs.items()}
    have = "complete steps: " + "; ".join(f"{n}: {', '.join(map(str, s)) or 'none'}" for n, s in steps.items())
    shared = sorted(set.intersection(*(set(s) for s in steps.values())))
    if step is not None and step not in shared:
        raise ValueError(f"--step {step}: not a complete checkpoint of every cluster ({have}); use --cluster NAME")
    if not shared:
        raise ValueError(f"the clusters have no complete checkpoint step in common ({have}); export one with --cluster NAME")
    for s in [step] if step is not None else reversed(shared):
        try:
            for mgr in mgrs.values():
                mgr.verify(mgr.step_dir(s))
        except CheckpointError as exc:
            if step is not None:
                raise
            log.warning("skipping step %d: %s", s, exc)
            continue
        return s
    raise ValueError(f"no step every cluster completed verifies ({have}; corrupt or truncated); use --cluster NAME")


# ------------------------------------------------------------------------------------------ reading
def model_config_of(d: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of a run config's ``model`` section (keys it does not know are ignored)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})


def anchor_names(cfg: ModelConfig) -> dict[str, str]:
    """{"<unit>/anchor/<i>": parameter name}: the outer state's keys (OuterState.state_dict) for the sync units
    `build_units(model, fsdp_units(model))` makes: the root (what no unit owns), word_embeddings (untied), each
    decoder layer, lm_head (untied), parameters in `named_parameters` order (tests pin it to build_units)."""
    units: dict[str, list[str]] = {"root": []}
    for name in param_shapes(cfg):
        head = name.split(".", 1)[0]
        if head == "layers":
            unit = ".".join(name.split(".", 2)[:2])
        else:
            unit = head if head in ("word_embeddings", "lm_head") and not cfg.tie_word_embeddings else "root"
        units.setdefault(unit, []).append(name)
    return {f"{unit}/anchor/{i}": n for unit, names in units.items() for i, n in enumerate(names)}


class CheckpointParams(Mapping[str, torch.Tensor]):
    """{parameter name: full tensor} of one model kept by a checkpoint's ranks, gathered on access."""

    def __init__(self, files: list[Path], keys: dict[str, str], shapes: dict[str, tuple[int, ...]],
                 what: str, replicated: dict[str, tuple[Path, str]] | None = None) -> None:
        self.files, self.file_keys, self.shapes, self.what = files, keys, shapes, what  # parameter -> key in file
        # tensors every rank holds whole (the expert-bias buffers): read from one file, {name: (file, key)}
        self.replicated = replicated or {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.replicated:
            path, key = self.replicated[name]
            return CheckpointParams([path], {name: key}, self.shapes, self.what)[name]
        key = self.file_keys[name]
        pieces = []
        for path in self.files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    if key not in f.keys():
                        raise ValueError(f"{path}: no tensor {key!r} (written for a different model?)")
                    pieces.append(f.get_tensor(key))
            except ValueError:
                raise
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types; nothing else is parsed
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ValueError(f"{path}: not a valid safetensors file ({why})") from None
        full = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        if tuple(full.shape) != self.shapes[name]:
            raise ValueError(f"{self.files[0].parent}: {self.what} {name!r} gathers to shape {tuple(full.shape)} over "
                             f"{len(self.files)} rank(s), the model config needs {self.shapes[name]}")
        return full

    def __iter__(self) -> Iterator[str]:
        return iter([*self.file_keys, *self.replicated])

    def __len__(self) -> int:
        return len(self.file_keys) + len(self.replicated)


@dataclass
class StepCheckpoint:
    """The models one step directory keeps for one cluster: its replica and, with local SGD,
    its anchor (None without), both lazy."""
    step_dir: Path
    model_cfg: ModelConfig
    run_cfg: dict[str, Any]
    replica: CheckpointParams
    anchor: CheckpointParams | None

    @property
    def step(self) -> int | None:
        return step_of(self.step_dir)


def _open(step_dir: Path, ranks: range, run_cfg: dict[str, Any], model_cfg: ModelConfig,
          member: Callable[[str], Path] | None = None) -> StepCheckpoint:
    member = member or (lambda name: step_dir / name)
    shapes = param_shapes(model_cfg)
    buffers = buffer_shapes(model_cfg)  # the expert biases: every rank holds the cluster's (one update, summed load)
    model_files = [member(f"rank{r}-model.safetensors") for r in ranks]
    outer_files = [member(f"rank{r}-outer.safetensors") for r in ranks]
    for path in model_files:
        if not path.is_file():
            raise ValueError(f"{path}: missing (the checkpoint was written by {len(ranks)} rank(s) here)")
    biases = {n: (model_files[0], f"buffer/{n}") for n in buffers}
    replica = CheckpointParams(model_files, {n: f"param/{n}" for n in shapes}, {**shapes, **buffers}, "parameter",
                               biases)
    anchor = None
    if all(p.is_file() for p in outer_files):  # no outer state: no local SGD (ddp), the replica is the model
        # the anchor carries no bias (a buffer is not synced): an export of it takes this cluster's
        anchor = CheckpointParams(outer_files, {n: k for k, n in anchor_names(model_cfg).items()},
                                  {**shapes, **buffers}, "anchor of", biases)
    return StepCheckpoint(step_dir, model_cfg, run_cfg, replica, anchor)


def open_cluster(step_dir: Path) -> StepCheckpoint:
    """A per-cluster checkpoint: every rank of its manifest is that cluster's."""
    mgr = CheckpointManager(step_dir.parent)
    ranks = int(mgr.read_manifest(step_dir)["world_size"])
    state = read_json(mgr.member(step_dir, "rank0-state.json"), MAX_STATE_BYTES, "state")
    try:
        run_cfg = state["config"]
        model_cfg = model_config_of(run_cfg["model"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{step_dir / 'rank0-state.json'}: no config.model ({exc!r})") from None
    return _open(step_dir, range(ranks), run_cfg, model_cfg, lambda name: mgr.member(step_dir, name))


def open_group(step_dir: str | Path, group: int = 0) -> StepCheckpoint:
    """Cluster ``group`` (c<group>) of a checkpoint whose clusters shared one world: its ranks are ``g*S .. g*S+S-1``
    (``S`` = ``cluster.ranks``, the group count ``cluster.count``, from ``rank{r}-state.json``'s config).
    Does not verify checksums (``CheckpointManager.verify`` does)."""
    d = Path(step_dir)
    if not d.is_dir():
        raise ValueError(f"{d}: not a checkpoint directory")
    state_files = sorted(d.glob("rank*-state.json"))
    if not state_files:
        raise ValueError(f"{d}: no rank*-state.json; not an edit-train checkpoint directory (step_NNNNNNNN)")
    state_path = d / "rank0-state.json" if (d / "rank0-state.json").is_file() else state_files[0]
    try:
        run_cfg = read_json(state_path, MAX_STATE_BYTES, "state")["config"]
        model_cfg = model_config_of(run_cfg["model"])
        c = run_cfg["cluster"]  # a checkpoint written before the one-word rename names them groups / shard_size
        groups, shard = int(c.get("count", c.get("groups"))), int(c.get("ranks", c.get("shard_size")))
    except (CheckpointError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{state_path}: unreadable or without config.model / config.cluster ({exc!r})") from None
    if not 0 <= group < groups:
        raise ValueError(f"--cluster c{group} is out of range: {d} was written by {groups} cluster(s) (c0…c{groups - 1})")
    return _open(d, range(group * shard, (group + 1) * shard), run_cfg, model_cfg)


def gather_checkpoint(step_dir: str | Path, group: int = 0) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Cluster ``group``'s full parameters, all in memory (:func:`open_group` gathers them lazily)."""
    ck = open_group(step_dir, group)
    return dict(ck.replica.items()), ck.model_cfg


def first_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> str | None:
    """The first name whose tensors differ (or that ``b`` lacks), one tensor pair in memory at a time."""
    for name in a:
        if name not in b:
            return name
        x, y = a[name], b[name]
        if x.shape != y.shape or not torch.equal(x, y):
            return name
    return None
