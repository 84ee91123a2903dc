"""`edit-train`: the Hydra app. Spawns one process per rank on this host (through torch's elastic
launcher, the machinery behind torchrun) unless it is already running under torchrun."""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from edit_train.cli.common import CONF_DIR, compose, fail, one_line, setup_logging

def _user_errors() -> tuple[type[BaseException], ...]:
    from edit_train.config import ConfigError
    from edit_train.data import DataError
    from edit_train.dist.mesh import TopologyError
    from edit_train.sim.faults import FaultError
    from edit_train.train.checkpoint import CheckpointError

    return (ConfigError, DataError, TopologyError, FaultError, CheckpointError, ValueError)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def spawn_local(cfg: Any, world: int) -> dict[str, Any] | None:
    """Run `world` worker processes on this host with torch's elastic launcher."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from edit_train.config import to_container

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "launch_config.json"
    cfg_path.write_text(json.dumps(to_container(cfg), indent=1))
    threads = max(1, (os.cpu_count() or 1) // world)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"edit-train-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=cfg.run.max_restarts,
                          monitor_interval=0.2, start_method="spawn")
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        elastic_launch(launch, entrypoint=sys.executable)("-m", "edit_train.cli.worker", str(cfg_path))
    except (SignalException, KeyboardInterrupt):
        fail(f"interrupted: all {world} workers stopped; the newest complete checkpoint in "
             f"{run_dir / 'checkpoints'} is intact (resume=auto continues)", code=130)
    except ChildFailedError as exc:
        if all(f.exitcode in (130, -2, -15) for f in exc.failures.values()):
            fail(f"interrupted: all {world} workers stopped; resume=auto continues from the newest checkpoint",
                 code=130)
        ranks = sorted(exc.failures)
        first = exc.failures[ranks[0]]
        fail(f"worker rank(s) {ranks} failed (exit code {first.exitcode}); see the messages above", code=1)
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() else None


def launch(cfg: Any) -> dict[str, Any] | None:
    from edit_train.config import validate
    from edit_train.train.trainer import train

    validate(cfg)
    world = cfg.cluster.groups * cfg.cluster.shard_size
    if under_torchrun() or world == 1:
        return train(cfg)
    return spawn_local(cfg, world)


def _multirun_dir(cfg: Any) -> None:
    """In a Hydra sweep each job gets its own run directory (unless run.dir was set per job)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN and not any(o.startswith("run.dir=") for o in hc.overrides.task):
        cfg.run.dir = hc.runtime.output_dir


def _task(dcfg: Any) -> None:
    from omegaconf import OmegaConf

    setup_logging(int(os.environ.get("RANK", "0")))
    try:
        cfg = OmegaConf.to_object(dcfg)
        _multirun_dir(cfg)
        summary = launch(cfg)
    except SystemExit:
        raise
    except _user_errors() as exc:
        fail(one_line(exc))
    except KeyboardInterrupt:
        fail("interrupted; resume=auto continues from the newest complete checkpoint", code=130)
    except Exception as exc:  # noqa: BLE001
        from edit_train.train.trainer import Interrupted

        if isinstance(exc, Interrupted):
            fail(f"interrupted ({exc}); resume=auto continues from the newest complete checkpoint", code=130)
        raise
    if summary and int(os.environ.get("RANK", "0")) == 0:
        init = summary.get("initial_val_loss")
        val = f"{init:.3f} -> {summary['final_val_loss']:.3f}" if init is not None else f"{summary['final_val_loss']:.3f}"
        print(f"done: {summary['steps']} steps, {summary['tokens']:,} tokens in {summary['wall_s']:.1f}s, "
              f"val loss {val}; run dir {cfg.run.dir}", flush=True)


def _precheck(argv: list[str]) -> None:
    """Compose once before Hydra runs so a bad override fails in one line (single runs only)."""
    if any(a in ("-m", "--multirun") or a.startswith("-") for a in argv):
        return
    try:
        compose(argv)
    except Exception as exc:  # noqa: BLE001
        fail(one_line(exc))


def main() -> None:
    import hydra

    from edit_train.config import register_configs

    register_configs()
    _precheck(sys.argv[1:])
    hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")(_task)()


if __name__ == "__main__":
    main()
