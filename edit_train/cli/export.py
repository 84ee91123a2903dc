"""``edit-train-export RUN_DIR [--out DIR] [--cluster NAME] [--step N]``: a checkpoint -> a Hugging Face
BailingMoe directory (config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json).

A multi-cluster run keeps ``checkpoints/<cluster>/step_NNNNNNNN/``: from its run directory the newest step every
cluster completed (checksums verified) is taken and each cluster's anchor θ̄ gathered from its ranks' outer state
(FSDP shards, dim 0); it is exported when every cluster holds the same one (after the final sync they do), else
one line suggests ``--cluster NAME`` (that cluster's replica). Without anchors (ddp) the replicas are compared
instead. A single-cluster run or a step directory exports that checkpoint's replica. Default output:
``RUN_DIR/hf``. The tokenizer goes along (the run's ``data.tokenizer`` file, or the byte tokenizer written as a
``tokenizers`` file). Prints one line saying what was exported; a user error is one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from edit_train.cli.common import fail, one_line

if TYPE_CHECKING:
    import torch

    from edit_train.model.config import ModelConfig

STEP_RE = re.compile(r"^step_(\d{8})$")
STEP_ENTRY_RE = re.compile(r"^step_\d{8}(\.tmp)?$")  # a checkpoint, complete or being written
BYTE_EOS = "<|endoftext|>"
log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edit-train-export", description="Export an edit-train checkpoint as a Hugging "
                                "Face BailingMoe directory (weights, config, tokenizer). From a run directory: the "
                                "clusters' common final anchor.")
    p.add_argument("source", help="a run directory (its run.dir), its checkpoints/ directory, one cluster's "
                                  "checkpoints/<cluster> directory, or one step_NNNNNNNN directory")
    p.add_argument("out_dir", nargs="?", default=None, metavar="OUT_DIR", help="output directory (same as --out)")
    p.add_argument("--out", metavar="DIR", default=None, help="output directory (created; must not exist or be "
                                                               "empty unless --overwrite; default: RUN_DIR/hf)")
    p.add_argument("--cluster", metavar="NAME", default=None,
                   help="export this cluster's replica instead of the clusters' common anchor")
    p.add_argument("--step", type=int, default=None,
                   help="export this step (default: the newest complete checkpoint every cluster has)")
    p.add_argument("--group", type=int, default=None,
                   help="single-cluster checkpoints written by several worker groups: whose replica (default 0)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="tensor dtype in model.safetensors (default float32, the training master weights)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    return p


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


def resolve_step_dir(source: Path, step: int | None) -> Path:
    """The checkpoint directory to export from a single-cluster layout (a step directory, or a root holding
    step directories), verified against its manifest (CheckpointError / ValueError)."""
    from edit_train.train.checkpoint import MANIFEST, CheckpointManager

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
    from edit_train.train.checkpoint import CheckpointError, CheckpointManager

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
def anchor_names(cfg: ModelConfig) -> dict[str, str]:
    """{"<unit>/anchor/<i>": parameter name}: the outer state's keys (OuterState.state_dict) for the sync units
    `build_units(model, fsdp_units(model))` makes: the root (what no unit owns), word_embeddings (untied), each
    decoder layer, lm_head (untied), parameters in `named_parameters` order (tests pin it to build_units)."""
    from edit_train.model.hf import param_shapes

    units: dict[str, list[str]] = {"root": []}
    for name in param_shapes(cfg):
        head = name.split(".", 1)[0]
        if head == "layers":
            unit = ".".join(name.split(".", 2)[:2])
        else:
            unit = head if head in ("word_embeddings", "lm_head") and not cfg.tie_word_embeddings else "root"
        units.setdefault(unit, []).append(name)
    return {f"{unit}/anchor/{i}": n for unit, names in units.items() for i, n in enumerate(names)}


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types; nothing else is parsed
        raise ValueError(f"{path}: not a valid safetensors file ({str(exc).strip() or type(exc).__name__})") from None


@dataclass
class ClusterCheckpoint:
    """One cluster's checkpoint at one step: its replica and (local SGD) its anchor, as full tensors."""
    step_dir: Path
    model_cfg: ModelConfig
    run_cfg: dict[str, Any]
    replica: dict[str, torch.Tensor]
    anchor: dict[str, torch.Tensor] | None


