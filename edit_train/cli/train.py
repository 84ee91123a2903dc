"""`edit-train`: the Hydra app. Trains in this process (one rank of one cluster under torchrun / Slurm,
or a lone one-rank cluster), or starts a local federation: a Lighthouse and one job per cluster."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from edit_train.cli import checks
from edit_train.cli.common import CONF_DIR, add_overrides, equal_clusters, fail, one_line, setup_logging
from edit_train.local_sgd.errors import ClusterError

def _user_errors() -> tuple[type[BaseException], ...]:
    from omegaconf.errors import MissingMandatoryValue

    from edit_train.config import ConfigError
    from edit_train.data import DataError
    from edit_train.cluster.mesh import TopologyError
    from edit_train.sim.faults import FaultError
    from edit_train.local_sgd.errors import FederationError
    from edit_train.train.checkpoint import CheckpointError

    return (ConfigError, DataError, TopologyError, FaultError, CheckpointError, FederationError, ValueError,
            MissingMandatoryValue)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch(cfg: Any) -> dict[str, Any] | None:
    """One rank of one cluster (under torchrun / our launcher), a lone one-rank cluster in this process,
    or a local federation: a Lighthouse and one supervised job per cluster."""
    from edit_train.config import cluster_specs, validate
    from edit_train.train.build import my_cluster
    from edit_train.train.runlock import job_lock
    from edit_train.train.trainer import train

    validate(cfg)
    checks.check_data(cfg)  # (again: a sweep skips the precheck) every cluster's tokenizer agrees, before any starts
    specs = cluster_specs(cfg)
    if under_torchrun() or os.environ.get("EDIT_TRAIN_CLUSTER") or (
            len(specs) == 1 and specs[0].ranks == 1 and not cfg.federation.lighthouse and not cfg.cluster.only):
        checks.nothing_left(cfg, specs, my_cluster(cfg, specs).name)
        with job_lock(cfg, specs):  # rank 0 holds run.dir/clusters/<cluster>.lock while it trains
            return train(cfg)
    from edit_train.cli.launcher import run_local

    checks.check_run_lock(cfg)  # (again: a sweep skips the precheck) before the launcher writes anything
    checks.nothing_left(cfg, specs, None)
    from edit_train.fields import check_host_here

    check_host_here("federation.host", os.environ.get("EDIT_TRAIN_HOST") or cfg.federation.host)
    try:
        run_dir, jobs = run_local(cfg)
    except KeyboardInterrupt:
        fail(checks.interrupted_message(cfg.run.dir, detail="every cluster and the Lighthouse stopped",
                                        every=cfg.checkpoint.every), code=130)
    failed = [j for j in jobs if j.state == "failed"]
    if failed:
        user = any(c == 2 for j in failed for c in j.exit_codes)  # one line above says what to fix: not restarted
        fail(f"cluster(s) {[j.spec.name for j in failed]} failed (exit codes {[j.exit_codes for j in failed]}); "
             "see the messages above", code=2 if user else 1)
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() else None


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
    run_dir = str(dcfg.run.dir)
    try:
        cfg = OmegaConf.to_object(dcfg)
        if checks.RESUMED:  # a resume: the run's own configuration (checks.own_config), not the command line's
            from edit_train.config import from_container

            cfg = from_container(checks.RESUMED[0])
        _multirun_dir(cfg)
        run_dir = cfg.run.dir
        checks.follow_tokenizer(cfg)  # model.vocab_size follows the tokenizer unless set explicitly
        summary = launch(cfg)
    except SystemExit:
        raise
    except ClusterError as exc:  # under torchrun: this cluster's ranks lost each other (restartable, exit 1)
        fail(f"cluster {os.environ.get('EDIT_TRAIN_CLUSTER', '-')}: {one_line(exc)}", code=1)
    except _user_errors() as exc:
        checks.fail_user_error(exc)  # one line; config/topology errors from rank 0 only
    except KeyboardInterrupt:
        fail(checks.interrupted_message(run_dir), code=130)
    except OSError as exc:
        if exc.errno not in checks.UNWRITABLE:
            raise
        fail(checks.unwritable_message(exc, run_dir))  # exit 2: a launcher does not restart what cannot write
    except Exception as exc:  # noqa: BLE001
        from edit_train.train.signals import Interrupted

        if isinstance(exc, Interrupted):
            fail(checks.interrupted_message(run_dir, detail=str(exc)), code=130)
        if checks.cut_short(exc):  # an error of the code a Ctrl-C unwound: the interrupt is what happened
            fail(checks.interrupted_message(run_dir), code=130)
        raise
    if summary and int(os.environ.get("RANK", "0")) == 0:  # every launch path ends with the closing block
        from edit_train.config import cluster_specs

        # a cluster's own job (torchrun / Slurm, EDIT_TRAIN_CLUSTER set): its numbers first, then the federation's
        print(closing_block(summary, str(cfg.run.dir), cluster=os.environ.get("EDIT_TRAIN_CLUSTER"),
                            expected=[s.name for s in cluster_specs(cfg)]), flush=True)


def time_split(t: dict[str, float]) -> str:
    """`compute 80% · blocked 3% · …`: the buckets of `per_cluster.time` worth 0.5% or more, largest first."""
    wall = max(t.get("wall_s", 0.0), 1e-9)
    shares = sorted(((k, v / wall) for k, v in t.items() if k != "wall_s" and v / wall >= 0.005),
                    key=lambda kv: -kv[1])
    return " · ".join(f"{k} {v:.0%}" for k, v in shares) + f" of {t.get('wall_s', 0.0):.0f}s"


def local_steps_text(steps: list[int]) -> str:
    """The local steps of a cluster's syncs, for the closing block: each of them when there are at most 4
    (`32 and 8 local steps`: a 40-step run at H=32; their median, 20, is a count no sync had), else their
    true median (`median 16 local steps each`; of an even count, the mean of the middle two)."""
    import statistics

    if not steps:
        return ""
    if len(steps) <= 4:
        listed = ", ".join(str(s) for s in steps[:-1]) + (" and " if len(steps) > 1 else "") + str(steps[-1])
        return f"{listed} local steps"
    return f"median {statistics.median(steps):g} local steps each"


def outer_text(o: dict[str, Any]) -> str:
    """`lr 0.5, momentum 0.5 Nesterov (lr and momentum: the default for 2 clusters, interval 8; docs/algorithms.md)`:
    summary.json's `outer` (config.py `OuterStep.record`) for the closing block."""
    text = f"lr {o['lr']:g}, momentum {o['momentum']:g}{' Nesterov' if o.get('nesterov') else ''}"
    if o.get("optimizer", "SGD") != "SGD":
        text = f"{o['optimizer']}, {text}"
    unset = list(o.get("default_for") or [])
    if not unset:
        return f"{text} (as set)"
    n = o.get("clusters")
    return (f"{text} ({' and '.join(unset)}: the default for {n} cluster{'s' if n != 1 else ''}, interval "
            f"{o.get('interval')}; docs/algorithms.md)")


