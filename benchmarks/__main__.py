"""The benchmark suite's one entry point: `python -m benchmarks NAME [ARGS...]`, `python -m benchmarks --list`.

Each member is `benchmarks/NAME.py`: its definition of runs and its summary, over the shared runner
(`_common.py`: the arguments every member shares, `--smoke` among them; the `edit-train` subprocess with its
one-line failure, `--reuse`, progress lines, JSON records with their command, commit and box, plots; `_tuning.py`:
the tuning grids). `python -m benchmarks NAME --smoke` runs a member in miniature into a temporary folder; the
default test suite runs every member's smoke, all of them in under 30 s (tests/benchmarks/test_benchmark_suite.py).
Records go to results/ (`results/README.md` is their generated index; a retired harness's records stay there with
the command that made them and the commit that has its source).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# every member with its one-line purpose (tests check this table against the folder)
SUITE: dict[str, str] = {
    "aggregation_scale": "verified aggregation at 6 and 8 clusters, multi-process: Byzantine clusters left out, bytes",
    "auth_cost": "what authentication (HMAC-SHA256 / Poly1305 tags) costs a sync",
    "compression": "compressed pseudo-gradients (bf16, int8, top-k, error feedback): loss and bytes per token",
    "convergence": "convergence vs communication: ddp, post-local SGD, DiLoCo, EDiT at one token budget",
    "default_outer": "the outer step's default by cluster count: the product's command at its defaults against DDP",
    "goodput": "goodput of 3 clusters while one is killed and restarted every few seconds",
    "expert_bias": "what a sync does to the expert bias (mean / global / local) on four languages: loss, MaxVio",
    "false_positives": "honest federations only: what each defence clips, leaves out or warns about; the attack columns beside",
    "gpu_codec": "the pseudo-gradient codec's encode/decode time on one GPU",
    "gpu_profile": "where a training step's time goes on one GPU (torch.profiler table)",
    "gpu_step": "one GPU, one training step: tokens/s, MFU, peak memory of a Ling-Lite slice",
    "gpu_train": "the product's own training loop on one GPU beside the harness: tokens/s, MFU, memory",
    "heterogeneity": "heterogeneous clusters at a fixed wall-clock budget: ddp, EDiT, A-EDiT (+ overlap)",
    "hf_shards": "peak memory of sharded Hugging Face import and export",
    "insiders_checked": "what each insider lie of issue 69 costs the honest clusters, before and after its check",
    "ling2_speed": "small_v2 (Ling 2.0) against small (Ling 1) tokens/s on this CPU, with where the time goes",
    "link_hosts": "a sync over a real shaped link (network namespaces) vs the link model and the planner",
    "lm_loss_memory": "peak memory of the LM head's loss at a 126k vocabulary: plain vs fused chunked",
    "loop_overhead": "edit-train's training loop against a bare loop, in alternating pairs",
    "moe_block": "the MoE block's sorted dropless dispatch vs a per-expert mask dispatch",
    "moe_sync": "expert-aware sync (experts merged by routed tokens, untouched experts left out) vs plain",
    "penalty_faults": "the verified rule against one faulty cluster: left out? what does the fault cost?",
    "plan_published": "the planner against three published results",
    "plan_scale": "how fast `edit-train plan` plans the default candidate set",
    "plan_validation": "`edit-train plan` against real runs it was never fitted to",
    "prepare_scale": "`edit-train-prepare` on corpora larger than its memory use",
    "verified_cost": "what judging the bytes costs: the verified rule against EDiT's edit_norm",
}
HELPERS = {"paired"}  # importable pieces of members, not members themselves


def members_on_disk() -> set[str]:
    return {p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_")} - HELPERS


def listing() -> str:
    width = max(map(len, SUITE))
    return "\n".join(f"{name:<{width}}  {purpose}" for name, purpose in sorted(SUITE.items()))


def run(name: str, argv: list[str]) -> int:
    """Run member `name` as `python benchmarks/NAME.py ARGV` would (its folder first on sys.path)."""
    if name not in SUITE:
        print(f"benchmarks: no member {name!r} (python -m benchmarks --list names them)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))
    sys.argv = [str(HERE / f"{name}.py"), *argv]
    os.environ["BENCH_MEMBER"] = name  # the records' `command` says `python -m benchmarks NAME ...`
    try:
        runpy.run_path(str(HERE / f"{name}.py"), run_name="__main__")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__.split("\n\n", 1)[0] + "\n\nMembers:\n" + listing())
        return 0
    if argv[0] == "--list":
        print(listing())
        return 0
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
