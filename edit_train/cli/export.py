"""``edit-train-export``: a checkpoint -> a Hugging Face BailingMoe directory (config.json + model.safetensors).

    edit-train-export RUN_DIR OUT_DIR                 # newest complete (checksum-verified) checkpoint
    edit-train-export RUN_DIR OUT_DIR --step 600      # that step
    edit-train-export RUN_DIR/checkpoints/step_00000600 OUT_DIR

The full model is rebuilt from the FSDP shards of one worker group (``--group``, default 0; checkpoints are
taken at sync boundaries, where every group holds the global model). Prints one line; a user error prints
one ``error: ...`` line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path
from typing import Any, Sequence

from edit_train.cli.common import fail, one_line

STEP_RE = re.compile(r"^step_(\d{8})$")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edit-train-export",
                                description="Export an edit-train checkpoint as a Hugging Face BailingMoe directory.")
    p.add_argument("source", help="a run directory (its run.dir), its checkpoints/ directory, or one "
                                  "checkpoints/step_NNNNNNNN directory")
    p.add_argument("out_dir", help="output directory (created; must not exist or be empty unless --overwrite)")
    p.add_argument("--step", type=int, default=None, help="export this step (default: the newest complete checkpoint)")
    p.add_argument("--group", type=int, default=0, help="worker group whose replica to export (default 0)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="tensor dtype in model.safetensors (default float32, the training master weights)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    return p


def resolve_step_dir(source: Path, step: int | None) -> Path:
    """The checkpoint directory to export, verified against its manifest (CheckpointError / ValueError)."""
    from edit_train.train.checkpoint import MANIFEST, CheckpointManager

    if not source.exists():
        raise ValueError(f"{source}: no such file or directory")
    if not source.is_dir():
        raise ValueError(f"{source}: not a directory; give a run directory or a checkpoints/step_NNNNNNNN directory")
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
            raise ValueError(f"--step {step}: no complete checkpoint in {root} (available: "
                             f"{', '.join(map(str, steps))})")
        path = mgr.step_dir(step)
        mgr.verify(path)
        return path
    latest = mgr.latest_valid()
    if latest is None:
        raise ValueError(f"{root}: every checkpoint fails verification (corrupt or truncated); nothing to export")
    return latest


def _tokenizer_info(run_cfg: dict[str, Any]) -> tuple[int | None, dict[str, Path]]:
    """(eos id, files to copy) of the run's tokenizer, best effort: a tokenizer file that is gone is skipped."""
    spec = str(run_cfg.get("data", {}).get("tokenizer", "byte"))
    try:
        from edit_train.data.tokenizer import load_tokenizer

        tok = load_tokenizer(spec)
    except Exception as exc:  # noqa: BLE001 - the weights are still worth exporting
        logging.getLogger(__name__).warning("tokenizer %s not copied: %s", spec, one_line(exc))
        return None, {}
    files = {"tokenizer.json": tok.path} if hasattr(tok, "path") else {}
    return tok.eos_id, files


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    try:
        from edit_train.model.hf import parse_dtype
        from edit_train.model.hf_io import export_hf, gather_checkpoint

        out_dir = Path(args.out_dir)
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not args.overwrite:
            raise ValueError(f"{out_dir}: exists and is not an empty directory; choose a new OUT_DIR or pass "
                             f"--overwrite")
        step_dir = resolve_step_dir(Path(args.source), args.step)
        state, model_cfg = gather_checkpoint(step_dir, args.group)
        run_state = json.loads((step_dir / "rank0-state.json").read_text()) \
            if (step_dir / "rank0-state.json").is_file() else {}
        run_cfg = run_state.get("config", {})
        eos, files = _tokenizer_info(run_cfg)
        if eos is not None and eos >= model_cfg.vocab_size:
            eos = None
        step = int(STEP_RE.match(step_dir.name).group(1)) if STEP_RE.match(step_dir.name) else run_state.get("step")
        out = export_hf(state, model_cfg, args.out_dir, dtype=parse_dtype(args.dtype), eos_token_id=eos,
                        overwrite=args.overwrite, extra_files=files,
                        metadata={"edit_train_step": str(step), "edit_train_group": str(args.group),
                                  "edit_train_checkpoint": str(step_dir.resolve())})
        n_params = sum(t.numel() for t in state.values())
        size = (out / "model.safetensors").stat().st_size
    except SystemExit:
        raise
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - every user error becomes one line
        fail(one_line(exc))
    print(f"exported {step_dir} (step {step}, group {args.group}) -> {out}: {n_params:,} params, "
          f"{args.dtype}, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
