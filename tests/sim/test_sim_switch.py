"""Simulation only when asked (issue 48, problem 1): a cluster job of a real federation (under torchrun, or
given federation.lighthouse / cluster.only / federation.host) gets no simulated link, slowdown or faults, and a
simulated setting it names is refused in one line; a local run keeps the demo's simulation. And every process
a launcher starts imports the launcher's own edit_train, not one in its working directory (problem 8)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env

from edit_train.cli.common import compose
from edit_train.config import Config, ConfigError, validate
from edit_train.sim.switch import real_job, real_preset, simulated

REPO = Path(__file__).resolve().parents[2]
MULTINODE = REPO / "launchers" / "torchrun_multinode.sh"
THREE = "cluster.clusters=[{name:a,ranks:1},{name:b,ranks:1},{name:c,ranks:1}]"
JOB_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE", "EDIT_TRAIN_LAUNCHER_BAR", "EDIT_TRAIN_CLUSTER")


@pytest.fixture
def no_job_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in JOB_ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_a_real_cluster_job_composes_without_the_demos_simulation(no_job_env: pytest.MonkeyPatch) -> None:
    """The recipe's overrides (no cluster= preset) given a Lighthouse: today the default hetero_2x1 rode along
    (link 100 Mbit/s + 50 ms, slowdown [1, 3]; three clusters were even refused for its two slowdowns)."""
    cfg = compose([THREE, "federation.lighthouse=127.0.0.1:29510"])
    assert cfg.cluster.name == "real" and simulated(cfg) == []
    assert (cfg.cluster.link.bandwidth_mbps, cfg.cluster.link.latency_ms, cfg.cluster.slowdown) == (0, 0, [])
    validate(cfg)
    no_job_env.setenv("TORCHELASTIC_RUN_ID", "x")  # under torchrun, with nothing else said
    cfg = compose(["algo=edit"])
    assert cfg.cluster.name == "real" and simulated(cfg) == [] and real_job(cfg) == "it runs under torchrun"


def test_a_local_run_keeps_the_simulation(no_job_env: pytest.MonkeyPatch) -> None:
    cfg = compose([])
    assert cfg.cluster.name == "hetero_2x1" and real_job(cfg) == ""
    assert simulated(cfg) == ["cluster.link.bandwidth_mbps=100 cluster.link.latency_ms=50", "cluster.slowdown=[1,3]"]
    validate(cfg)
    # the local launcher's own ranks look like torchrun's but are a local run's
    assert real_preset([], {"LOCAL_RANK": "0", "WORLD_SIZE": "1", "EDIT_TRAIN_LAUNCHER_BAR": "1"}) == []
    assert real_preset(["experiment=heterogeneity", "federation.lighthouse=h:1"], {}) == []  # it picks its preset


@pytest.mark.parametrize("named", ["cluster=hetero_2x1", "cluster.link.latency_ms=50", "cluster.slowdown=[1,3]",
                                   "cluster.clusters=[{name:a,ranks:1,slowdown:2},{name:b,ranks:1}]",
                                   "faults=[{kind:kill_cluster,cluster:0,step:3}]"])
def test_a_named_simulation_is_refused_in_a_real_job(no_job_env: pytest.MonkeyPatch, named: str) -> None:
    cfg = compose([named, "federation.lighthouse=127.0.0.1:29510"])
    with pytest.raises(ConfigError, match=r"cluster job of a real federation \(federation.lighthouse=127.0.0.1:29510 "
                                          r"is given\): it runs on the real network.*sim.force=true"):
        validate(cfg)
    validate(compose([named, "federation.lighthouse=127.0.0.1:29510", "sim.force=true"]))  # asked for: allowed


def test_real_job_reasons() -> None:
    cfg = Config()
    assert real_job(cfg, {}) == ""
    cfg.cluster.only = "d"
    assert real_job(cfg, {}) == "cluster.only=d is given"
    cfg.cluster.only, cfg.federation.host = "", "10.0.0.7"
    assert real_job(cfg, {}) == "federation.host=10.0.0.7 is given"


def test_edit_train_under_torchrun_refuses_a_simulated_link_in_one_line(tmp_path: Path) -> None:
    env = cli_env(TORCHELASTIC_RUN_ID="t", EDIT_TRAIN_CLUSTER="a", RANK="1")  # not rank 0: no first line
    for var in ("LOCAL_RANK", "WORLD_SIZE", "EDIT_TRAIN_LAUNCHER_BAR"):
        env.pop(var, None)
    env["RANK"] = "0"
    proc = subprocess.run([sys.executable, "-m", "edit_train.cli.train", "cluster=hetero_3", "logger=none",
                           f"run.dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "error: cluster.link.bandwidth_mbps=100 cluster.link.latency_ms=50; a slowdown in cluster.clusters " \
           "(c1:1.5, c2:2.5): simulated" in lines[0] and "not cluster=hetero_3" in lines[0]
    assert proc.stdout.startswith("edit-train: cluster a: rank 0 starting"), proc.stdout  # its first line, at once
    assert not (tmp_path / "run").exists()


def test_the_cluster_launcher_refuses_a_simulated_setting_before_torchrun(tmp_path: Path) -> None:
    env = cli_env(CLUSTER="a", LIGHTHOUSE="127.0.0.1:29510", NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1",
                  RDZV_ENDPOINT="127.0.0.1:29500", HOST_ADDR="127.0.0.1", EDIT_SKIP_KEY_CHECK="1")
    for var in ("EDIT_DRY_RUN", "EDIT_TRAIN_CLUSTER", *JOB_ENV):
        env.pop(var, None)
    proc = subprocess.run(["bash", str(MULTINODE), "cluster.clusters=[{name:a,ranks:1}]", "cluster.link.latency_ms=50"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("torchrun_multinode.sh: error: cluster.link.bandwidth_mbps=0 cluster.link.latency_ms=50")
    assert "runs on the real network" in lines[0]
    # its first line came before the checks (on stdout: the refusal is the only line on stderr)
    assert proc.stdout.startswith("torchrun_multinode.sh: cluster a, node 0/1: checking the configuration")


def test_launched_workers_import_the_launchers_edit_train(tmp_path: Path, no_job_env: pytest.MonkeyPatch) -> None:
    """Started inside another checkout (a directory holding its own edit_train/), the local launcher's workers
    (`python -m edit_train.cli.worker`) used to import that one: sys.path[0] is the working directory."""
    from edit_train.cli.launcher import LocalFederation

    shadow = tmp_path / "edit_train"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")
    import edit_train

    fed = LocalFederation(Config(), tmp_path / "cfg.json", "127.0.0.1:1")
    env = fed._env(fed.jobs[0], 0, 1234)
    probe = [sys.executable, "-m", "edit_train.importpath"]  # a module of ours, run as the workers' -m is
    code = "import edit_train, sys; print(edit_train.__file__)"
    for cmd in ([*probe[:1], "-c", code], ):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        assert out.returncode == 0, out.stderr
        assert Path(out.stdout.strip()).resolve() == Path(edit_train.__file__).resolve(), out.stdout
    ran = subprocess.run(probe, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert ran.returncode == 0, ran.stderr  # the shadow has no importpath module: found means ours was imported
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"})
    assert Path(plain.stdout.strip()).resolve() == (shadow / "__init__.py").resolve()  # what today's env did


def test_the_cluster_launchers_torchrun_is_its_own_pythons(tmp_path: Path) -> None:
    """A `torchrun` first on PATH may belong to another Python (another edit_train installed): the workers of the
    hosts test imported /work/main's while the checks ran this one's. The job runs `$PYTHON -m
    torch.distributed.run`: the Python that ran its checks starts every worker."""
    other = tmp_path / "bin"
    other.mkdir()
    (other / "torchrun").write_text("#!/bin/sh\necho another python's torchrun\n")
    (other / "torchrun").chmod(0o755)
    env = cli_env(CLUSTER="a", LIGHTHOUSE="127.0.0.1:29510", NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1",
                  RDZV_ENDPOINT="127.0.0.1:29500", HOST_ADDR="127.0.0.1", EDIT_DRY_RUN="1",
                  EDIT_SKIP_TOPOLOGY_CHECK="1", PYTHON=sys.executable,
                  PATH=os.pathsep.join([str(other), os.environ.get("PATH", "")]))
    for var in ("EDIT_TRAIN_CLUSTER", *JOB_ENV):
        env.pop(var, None)
    proc = subprocess.run(["bash", str(MULTINODE), "cluster=real"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.split()
    i = argv.index("-m")
    assert argv[i - 1] == sys.executable and argv[i + 1] == "torch.distributed.run", proc.stdout
