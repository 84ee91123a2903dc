"""One rank of a locally spawned job: `python -m edit_train.cli.worker RUN_DIR/launch_config.json`.
The config is the launcher's resolved JSON, so every rank agrees on it and on the run directory."""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    try:
        _main(args)
    except KeyboardInterrupt:
        interrupted_starting()


def interrupted_starting() -> None:
    """Ctrl-C while this rank starts (importing torch, reading the config, building the model): its launcher, in the
    same process group, got it too and says the one line. No traceback per worker, and no exit handlers: a torch
    import cut short leaves its atexit hooks (FakeTensor's cache statistics) and logging half set up."""
    sys.stderr.flush()
    os._exit(130)


def _main(args: list[str]) -> None:
    from edit_train.cli.common import fail, one_line, setup_logging

    if len(args) != 1:
        fail("usage: python -m edit_train.cli.worker CONFIG.json")
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from edit_train.cli.train import _user_errors
    from edit_train.cli.checks import nothing_left
    from edit_train.config import cluster_specs, from_container
    from edit_train.train.build import my_cluster
    from edit_train.local_sgd.errors import ClusterError
    from edit_train.train.signals import Interrupted
    from edit_train.train.runlock import job_lock
    from edit_train.train.trainer import train

    try:
        cfg = from_container(json.loads(open(args[0]).read()))
        specs = cluster_specs(cfg)
        nothing_left(cfg, specs, my_cluster(cfg, specs).name)  # finished (a restart after the end): exit 0
        with job_lock(cfg):  # rank 0 holds run.dir/clusters/<cluster>.lock while it trains
            train(cfg)
    except ClusterError as exc:  # this cluster's ranks lost each other: restartable (exit 1), alone
        fail(f"cluster {os.environ.get('EDIT_TRAIN_CLUSTER', '-')} rank {rank}: {one_line(exc)}", code=1)
    except _user_errors() as exc:
        fail(f"cluster {os.environ.get('EDIT_TRAIN_CLUSTER', '-')} rank {rank}: {one_line(exc)}")
    except (Interrupted, KeyboardInterrupt):
        raise SystemExit(130) from None


def _exit_without_teardown(code: int = 0) -> None:
    """Leave a rank that finished cleanly without running C++ static destructors: gloo's and the TCPStore's
    background threads can still be joinable then, and destroying a joinable std::thread aborts the process
    ("terminate called without an active exception", seen on 2-rank FSDP2 runs after the final checkpoint).
    Everything that matters is already on disk: train() closed metrics, W&B and the process group."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # between main's return and here, or before main ran its try
        interrupted_starting()
    except SystemExit as stop:  # its one line is said: no teardown either (a background thread still inside
        # gloo or torchft when the interpreter finalizes is unwound by force, and a C++ catch-all that swallows
        # that unwind aborts with a raw "FATAL: exception not rethrown": seen on a Lighthouse stop)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        _exit_without_teardown(stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1))
    _exit_without_teardown()
