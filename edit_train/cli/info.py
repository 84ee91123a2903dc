"""`edit-train-info`: size a launch before spending a GPU hour. Same overrides as `edit-train`;
prints one JSON line (model built on the meta device, nothing allocated)."""

from __future__ import annotations

import json
import sys

from edit_train.cli.common import compose, fail, one_line


def estimate(cfg) -> dict:  # type: ignore[no-untyped-def]
    from edit_train.model import count_params

    counts = count_params(cfg.model)
    total = counts["total_params"]
    shard = cfg.cluster.shard_size
    param_bytes = 4  # fp32 master weights
    per_rank = {
        "params": total * param_bytes / shard,
        "grads": total * param_bytes / shard,
        "inner_optimizer": total * 8 / shard,  # AdamW exp_avg + exp_avg_sq
        "outer_anchor_and_momentum": (total * 8 / shard) if cfg.algo.local_sgd else 0,
    }
    on_device = {k: v for k, v in per_rank.items()
                 if not (k == "outer_anchor_and_momentum" and cfg.algo.outer.offload)}
    return {
        **counts,
        "active_ratio": counts["active_params"] / max(total, 1),
        "groups": cfg.cluster.groups,
        "shard_size": shard,
        "world_size": cfg.cluster.groups * shard,
        "state_bytes_per_rank": {k: int(v) for k, v in per_rank.items()},
        "device_state_bytes_per_rank": int(sum(on_device.values())),
        "note": "model/optimizer state only (fp32 weights); activations depend on batch and seq_len",
    }


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose(args)
        cfg.model.validate()
        info = estimate(cfg)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - every user error becomes one line
        fail(one_line(exc))
    model_choice = next((a.split("=", 1)[1] for a in args if a.startswith("model=")), "tiny")
    info["model"] = model_choice
    print(json.dumps(info))


if __name__ == "__main__":
    main()
