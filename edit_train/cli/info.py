"""`edit-train-info`: size a launch before spending a GPU hour. Same overrides as `edit-train`, plus
`--gpu-mem-gb X` (GiB per GPU); prints one JSON line (model built on the meta device, nothing allocated)
with the per-rank memory plan of `edit_train.memplan`."""

from __future__ import annotations

import json
import sys

from edit_train.cli.common import compose, fail, one_line


def estimate(cfg, gpu_mem_gb: float | None = None) -> dict:  # type: ignore[no-untyped-def]
    from edit_train.memplan import plan_for_config
    from edit_train.model import count_params
    from edit_train.expert_plan import subsets_plan
    from edit_train.train.mfu import flops_per_token

    counts = count_params(cfg.model)
    total = counts["total_params"]
    shard = cfg.cluster.ranks
    param_bytes = 4  # fp32 master weights
    per_rank = {
        "params": total * param_bytes / shard,
        "grads": total * param_bytes / shard,
        "inner_optimizer": total * 8 / shard,  # AdamW exp_avg + exp_avg_sq
        "outer_anchor_and_momentum": (total * 8 / shard) if cfg.algo.local_sgd else 0,
    }
    on_device = {k: v for k, v in per_rank.items()
                 if not (k == "outer_anchor_and_momentum" and cfg.algo.outer.offload)}
    main = {"total_params": total - counts["mtp_params"],  # what a model card counts: the MTP layers left out
            "active_params": counts["active_params"] - counts["mtp_active_params"],
            "non_embedding_active_params": counts["non_embedding_active_params"] - counts["mtp_active_params"]}
    return {
        **counts,
        "without_mtp": main,
        "active_ratio": counts["active_params"] / max(total, 1),
        "clusters": cfg.cluster.count,
        "ranks": shard,  # per cluster
        "total_ranks": cfg.cluster.count * shard,
        "state_bytes_per_rank": {k: int(v) for k, v in per_rank.items()},
        "device_state_bytes_per_rank": int(sum(on_device.values())),
        "flops_per_token": flops_per_token(cfg.model, cfg.train.seq_len, counts["active_params"]),
        "memory_plan": plan_for_config(cfg, gpu_mem_gb),
        **({"expert_subsets": subsets} if (subsets := subsets_plan(cfg)) else {}),  # what each cluster saves
    }


USAGE = """usage: edit-train-info [GROUP=OPTION ...] [KEY=VALUE ...]

Size a launch before spending a GPU hour: takes the same overrides as edit-train and prints one JSON line
with total_params, active_params (per token), non_embedding_active_params, the MTP layers' share and the
counts without them (what a model card quotes), the model/optimizer state bytes per rank and a
per-rank memory plan (--gpu-mem-gb X says whether it fits an X GiB GPU). The model is
built on the meta device; nothing is allocated and nothing is trained.

example: edit-train-info model=ling_lite cluster.ranks=8 --gpu-mem-gb 80"""


def _pop_gpu_mem(args: list[str]) -> float | None:
    """Remove `--gpu-mem-gb X` / `--gpu-mem-gb=X` from `args` (the rest are Hydra overrides)."""
    for i, a in enumerate(args):
        if a == "--gpu-mem-gb" or a.startswith("--gpu-mem-gb="):
            value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            del args[i:i + (1 if "=" in a else 2)]
            try:
                gb = float(value)
            except ValueError:
                gb = -1.0
            if not gb > 0:
                fail(f"--gpu-mem-gb: needs a positive number of GiB per GPU, got {value!r}")
            return gb
    return None


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return
    gpu_mem_gb = _pop_gpu_mem(args)
    try:
        cfg = compose(args)
        from edit_train.cli.checks import adopt_tokenizer_vocab, explicit_override

        adopt_tokenizer_vocab(cfg, explicit_override(args, "model.vocab_size"))
        cfg.model.validate()
        info = estimate(cfg, gpu_mem_gb)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - every user error becomes one line
        fail(one_line(exc))
    model_choice = next((a.split("=", 1)[1] for a in args if a.startswith("model=")), "tiny")
    info["model"] = model_choice
    print(json.dumps(info))


if __name__ == "__main__":
    main()
