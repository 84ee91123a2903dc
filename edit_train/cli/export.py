"""``edit-train-export RUN_DIR [--out DIR] [--cluster NAME] [--step N]``: a checkpoint -> a Hugging Face
BailingMoe directory that stock ``transformers`` loads (``trust_remote_code=True``): config.json, the weights
(model.safetensors, or shards of ``--max-shard-size`` with model.safetensors.index.json), the modeling code,
generation_config.json, tokenizer.json, tokenizer_config.json.

What is exported from which checkpoint is decided by :mod:`edit_train.train.export`. Default output:
``RUN_DIR/hf``. Prints one line saying what was exported; a user error is one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path
from typing import Sequence

from edit_train.cli.common import fail, one_line


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
                   help="export this cluster's replica instead of the clusters' common anchor (a single-world "
                        "checkpoint, e.g. ddp's: c0, c1, …; default c0)")
    p.add_argument("--step", type=int, default=None,
                   help="export this step (default: the newest complete checkpoint every cluster has)")
    p.add_argument("--group", type=int, default=None, help=argparse.SUPPRESS)  # retired: --cluster c<N>
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="tensor dtype in model.safetensors (default float32, the training master weights)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest weights file (default 5GB, as transformers writes them); a bigger model is split into "
                        "model-0000k-of-0000n.safetensors with model.safetensors.index.json")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    return p


# --------------------------------------------------------------------------------------------- main
def _out_dir(args: argparse.Namespace) -> Path:
    if args.out_dir is not None and args.out is not None and Path(args.out_dir) != Path(args.out):
        raise ValueError(f"two output directories ({args.out_dir} and --out {args.out}); give one")
    if args.out is not None or args.out_dir is not None:
        return Path(args.out if args.out is not None else args.out_dir)
    from edit_train.train.checkpoint_reader import run_dir_of

    run = run_dir_of(Path(args.source))
    if run is None:
        raise ValueError(f"{args.source}: not inside a run directory; give the output directory with --out DIR")
    return run / "hf"


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    if args.group is not None:
        fail(f"--group was retired: use --cluster c{args.group} (a single-world checkpoint's clusters are c0, c1, …)")
    try:
        from edit_train.model.hf import param_shapes
        from edit_train.model.shards import parse_size
        from edit_train.train.export import export_checkpoint

        picked, out = export_checkpoint(Path(args.source), _out_dir(args), step=args.step,
                                        cluster=args.cluster, dtype=args.dtype, overwrite=args.overwrite,
                                        max_shard_size=parse_size(args.max_shard_size))
        n_params = sum(math.prod(s) for s in param_shapes(picked.model_cfg).values())
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        written = sorted(p.name for p in out.iterdir())
    except SystemExit:
        raise
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - every user error becomes one line
        fail(one_line(exc))
    print(f"exported {picked.what}, step {picked.step}, from {picked.where} -> {out}: {n_params:,} params, "
          f"{args.dtype}, {size / 1e6:.1f} MB; files: {_files(written)}")


def _files(names: list[str]) -> str:
    """The written files, the weight shards as one `model-000{01..NN}-of-000NN.safetensors` entry."""
    shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
    rest = [n for n in names if n not in shards]
    if shards:
        rest.insert(next((i for i, n in enumerate(rest) if n > shards[0]), len(rest)),
                    f"{shards[0]} .. {shards[-1]}" if len(shards) > 1 else shards[0])
    return ", ".join(rest)


if __name__ == "__main__":
    main()
