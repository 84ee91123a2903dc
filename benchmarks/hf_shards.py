"""Peak memory of sharded Hugging Face import and export (issue 39, acceptance 2).

For each size a Ling-Lite-shaped BailingMoe checkpoint (the public config's widths: hidden 2048, 64 experts of
1408 + 2 shared, 16/4 heads of 128, vocabulary 126,464; random bf16 weights) is written in shards by this
script, tensor by tensor. Then, each in a fresh process:

* **import** — ``load_hf_into`` into a bf16 ``CausalLM`` whose memory is already touched (the model's own share
  is the baseline);
* **export** — ``export_hf`` of that model back to shards of the same size;

and the exported tensors are compared with the written ones, one at a time (bit-exact: bf16 -> bf16). Peak RSS
above the process's baseline comes from the kernel (``/proc/self/clear_refs`` resets ``VmHWM``), so file pages
the safetensors reader maps count too. The full Ling-Lite (28 layers, 16.8 B parameters, 33.6 GB in bf16) does
not fit a 24 GiB box beside a model holding it, so the sizes are Ling-Lite with fewer layers; what the
measurement shows is whether the peak above the model grows with the model (it should not: about one shard).

    python benchmarks/hf_shards.py --layers 1,2,4 --shard-size 1GB --out results/hf_shards.json
    python benchmarks/hf_shards.py --quick            # one layer, 512 MB shards

Generated checkpoints live under ``--dir`` (default: a temporary directory) and are deleted after each size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from edit_train.model.config import ModelConfig  # noqa: E402

HERE = Path(__file__).resolve()


def ling_lite_shaped(layers: int) -> ModelConfig:
    from edit_train.model.presets import load_preset

    return dataclasses.replace(load_preset("ling_lite"), num_hidden_layers=layers)


def smoke_shaped() -> ModelConfig:
    """Ling-Lite's layout (shared experts, the head as Ling has it) at the tiny preset's widths: --smoke's size."""
    from edit_train.model.presets import load_preset

    tiny = load_preset("tiny")
    return dataclasses.replace(load_preset("ling_lite"), **{f.name: getattr(tiny, f.name) for f in dataclasses.fields(
        tiny) if f.name in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
                            "num_key_value_heads", "num_experts", "num_experts_per_tok", "vocab_size", "head_dim",
                            "num_hidden_layers")})


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


class Peak:
    """Peak RSS above the RSS at entry (Linux: VmHWM reset through /proc/self/clear_refs)."""

    def __enter__(self) -> "Peak":
        self.baseline = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.above = max(0, _status("VmHWM") - self.baseline)


# ------------------------------------------------------------------------------------------ phases
def phase_write(cfg: ModelConfig, directory: Path, shard_bytes: int) -> dict[str, Any]:
    """A BailingMoe directory with random bf16 weights, written tensor by tensor into shards, in the public
    (Ling) encoding: a raw head with ``norm_head`` as the config has it."""
    from edit_train.model.hf import TRAINED_HEAD_KEY, hf_param_shapes, to_hf_config
    from edit_train.model.shards import ShardWriter

    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    with Peak() as peak:
        writer = ShardWriter(directory, shard_bytes)
        for name, shape in hf_param_shapes(cfg).items():
            writer.add(name, torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen))
        files = writer.close()
    literal = {k: v for k, v in to_hf_config(cfg, torch.bfloat16).items() if k != TRAINED_HEAD_KEY}
    literal.update(norm_head=cfg.norm_head, tie_word_embeddings=cfg.tie_word_embeddings)
    (directory / "config.json").write_text(json.dumps(literal))
    return {"seconds": peak.seconds, "peak_above_baseline": peak.above, "files": len(files)}


def _touched_model(cfg: ModelConfig) -> torch.nn.Module:
    """A bf16 CausalLM whose parameter memory is allocated and touched (no random init: it is overwritten)."""
    from edit_train.model.transformer import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def phase_round_trip(cfg: ModelConfig, src: Path, dst: Path, shard_bytes: int) -> dict[str, Any]:
    """Import ``src`` into a model, then export the model to ``dst``; peak RSS above baseline of each."""
    from edit_train.model.hf_io import export_hf, load_hf_into

    model = _touched_model(cfg)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with Peak() as imp:
        load_hf_into(model, src)
    with Peak() as exp:
        export_hf(model, None, dst, dtype=torch.bfloat16, max_shard_size=shard_bytes)
    return {"model_bytes": model_bytes, "rss_with_model": _status("VmRSS"),
            "import": {"seconds": imp.seconds, "peak_above_baseline": imp.above},
            "export": {"seconds": exp.seconds, "peak_above_baseline": exp.above}}


