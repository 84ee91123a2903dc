"""One training step on one device, as the trainer runs it unsharded: shared by `gpu_step.py` (throughput, MFU,
peak memory) and `gpu_profile.py` (where the time goes).

The model is built on the device from a preset (`conf/model/<name>.yaml`, with the variant's overrides), the
trainer's per-layer options are applied exactly as it applies them (`edit_train.train.parallel.apply_layer_options`:
activation checkpointing, `torch.compile` of every decoder layer and of the fused head loss's kernel), its optimizer
is the trainer's (`edit_train.train.optim.build_optimizer`: AdamW, fused on CUDA), and a step is forward + backward +
optimizer step under bf16 autocast (`train.precision=bf16` on one device) on random tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from edit_train.config import TrainConfig
from edit_train.model import CausalLM
from edit_train.model.config import ModelConfig
from edit_train.model.presets import load_preset
from edit_train.train.optim import build_optimizer
from edit_train.train.parallel import apply_layer_options

RECORDS = Path(__file__).resolve().parents[1] / "results"
RESULTS = Path(__file__).resolve().parent / "results"
# tokens per step a user would run: Ling-Lite- and Ling-mini-2.0-width layers at a 4k pre-training context; the
# others as before
DEFAULT_SHAPE = {"ling_lite_slice": (2, 4096), "ling_mini_2_slice": (2, 4096)}
FALLBACK_SHAPE = (4, 2048)
# the one-GPU slices (model.num_hidden_layers as deep as one GPU holds; `--layers` overrides it) and, for a CPU
# smoke run, the CPU preset of the same architecture
SLICES = ("ling_lite_slice", "ling_mini_2_slice")
SMOKE_MODEL = {"ling_mini_2_slice": "tiny_v2", "ling_mini_2": "tiny_v2", "small_v2": "tiny_v2", "tiny_v2": "tiny_v2"}


def smoke_model(model: str) -> str:
    """What a CPU smoke run trains instead of `model`: tiny, or tiny_v2 for a Ling 2.0 model."""
    return SMOKE_MODEL.get(model, "tiny")


@dataclass(frozen=True)
class Variant:
    model: str
    compile: bool = False
    checkpointing: str = "none"
    experts: str = "grouped"
    batch: int = 4
    seq: int = 2048
    layers: int | None = None  # model.num_hidden_layers override (the slice's depth)
    loss_chunk: int | None = None  # model.loss_chunk override (0 = full logits)

    def config(self) -> ModelConfig:
        cfg = dataclasses.replace(load_preset(self.model), expert_impl=self.experts)
        if self.layers is not None:
            cfg = dataclasses.replace(cfg, num_hidden_layers=self.layers)
        if self.loss_chunk is not None:
            cfg = dataclasses.replace(cfg, loss_chunk=self.loss_chunk)
        cfg.validate()
        return cfg


def default_shape(model: str, batch: int | None, seq: int | None) -> tuple[int, int]:
    b, s = DEFAULT_SHAPE.get(model, FALLBACK_SHAPE)
    return batch or b, seq or s


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def device_slug(label: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `h100`, `NVIDIA H200` -> `h200`, `CPU (x86_64)` -> `cpu`: the file-name part."""
    low = label.lower()
    if low.startswith("cpu"):
        return "cpu"
    m = re.search(r"\b([a-z]{1,3}\d{2,4}[a-z]?)\b", low)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", low).strip("_") or "gpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Step:
    cfg: ModelConfig
    model: CausalLM
    optimizer: torch.optim.Optimizer
    run: Callable[[], None]


def build_step(v: Variant, device: torch.device) -> Step:
    """The model, optimizer and one training step of variant ``v`` on ``device`` (bf16 autocast)."""
    cfg = v.config()
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: billions of parameters are seconds on a GPU, not minutes
        model = CausalLM(cfg)
    apply_layer_options(model, v.checkpointing, v.compile, device, torch.bfloat16)
    opt = build_optimizer(model.parameters(), TrainConfig(), device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (v.batch, v.seq + 1), generator=gen).to(device)
    x, y = ids[:, :-1], ids[:, 1:]

    def run() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x, y)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Step(cfg, model, opt, run)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The tokens and model overrides of a step: ``--batch --seq --layers --loss-chunk --warmup``."""
    ap.add_argument("--batch", type=int, default=None, help="default: 2 for the slices, else 4")
    ap.add_argument("--seq", type=int, default=None, help="default: 4096 for the slices, else 2048")
    ap.add_argument("--layers", type=int, default=None, help="the slices' depth (default: the preset's)")
    ap.add_argument("--loss-chunk", type=int, default=None, help="model.loss_chunk (0: full logits)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the measured ones (absorb compilation)")


def add_output_args(ap: argparse.ArgumentParser, stem: str, suffix: str) -> None:
    """``--quick``, ``--out`` and ``--out-dir`` of a GPU benchmark that writes ``<dir>/<stem>_<device><suffix>``."""
    ap.add_argument("--quick", action="store_true", help="without a GPU: a CPU smoke run (tiny shapes, not docs/)")
    ap.add_argument("--out", type=Path, default=None, help=f"default: <out-dir>/{stem}_<device>{suffix}")
    ap.add_argument("--out-dir", type=Path, default=None, help="default: docs/ (a CPU smoke: benchmarks/results/)")


def parse_and_pick(ap: argparse.ArgumentParser, argv: list[str] | None, stem: str, suffix: str
                   ) -> tuple[argparse.Namespace, torch.device, str, Path] | None:
    """Add the output arguments, parse `argv`, pick the device: (args, device, its label, the output file), or
    None after one line on stderr (no GPU and not ``--quick``)."""
    add_output_args(ap, stem, suffix)
    args = C.parse(ap, argv)
    picked = device_and_output(args, stem, stem, suffix)
    return None if picked is None else (args, *picked)


def device_and_output(args: argparse.Namespace, tool: str, stem: str, suffix: str
                      ) -> tuple[torch.device, str, Path] | None:
    """(device, its label, the output file) — or None after one line on stderr: no GPU and not ``--quick``."""
    on_gpu = torch.cuda.is_available()
    args.quick = getattr(args, "quick", False) or getattr(args, "smoke", False)  # --smoke: the --quick shapes
    if not on_gpu and not args.quick:
        print(f"{tool}: no CUDA device here; run it on a GPU machine (or --quick for a CPU-only smoke run)",
              file=sys.stderr)
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if not on_gpu:
        torch.set_num_threads(1)
    label = device_label(device)
    folder = args.out_dir or C.SMOKE or (RECORDS if on_gpu else RESULTS)
    out = args.out or folder / f"{stem}_{device_slug(label)}{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    return device, label, out
