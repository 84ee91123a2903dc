"""Weights & Biases sink: one W&B run per cluster, all runs of an experiment in one W&B group.

Offline by default when no API key is configured, so nothing blocks or phones home.
"""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        auth = netrc.netrc().authenticators("api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return auth is not None


def resolve_mode(mode: str | None) -> str:
    if mode:
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if _has_credentials() else "offline"


class WandbSink:
    """Logs `train`/`eval`/`moe` events against the step and `sync` events against the sync index."""

    def __init__(self, run_dir: Path, project: str, entity: str | None, mode: str | None,
                 experiment: str, job_type: str, name: str, config: dict[str, Any],
                 tags: list[str] | None = None, run_id: str | None = None) -> None:
        import wandb

        self._wandb = wandb
        self.mode = resolve_mode(mode)
        self.run = wandb.init(
            project=project, entity=entity, mode=self.mode, dir=str(run_dir), group=experiment,
            job_type=job_type, name=name, config=config, tags=tags or [], id=run_id,
            resume="allow" if run_id else None, reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("sync/sync")
        for prefix in ("train", "eval", "moe"):
            self.run.define_metric(f"{prefix}/*", step_metric="step")
        self.run.define_metric("sync/*", step_metric="sync/sync")

    @property
    def run_id(self) -> str:
        return str(self.run.id)

    def log(self, event: str, record: dict[str, Any]) -> None:
        flat: dict[str, Any] = {}
        for key, value in record.items():
            if isinstance(value, bool):
                flat[f"{event}/{key}"] = float(value)
            elif isinstance(value, (int, float)):
                flat[f"{event}/{key}"] = value
        if event == "sync":
            flat["sync/sync"] = record.get("sync", 0)
            flat.update(maxvio_metrics(record.get("expert_bias")))
        else:
            flat["step"] = record.get("step", 0)
        self.run.log(flat)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary:
            for key, value in summary.items():
                if isinstance(value, (int, float, str, bool)):
                    self.run.summary[key] = value
        self.run.finish()
        # one W&B run per process: shutting the service down here guarantees the offline files are complete
        self._wandb.teardown()


def maxvio_metrics(expert_bias: Any) -> dict[str, float]:
    """algo.expert_bias's MaxVio of a `sync` event as W&B metrics: `sync/maxvio/<cluster or federation>` (the mean
    over the MoE layers) and `.../layer<i>` per MoE layer."""
    if not isinstance(expert_bias, dict) or not isinstance(expert_bias.get("maxvio"), dict):
        return {}
    mv = expert_bias["maxvio"]
    series = {**{str(k): v for k, v in (mv.get("clusters") or {}).items()}, "federation": mv.get("federation") or []}
    out: dict[str, float] = {}
    for who, layers in series.items():
        values = [float(v) for v in layers if isinstance(v, (int, float))]
        if values:
            out[f"sync/maxvio/{who}"] = sum(values) / len(values)
            out.update({f"sync/maxvio/{who}/layer{i}": v for i, v in enumerate(values)})
    return out