def phase_compare(src: Path, dst: Path) -> dict[str, Any]:
    """Every tensor of ``src`` equals ``dst``'s of the same name (bit-exact), one pair in memory at a time; with
    ``norm_head`` the export holds the head normalised (the served encoding), bit-exactly what Ling's code
    multiplies with."""
    from safetensors import safe_open

    from edit_train.model.hf import normalized_head
    from edit_train.model.shards import iter_tensors, weight_files

    norm_head = bool(json.loads((src / "config.json").read_text()).get("norm_head"))

    src_files, _ = weight_files(src)
    dst_files, _ = weight_files(dst)
    where = {name: path for path, names in dst_files.items() for name in names}
    n, differ = 0, []
    for name, t in iter_tensors(src_files):
        with safe_open(str(where[name]), framework="pt") as f:
            want = normalized_head(t) if norm_head and name == "lm_head.weight" else t
            if not torch.equal(want, f.get_tensor(name)):
                differ.append(name)
        n += 1
    missing = set(where) - {name for names in src_files.values() for name in names}
    return {"tensors": n, "differ": differ[:5], "extra_in_export": sorted(missing)[:5],
            "equal": not differ and not missing}


def _run_phase(phase: str, cfg: ModelConfig, work: Path, shard_bytes: int) -> dict[str, Any]:
    """One phase in a fresh process (its own baseline and peak; under --smoke in this one); its JSON result."""
    if C.SMOKE is not None:
        return run_phase(phase, cfg, work, shard_bytes)
    arg = json.dumps({"phase": phase, "cfg": dataclasses.asdict(cfg), "work": str(work), "shard": shard_bytes})
    proc = subprocess.run([sys.executable, str(HERE), "--phase", arg], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    if proc.returncode != 0:
        raise RuntimeError(f"phase {phase} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _phase_main(arg: str) -> None:
    a = json.loads(arg)
    print(json.dumps(run_phase(a["phase"], ModelConfig(**a["cfg"]), Path(a["work"]), int(a["shard"]))))


def run_phase(phase: str, cfg: ModelConfig, work: Path, shard: int) -> dict[str, Any]:
    if phase == "write":
        return phase_write(cfg, work / "src", shard)
    if phase == "round_trip":
        return phase_round_trip(cfg, work / "src", work / "dst", shard)
    return phase_compare(work / "src", work / "dst")


def measure(cfg: ModelConfig, shard_bytes: int, root: Path) -> dict[str, Any]:
    """Write, import + export, compare one size; the generated directories are deleted afterwards."""
    from edit_train.model.presets import count_params

    work = Path(tempfile.mkdtemp(prefix="hf-shards-", dir=root))
    try:
        write = _run_phase("write", cfg, work, shard_bytes)
        trip = _run_phase("round_trip", cfg, work, shard_bytes)
        same = _run_phase("compare", cfg, work, shard_bytes)
        disk = sum(p.stat().st_size for p in (work / "src").glob("*.safetensors"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    params = count_params(cfg)["total_params"]
    row = {"layers": cfg.num_hidden_layers, "params": params, "shard_bytes": shard_bytes, "files": write["files"],
           "checkpoint_bytes": disk, "write": write, **trip, "round_trip": same}
    for what in ("write", "import", "export"):
        row[what]["x_shard"] = round(row[what]["peak_above_baseline"] / shard_bytes, 3)
    return row


def main() -> None:
    p = C.parser(__doc__, out="hf_shards.json")
    p.add_argument("--layers", default="1,2,4", help="Ling-Lite-shaped sizes to measure (decoder layers)")
    p.add_argument("--shard-size", default="1GB", help="shard size for writing and exporting (default 1GB)")
    p.add_argument("--dir", default=None, help="where the generated checkpoints go (default: the temp dir)")
    p.add_argument("--quick", action="store_true", help="one layer, 512MB shards")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = C.parse(p)
    if args.phase:
        _phase_main(args.phase)
        return
    from edit_train.model.shards import parse_size

    layers = [1] if args.quick or args.smoke else [int(x) for x in args.layers.split(",")]
    shard = parse_size("1MB" if args.smoke else "512MB" if args.quick else args.shard_size)
    root = Path(args.dir or C.SMOKE or tempfile.gettempdir())
    rows = []
    for n in layers:  # --smoke: Ling-Lite's layout at the tiny preset's widths, each phase in this process
        row = measure(smoke_shaped() if args.smoke else ling_lite_shaped(n), shard, root)
        rows.append(row)
        print(f"ling_lite x {n:>2} layers: {row['params'] / 1e9:6.2f} B params, {row['checkpoint_bytes'] / 1e9:6.2f} GB "
              f"in {row['files']} files; peak RSS above baseline: write {row['write']['x_shard']:.2f}, import "
              f"{row['import']['x_shard']:.2f}, export {row['export']['x_shard']:.2f} x one shard "
              f"({shard / 1e9:.2f} GB); round trip {'exact' if row['round_trip']['equal'] else 'DIFFERS'}", flush=True)
    full = ling_lite_shaped(28)
    from edit_train.model.presets import count_params

    result = {"benchmark": "hf_shards", "dtype": "bfloat16", "shard_bytes": shard, "rows": rows,
              "ling_lite_full": {"layers": 28, "params": count_params(full)["total_params"],
                                 "bf16_bytes": 2 * count_params(full)["total_params"]},
              "command": " ".join([os.path.basename(sys.executable), "benchmarks/hf_shards.py", *sys.argv[1:]]),
              "host": {"cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
                       "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
              "torch": torch.__version__}
    print(f"wrote {C.write_json(args.out, result)}")


if __name__ == "__main__":
    main()
