"""A training checkpoint -> a Hugging Face BailingMoe directory (what ``edit-train-export`` does).

What is exported: from a multi-cluster run (``checkpoints/<cluster>/step_NNNNNNNN/``) the clusters' common anchor θ̄
at the newest step they all completed (checksums verified), when every cluster holds the same one (after the
final sync they do), else one line suggesting ``--cluster NAME`` (that cluster's replica); without anchors (ddp)
the replicas are compared instead. A single-cluster run or a step directory exports that checkpoint's replica.
The tokenizer goes along (the run's ``data.tokenizer`` file, or the byte tokenizer written as a ``tokenizers``
file). Parameters stream from the checkpoint one at a time (:mod:`edit_train.train.checkpoint_reader`) into
size-capped shards (:func:`edit_train.model.hf_io.export_hf`).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edit_train.model.config import ModelConfig
from edit_train.model.shards import DEFAULT_SHARD_BYTES
from edit_train.train.checkpoint import MANIFEST, STEP_RE
from edit_train.train.checkpoint_reader import (cluster_dirs, common_step, first_difference, open_cluster, open_group,
                                                resolve_step_dir, step_of)

log = logging.getLogger(__name__)


@dataclass
class Picked:
    """What will be exported and how to describe it; ``state`` gathers each parameter when asked."""
    state: Mapping[str, torch.Tensor]
    model_cfg: ModelConfig
    run_cfg: dict[str, Any]
    step: int | None
    what: str
    where: str
    metadata: dict[str, str]


class _MeanBias(Mapping[str, torch.Tensor]):
    """A cluster's exported state with each expert bias (``model.moe_router_enable_expert_bias``) replaced by the
    mean of the clusters' biases: every cluster keeps its own bias between syncs (a buffer, not synced) and the
    anchor's bias is the clusters' mean — the simplest rule."""

    def __init__(self, state: Mapping[str, torch.Tensor], all_states: list[Mapping[str, torch.Tensor]],
                 biases: list[str]) -> None:
        self.state, self.all_states, self.biases = state, all_states, set(biases)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.biases:
            return torch.stack([st[name].to(torch.float32) for st in self.all_states]).mean(0)
        return self.state[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


class _Without(Mapping[str, torch.Tensor]):
    def __init__(self, state: Mapping[str, torch.Tensor], names: list[str]) -> None:
        self.state, self.names = state, [n for n in state if n not in set(names)]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.state[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def pick_common(root: Path, clusters: dict[str, Path], step: int | None) -> Picked:
    """The clusters' common final anchor at the newest step they all completed (refused when they differ; the
    expert biases, which each cluster keeps for itself, are exported as their mean)."""
    s = common_step(clusters, step)
    names, n = list(clusters), len(clusters)
    first = open_cluster(clusters[names[0]] / f"step_{s:08d}")
    kind = "anchors" if first.anchor is not None else "weights"
    biases = list(getattr(first.replica, "replicated", {}))
    same_replicas = first.anchor is None or first_difference(first.anchor, first.replica) is None
    states = [first.anchor or first.replica]
    for name in names[1:]:
        ck = open_cluster(clusters[name] / f"step_{s:08d}")
        if (first.anchor is None) != (ck.anchor is None):
            raise ValueError(f"step {s}: one of clusters {names[0]} and {name} has an anchor, the other not; "
                             f"export one cluster with --cluster NAME")
        states.append(ck.anchor or ck.replica)
        diff = first_difference(_Without(first.anchor or first.replica, biases), ck.anchor or ck.replica)
        if diff is not None:
            raise ValueError(f"clusters {names[0]} and {name} hold different {kind} at step {s} (first: {diff}); "
                             f"they did not end on one model: export one with --cluster NAME")
        same_replicas = same_replicas and first_difference(first.replica, ck.replica) is None
    label = ", ".join(names)
    agree = "the only cluster with checkpoints" if n == 1 else "identical in both" if n == 2 else f"identical in all {n}"
    if first.anchor is not None:
        what = f"the common final anchor of cluster{'s' if n > 1 else ''} {label} ({agree})"
        if not same_replicas:
            what += f"; {'their replicas differ' if n > 1 else 'its replica differs'} from it (local steps after the sync)"
    else:
        algo = first.run_cfg.get("algo", {}).get("name", "no local SGD")
        what = f"the common weights of cluster{'s' if n > 1 else ''} {label} ({agree}; {algo}: no anchor)"
    where = f"{root}/{{{','.join(names)}}}/step_{s:08d}" if n > 1 else str(clusters[names[0]] / f"step_{s:08d}")
    meta = {"edit_train_step": str(s), "edit_train_clusters": label,
            "edit_train_checkpoint": f"checkpoints/{names[0]}/step_{s:08d}" if n == 1
            else f"checkpoints/{{{','.join(names)}}}/step_{s:08d}",
            "edit_train_tensor": "anchor" if first.anchor is not None else "replica"}
    state = first.anchor or first.replica
    if biases and n > 1:
        state = _MeanBias(state, states, biases)
        what += "; expert biases: the clusters' mean"
    return Picked(state, first.model_cfg, first.run_cfg, s, what, where, meta)


def _single_world_index(cluster: str | None, step_dir: Path) -> int:
    """Which cluster of a single-world checkpoint (ddp: every cluster's ranks in one world) `--cluster` names:
    `c<N>` or `N`; none: cluster 0."""
    if cluster is None:
        return 0
    digits = cluster[1:] if cluster.startswith("c") else cluster
    if not digits.isdigit():
        raise ValueError(f"--cluster {cluster}: {step_dir} is one world of clusters c0, c1, …; name one as c<N>")
    return int(digits)


def pick_replica(step_dir: Path, cluster: str | None) -> Picked:
    """One checkpoint's replica: a cluster's own (per-cluster layout: checkpoints/<cluster>/step_N) or, in a
    single-world checkpoint (checkpoints/step_N), the ranks of cluster c<N>."""
    if step_dir.parent.parent.name == "checkpoints":
        if cluster is not None and step_dir.parent.name != cluster:
            raise ValueError(f"--cluster {cluster}: {step_dir} is not that cluster's checkpoint")
        ck = open_cluster(step_dir)
        name = cluster or step_dir.parent.name
        what, who = f"cluster {name}'s replica", {"edit_train_clusters": name}
    else:
        index = _single_world_index(cluster, step_dir)
        ck = open_group(step_dir, index)
        what, who = f"cluster c{index}'s replica", {"edit_train_clusters": f"c{index}"}
    step = step_of(step_dir)
    meta = {"edit_train_step": str(step), **who, "edit_train_checkpoint": run_relative(step_dir),
            "edit_train_tensor": "replica"}
    return Picked(ck.replica, ck.model_cfg, ck.run_cfg, step, what, str(step_dir), meta)


def run_relative(step_dir: Path) -> str:
    """A step directory named from the run's ``checkpoints/`` on (``checkpoints/c0/step_00000008``), never the
    host path: exports travel to other machines and the Hub."""
    parts = step_dir.resolve().parts
    if "checkpoints" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("checkpoints"):])
    return step_dir.name


def pick(source: Path, step: int | None, cluster: str | None) -> Picked:
    """Decide what to export from SOURCE (see the module docstring)."""
    if not source.is_dir():
        raise ValueError(f"{source}: no such file or directory" if not source.exists() else
                         f"{source}: not a directory; give a run directory or a checkpoints/step_NNNNNNNN directory")
    is_step = bool(STEP_RE.match(source.name)) or (source / MANIFEST).is_file()
    root = source / "checkpoints" if (source / "checkpoints").is_dir() else source
    clusters = {} if is_step else cluster_dirs(root)
    if clusters and cluster is not None:
        if cluster not in clusters:
            raise ValueError(f"--cluster {cluster}: no checkpoints of that cluster in {root} (clusters: "
                             f"{', '.join(clusters)})")
        return pick_replica(resolve_step_dir(clusters[cluster], step), cluster)
    if clusters:
        return pick_common(root, clusters, step)
    return pick_replica(resolve_step_dir(source, step), cluster)


def tokenizer_files(run_cfg: dict[str, Any], vocab_size: int, tmp: Path) -> tuple[int | None, dict[str, Path]]:
    """(eos id, {name: source}): tokenizer.json (the run's file, or the byte tokenizer written out) and a
    tokenizer_config.json for transformers' AutoTokenizer. Best effort: else one warning, weights only."""
    from edit_train.data.tokenizer import BYTE_EOS, ByteTokenizer, load_tokenizer

    spec = str(run_cfg.get("data", {}).get("tokenizer", "byte"))
    try:
        tok = load_tokenizer(spec)
        if isinstance(tok, ByteTokenizer):
            src, eos_token = tmp / "tokenizer.json", BYTE_EOS
            tok.save_hf(src)
        else:
            src = Path(tok.path)
            eos_token = tok._tok.id_to_token(tok.eos_id) if tok.eos_id is not None else None
    except Exception as exc:  # noqa: BLE001 - the weights are still worth exporting
        log.warning("tokenizer %s not exported: %s", spec, str(exc).strip().splitlines()[0] if str(exc).strip()
                    else type(exc).__name__)
        return None, {}
    eos = tok.eos_id if tok.eos_id is not None and tok.eos_id < vocab_size else None
    conf: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if eos_token is not None and eos is not None:
        conf["eos_token"] = eos_token
    (tmp / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return eos, {"tokenizer.json": src, "tokenizer_config.json": tmp / "tokenizer_config.json"}


def export_checkpoint(source: Path, out_dir: Path, *, step: int | None = None,
                      cluster: str | None = None, dtype: str = "float32", overwrite: bool = False,
                      max_shard_size: int | str = DEFAULT_SHARD_BYTES) -> tuple[Picked, Path]:
    """Pick what SOURCE holds (:func:`pick`) and write it to ``out_dir`` with its tokenizer; (what, out_dir)."""
    from edit_train.model.hf import parse_dtype
    from edit_train.model.hf_io import export_hf

    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise ValueError(f"{out_dir}: exists and is not an empty directory; choose a new output directory or "
                         f"pass --overwrite")
    picked = pick(source, step, cluster)
    with tempfile.TemporaryDirectory(prefix="edit-train-export-") as tmp:
        eos, files = tokenizer_files(picked.run_cfg, picked.model_cfg.vocab_size, Path(tmp))
        out = export_hf(picked.state, picked.model_cfg, out_dir, dtype=parse_dtype(dtype), eos_token_id=eos,
                        overwrite=overwrite, extra_files=files, metadata=picked.metadata,
                        max_shard_size=max_shard_size)
    return picked, out