def _run_line(rec: dict[str, Any], run_dir: str) -> str:
    init = rec.get("initial_val_loss")
    val = f"{init:.3f} -> {rec['final_val_loss']:.3f}" if init is not None else f"{rec['final_val_loss']:.3f}"
    down = rec.get("downtime_s") or 0.0  # between launches: not run time (train/summary.py)
    down_text = f" (and {down:.1f}s down between launches)" if down >= 0.05 else ""
    return (f"{rec['steps']} steps, {rec['tokens']:,} tokens in {rec['wall_s']:.1f}s{down_text}, val loss {val}; "
            f"run dir {run_dir}")


def closing_block(summary: dict[str, Any], run_dir: str, cluster: str | None = None,
                  expected: list[str] | None = None) -> str:
    """What happened, in a few lines: the run, then (for a federation) each cluster and the traffic.

    `cluster`: said by that cluster's own job (torchrun / Slurm), whose `summary` is the merge of the clusters
    finished so far: the first line is its own record, then what the federation's summary holds, and who is
    still training (of `expected`, the configured clusters). Bytes in binary units, as the report says them."""
    from edit_train.report.model import human_bytes

    clusters = summary.get("per_cluster", {})
    own = clusters.get(cluster) if cluster else None
    completed = summary.get("completed", True)
    if own is not None and (len(clusters) > 1 or not completed):
        lines = [f"done: cluster {cluster}, {_run_line(own, run_dir)}"]
    else:
        lines = [f"done: {_run_line(summary, run_dir)}"]
    # the configured clusters and those that joined mid-run (a record of their own, or this job's cluster)
    expected = list(dict.fromkeys([*(expected or []), *clusters, *([cluster] if cluster else [])])) if expected \
        else expected
    if len(clusters) > 1 or (own is not None and not completed):
        n = (f"{len(clusters)} of {len(expected)} clusters so far" if expected and not completed
             else f"{len(clusters)} cluster{'s' if len(clusters) > 1 else ''}" + ("" if completed else " so far"))
        lines.append(f"  {summary['algo']} across {n}, {summary['syncs']} syncs, "
                     f"{summary['anomalies']} anomalous module decisions, "
                     f"{human_bytes(summary['cross_cluster_bytes'])} over the cross-cluster link, "
                     f"goodput {summary.get('goodput', 0):.2f}")
        for name, c in clusters.items():
            t = c.get("time")  # the time account: waiting for the federation at start-up is start-up there
            blocked = t["blocked"] / max(t["wall_s"], 1e-9) if t else c["blocked_frac"]
            steps = local_steps_text(list(c.get("local_steps") or []))
            lines.append(f"  cluster {name}: {c['ranks']} rank(s), {c['steps']} steps at {c['tokens_per_s']:,.0f} "
                         f"tokens/s, {c['syncs_joined']} syncs joined ({c['syncs_missed']} missed"
                         f"{', ' + steps if steps else ''}), blocked {blocked:.1%} of the time, "
                         f"{c['anomalies']} anomalous syncs, {c['restarts']} restarts")
            if c.get("time"):
                lines.append(f"    time: {time_split(c['time'])}")
        if not completed:
            waiting = [name for name in expected or [] if name not in clusters]
            lines.append("  summary.json is not complete yet" + (f": {', '.join(waiting)} still training" if waiting
                         else "") + " (the last cluster to finish completes it)")
    elif len(clusters) == 1 and next(iter(clusters.values())).get("time"):
        lines.append(f"  time: {time_split(next(iter(clusters.values()))['time'])}")
    if summary.get("outer"):
        lines.append(f"  outer step: {outer_text(summary['outer'])}")
    lines.append(f"  report: edit-train-report {run_dir}")
    return "\n".join(lines)