def read_cluster(step_dir: Path) -> ClusterCheckpoint:
    """A per-cluster checkpoint: the manifest's ranks are all that cluster's, each holding its FSDP shard."""
    import torch

    from edit_train.model.hf import param_shapes
    from edit_train.model.hf_io import _model_config_from_dict
    from edit_train.train.checkpoint import MAX_STATE_BYTES, CheckpointManager, read_json

    mgr = CheckpointManager(step_dir.parent)
    ranks = int(mgr.read_manifest(step_dir)["world_size"])
    state = read_json(mgr.member(step_dir, "rank0-state.json"), MAX_STATE_BYTES, "state")
    try:
        run_cfg = state["config"]
        model_cfg = _model_config_from_dict(run_cfg["model"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{step_dir / 'rank0-state.json'}: no config.model ({exc!r})") from None
    shapes, names = param_shapes(model_cfg), anchor_names(model_cfg)
    params: dict[str, list[torch.Tensor]] = {n: [] for n in shapes}
    anchors: dict[str, list[torch.Tensor]] | None = {k: [] for k in names}
    for r in range(ranks):
        for part, keys, into in (("model", {f"param/{n}": n for n in shapes}, params),
                                 ("outer", {k: k for k in names}, anchors)):
            path = step_dir / f"rank{r}-{part}.safetensors"
            if into is None or (part == "outer" and not path.is_file()):
                anchors = None  # no local SGD (ddp): the replica is the model
                continue
            if not path.is_file():
                raise ValueError(f"{path}: missing (the checkpoint was written by {ranks} rank(s))")
            tensors = _load(path)
            for key, name in keys.items():
                if key not in tensors:
                    raise ValueError(f"{path}: no tensor {key!r} (written for a different model?)")
                into[name].append(tensors[key])
    replica = {n: torch.cat(p, dim=0) for n, p in params.items()}
    anchor = {names[k]: torch.cat(p, dim=0) for k, p in anchors.items()} if anchors is not None else None
    for what, full in (("parameter", replica), ("anchor of", anchor or {})):
        for n, t in full.items():
            if tuple(t.shape) != tuple(shapes[n]):
                raise ValueError(f"{step_dir}: {what} {n!r} gathers to shape {tuple(t.shape)} over {ranks} rank(s), "
                                 f"the model config needs {tuple(shapes[n])}")
    return ClusterCheckpoint(step_dir, model_cfg, run_cfg, replica, anchor)


def _first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    import torch

    return next((n for n, t in a.items() if n not in b or t.shape != b[n].shape or not torch.equal(t, b[n])), None)


@dataclass
class Picked:
    """What will be exported and how to describe it."""
    state: dict[str, torch.Tensor]
    model_cfg: ModelConfig
    run_cfg: dict[str, Any]
    step: int | None
    what: str
    where: str
    metadata: dict[str, str]


def pick_common(root: Path, clusters: dict[str, Path], step: int | None) -> Picked:
    """The clusters' common final anchor at the newest step they all completed (refused when they differ)."""
    s = common_step(clusters, step)
    names, n = list(clusters), len(clusters)
    first = read_cluster(clusters[names[0]] / f"step_{s:08d}")
    kind = "anchors" if first.anchor is not None else "weights"
    same_replicas = first.anchor is None or _first_difference(first.anchor, first.replica) is None
    for name in names[1:]:
        ck = read_cluster(clusters[name] / f"step_{s:08d}")
        if (first.anchor is None) != (ck.anchor is None):
            raise ValueError(f"step {s}: one of clusters {names[0]} and {name} has an anchor, the other not; "
                             f"export one cluster with --cluster NAME")
        diff = _first_difference(first.anchor or first.replica, ck.anchor or ck.replica)
        if diff is not None:
            raise ValueError(f"clusters {names[0]} and {name} hold different {kind} at step {s} (first: {diff}); "
                             f"they did not end on one model: export one with --cluster NAME")
        same_replicas = same_replicas and _first_difference(first.replica, ck.replica) is None
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
            "edit_train_checkpoint": str((clusters[names[0]] / f"step_{s:08d}").resolve()) if n == 1
            else f"{root.resolve()}/{{{','.join(names)}}}/step_{s:08d}",
            "edit_train_tensor": "anchor" if first.anchor is not None else "replica"}
    return Picked(first.anchor or first.replica, first.model_cfg, first.run_cfg, s, what, where, meta)


def pick_replica(step_dir: Path, group: int | None, cluster: str | None) -> Picked:
    """One checkpoint's replica: a cluster's own (per-cluster layout) or a worker group's (single world)."""
    if step_dir.parent.parent.name == "checkpoints" or cluster is not None:  # checkpoints/<cluster>/step_N
        if group not in (None, 0):
            raise ValueError(f"--group {group}: {step_dir} holds one cluster's ranks; pick a cluster with --cluster NAME")
        ck = read_cluster(step_dir)
        name = cluster or step_dir.parent.name
        state, model_cfg, run_cfg, what = ck.replica, ck.model_cfg, ck.run_cfg, f"cluster {name}'s replica"
        who = {"edit_train_clusters": name}
    else:
        from edit_train.model.hf_io import gather_checkpoint

        g = group or 0
        state, model_cfg = gather_checkpoint(step_dir, g)
        run_cfg = json.loads((step_dir / "rank0-state.json").read_text()).get("config", {})  # gather_checkpoint read it
        what, who = f"group {g}'s replica", {"edit_train_group": str(g)}
    step = int(m.group(1)) if (m := STEP_RE.match(step_dir.name)) else None
    meta = {"edit_train_step": str(step), **who, "edit_train_checkpoint": str(step_dir.resolve()),
            "edit_train_tensor": "replica"}
    return Picked(state, model_cfg, run_cfg, step, what, str(step_dir), meta)


def pick(source: Path, step: int | None, group: int | None, cluster: str | None) -> Picked:
    """Decide what to export from SOURCE (see the module docstring)."""
    from edit_train.train.checkpoint import MANIFEST

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
        return pick_replica(resolve_step_dir(clusters[cluster], step), group, cluster)
    if clusters:
        if group is not None:
            raise ValueError(f"--group {group}: {root} holds one directory per cluster ({', '.join(clusters)}); "
                             f"pick one with --cluster NAME")
        return pick_common(root, clusters, step)
    step_dir = resolve_step_dir(source, step)
    if cluster is not None and step_dir.parent.name != cluster:
        raise ValueError(f"--cluster {cluster}: {step_dir} is not that cluster's checkpoint")
    return pick_replica(step_dir, group, cluster)


# ---------------------------------------------------------------------------------------- tokenizer
def byte_tokenizer_json(path: Path) -> None:
    """Write edit-train's byte tokenizer (ids 0..255 = UTF-8 bytes, 256 = end of document) as a Hugging Face
    `tokenizers` file: byte-level BPE without merges over GPT-2's byte-to-unicode alphabet, in byte order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    char = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS, special=True, normalized=False)])
    tok.save(str(path))


def tokenizer_files(run_cfg: dict[str, Any], vocab_size: int, tmp: Path) -> tuple[int | None, dict[str, Path]]:
    """(eos id, {name: source}): tokenizer.json (the run's file, or the byte tokenizer written out) and a
    tokenizer_config.json for transformers' AutoTokenizer. Best effort: else one warning, weights only."""
    spec = str(run_cfg.get("data", {}).get("tokenizer", "byte"))
    try:
        from edit_train.data.tokenizer import load_tokenizer

        tok = load_tokenizer(spec)
        if spec == "byte":
            src, eos_token = tmp / "tokenizer.json", BYTE_EOS
            byte_tokenizer_json(src)
        else:
            src = Path(tok.path)  # type: ignore[union-attr]
            eos_token = tok._tok.id_to_token(tok.eos_id) if tok.eos_id is not None else None  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001 - the weights are still worth exporting
        log.warning("tokenizer %s not exported: %s", spec, one_line(exc))
        return None, {}
    eos = tok.eos_id if tok.eos_id is not None and tok.eos_id < vocab_size else None
    conf: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if eos_token is not None and eos is not None:
        conf["eos_token"] = eos_token
    (tmp / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return eos, {"tokenizer.json": src, "tokenizer_config.json": tmp / "tokenizer_config.json"}


# --------------------------------------------------------------------------------------------- main
def _out_dir(args: argparse.Namespace) -> Path:
    if args.out_dir is not None and args.out is not None and Path(args.out_dir) != Path(args.out):
        raise ValueError(f"two output directories ({args.out_dir} and --out {args.out}); give one")
    if args.out is not None or args.out_dir is not None:
        return Path(args.out if args.out is not None else args.out_dir)
    run = run_dir_of(Path(args.source))
    if run is None:
        raise ValueError(f"{args.source}: not inside a run directory; give the output directory with --out DIR")
    return run / "hf"


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    try:
        from edit_train.model.hf import parse_dtype
        from edit_train.model.hf_io import export_hf

        out_dir = _out_dir(args)
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not args.overwrite:
            raise ValueError(f"{out_dir}: exists and is not an empty directory; choose a new output directory or "
                             f"pass --overwrite")
        picked = pick(Path(args.source), args.step, args.group, args.cluster)
        with tempfile.TemporaryDirectory(prefix="edit-train-export-") as tmp:
            eos, files = tokenizer_files(picked.run_cfg, picked.model_cfg.vocab_size, Path(tmp))
            out = export_hf(picked.state, picked.model_cfg, out_dir, dtype=parse_dtype(args.dtype),
                            eos_token_id=eos, overwrite=args.overwrite, extra_files=files,
                            metadata=picked.metadata)
        n_params = sum(t.numel() for t in picked.state.values())
        size = (out / "model.safetensors").stat().st_size
        written = sorted(p.name for p in out.iterdir())
    except SystemExit:
        raise
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - every user error becomes one line
        fail(one_line(exc))
    print(f"exported {picked.what}, step {picked.step}, from {picked.where} -> {out}: {n_params:,} params, "
          f"{args.dtype}, {size / 1e6:.1f} MB; files: {', '.join(written)}")


if __name__ == "__main__":
    main()