def main() -> None:
    """The console entry point. Ctrl-C before the run's own handlers are up (imports, composing the config,
    Hydra's start) is one line, never an import traceback; a torchrun worker dies with its torchrun."""
    guards: list[checks.RunDirGuard] = []
    try:
        if under_torchrun():
            from edit_train.cli.parent import die_with_torchrun

            die_with_torchrun()  # a SIGKILLed torchrun takes its workers (and their run locks) with it
        _main(guards)
    except SystemExit as exc:
        if exc.code == 2 and under_torchrun():
            no_restart()  # a configuration error: torchrun must not start this worker again (cli/torchrun_wrap.py)
        raise
    except KeyboardInterrupt:
        for guard in guards:
            guard.cleanup()  # Hydra may have created run.dir already: a start-up Ctrl-C leaves nothing behind
        run_dir = guards[0].path if guards else None
        fail(checks.interrupted_message(run_dir, detail="during start-up") if run_dir is not None and run_dir.is_dir()
             else "interrupted during start-up: nothing was written", code=130)


def no_restart(wait_s: float = 30.0) -> None:
    """This torchrun worker failed with a configuration error (exit 2, its one line said): torchrun would restart it
    `--max-restarts` times, whatever the code. Under launchers/torchrun_multinode.sh (its wrapper names the file in
    $EDIT_TRAIN_NO_RESTART_FILE) tell the wrapper, which stops torchrun, and wait to be stopped with it, so torchrun
    never sees a failed worker to restart. Elsewhere (plain torchrun): nothing."""
    import signal
    import time

    path = os.environ.get("EDIT_TRAIN_NO_RESTART_FILE")
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')}\n")
    except OSError:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's stop ends this process at once
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.2)


def _main(guards: list[checks.RunDirGuard]) -> None:
    import hydra

    from edit_train.cli.help import help_text, wants_help
    from edit_train.config import register_configs
    from edit_train.retired import renamed_overrides
    from edit_train.sim.switch import real_preset

    if sys.argv[1:2] == ["plan"]:  # `edit-train plan ...`: the planner (its own config tree, conf/plan/)
        from edit_train.cli.plan import main as plan_main

        return plan_main(sys.argv[2:])
    if wants_help(sys.argv[1:]):
        print(help_text())
        return
    if under_torchrun() and os.environ.get("RANK", "0") == "0":  # the job's first line at once, not after the imports
        print(f"edit-train: cluster {os.environ.get('EDIT_TRAIN_CLUSTER') or '-'}: rank 0 starting (reading the "
              "config, loading torch, the data and the model)", flush=True)
    register_configs()
    sys.argv[1:] = renamed_overrides(sys.argv[1:])  # `cluster.groups=2`: read as cluster.count=2, with a warning
    # next to the user's overrides, never between a flag and them (`--cfg job cluster.count=3`)
    sys.argv[1:] = add_overrides(sys.argv[1:], equal_clusters(sys.argv[1:]))  # `cluster.count=N` alone: N equal
    sys.argv[1:] = add_overrides(sys.argv[1:], real_preset(sys.argv[1:]))  # a real federation's job: cluster=real
    # compose + validate + run.dir checks before Hydra creates run.dir (single runs; see cli/checks.py)
    guard, added = checks.precheck(sys.argv[1:])
    sys.argv[1:] = add_overrides(sys.argv[1:], added)
    if guard is not None:
        guards.append(guard)
    try:
        hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")(_task)()
    except SystemExit as exc:
        if guard is not None and exc.code not in (0, None):
            guard.cleanup()  # a failed run leaves no empty run directory behind
        raise


if __name__ == "__main__":
    main()
