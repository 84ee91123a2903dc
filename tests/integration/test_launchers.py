"""Launchers: one job per cluster. torchrun_multinode.sh (dry runs, refusals, and two real clusters
started by it on this host around an `edit-train-lighthouse`, one of them killed and restarted by its own
torchrun), and the Slurm batch scripts under fake `srun` / `scontrol` (dry run: every node prints its
command)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import cli_env, script_cmd, start_lighthouse
from edit_train.federation import auth

REPO = Path(__file__).resolve().parents[2]
MULTINODE = REPO / "launchers" / "torchrun_multinode.sh"
SBATCH = REPO / "launchers" / "slurm" / "edit.sbatch"
LH_SBATCH = REPO / "launchers" / "slurm" / "lighthouse.sbatch"
LOCAL = REPO / "launchers" / "local.sh"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_cmd(line: str) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """`env K=V ... torchrun --a=1 ... -m edit_train.cli.train over=rides` -> (env, flags, overrides)."""
    argv = shlex.split(line)
    assert argv[0] == "env", line
    i = 1
    env = {}
    while "=" in argv[i] and not argv[i].startswith("-"):
        k, v = argv[i].split("=", 1)
        env[k] = v
        i += 1
    rest = argv[i:]
    assert rest[0] == "torchrun" or rest[1:3] == ["-m", "torch.distributed.run"], line
    start = 1 if rest[0] == "torchrun" else 3
    m = rest.index("-m", start)
    assert rest[m + 1] == "edit_train.cli.train", line
    return env, dict(a.split("=", 1) for a in rest[start:m]), rest[m + 2:]


# --------------------------------------------------------------------------------------------------
# torchrun_multinode.sh

KEY = str(auth.new_key(Path(tempfile.mkdtemp(prefix="edit-train-test-key-")) / "fed.key"))  # mode 0600
NODE = {"CLUSTER": "a", "LIGHTHOUSE": "lh0:29510", "NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "4",
        "RDZV_ENDPOINT": "a0:29500", "HOST_ADDR": "10.1.0.11", "KEY_FILE": KEY}
VARS = ("CLUSTER", "LIGHTHOUSE", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "RDZV_ENDPOINT", "RDZV_ID", "MAX_RESTARTS",
        "RDZV_BACKEND", "RDZV_CONF", "HOST_ADDR", "EDIT_TRAIN_CLUSTER", "KEY_FILE", auth.KEY_ENV)


def multinode(*overrides: str, check: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    full = cli_env(EDIT_DRY_RUN="1", EDIT_SKIP_TOPOLOGY_CHECK="0" if check else "1")
    for var in VARS:
        full.pop(var, None)
    full.update(env)
    return subprocess.run(["bash", str(MULTINODE), *overrides], capture_output=True, text=True, env=full,
                          timeout=120, cwd=REPO)


def test_multinode_dry_run_is_one_cluster_job() -> None:
    proc = multinode("algo=edit", **NODE)
    assert proc.returncode == 0, proc.stderr
    env, flags, overrides = parse_cmd(proc.stdout.strip())
    assert env == {"EDIT_TRAIN_CLUSTER": "a", "EDIT_TRAIN_HOST": "10.1.0.11", auth.KEY_ENV: KEY}
    assert flags == {"--nnodes": "2", "--nproc-per-node": "4", "--rdzv-backend": "static",
                     "--rdzv-endpoint": "a0:29500", "--rdzv-id": "edit-a", "--max-restarts": "3", "--node-rank": "1"}
    assert overrides == ["algo=edit", "run.dir=runs/edit-train", "federation.lighthouse=lh0:29510"]


def test_multinode_keeps_run_dir_and_supports_c10d() -> None:
    proc = multinode("run.dir=/shared/x", **{**NODE, "LIGHTHOUSE": "http://lh0:29510"}, RDZV_ID="job7",
                     MAX_RESTARTS="0", RDZV_BACKEND="c10d")
    assert proc.returncode == 0, proc.stderr
    _, flags, overrides = parse_cmd(proc.stdout.strip())
    assert flags["--rdzv-backend"] == "c10d" and flags["--rdzv-id"] == "job7" and flags["--max-restarts"] == "0"
    assert flags["--rdzv-conf"] == "is_host=false" and "--node-rank" not in flags
    assert overrides == ["run.dir=/shared/x", "federation.lighthouse=lh0:29510"]


@pytest.mark.parametrize(("env", "args", "needle"), [
    ({k: v for k, v in NODE.items() if k != "CLUSTER"}, (), "CLUSTER is not set"),
    ({k: v for k, v in NODE.items() if k != "LIGHTHOUSE"}, (), "LIGHTHOUSE is not set"),
    ({**NODE, "LIGHTHOUSE": "lh0"}, (), "LIGHTHOUSE must be host:port"),
    ({**NODE, "CLUSTER": "a b"}, (), "CLUSTER may only contain"),
    ({**NODE, "NODE_RANK": "2"}, (), "NODE_RANK must be an integer in 0..1"),
    ({**NODE, "RDZV_ENDPOINT": "a0"}, (), "RDZV_ENDPOINT must be host:port"),
    ({**NODE, "NPROC_PER_NODE": "gpu"}, (), "NPROC_PER_NODE must be a positive integer"),
    ({**NODE, "RDZV_BACKEND": "etcd"}, (), "RDZV_BACKEND must be static or c10d"),
    (NODE, ("cluster.only=b",), "set LIGHTHOUSE / CLUSTER instead"),
    ({k: v for k, v in NODE.items() if k != "KEY_FILE"}, (), "KEY_FILE is not set: a federation across hosts"),
    ({**NODE, "KEY_FILE": "/nonexistent/fed.key"}, (), "KEY_FILE=/nonexistent/fed.key cannot be read"),
    (NODE, (f"federation.key_file={KEY}",), "set KEY_FILE instead"),
    # a cross-cluster address the other clusters cannot reach (a Debian host name resolves to 127.0.1.1)
    ({**NODE, "HOST_ADDR": "127.0.1.1"}, (), "HOST_ADDR=127.0.1.1 is a loopback address, but the Lighthouse "
                                             "lh0:29510 is not on loopback: set HOST_ADDR to this node's address"),
    ({**NODE, "HOST_ADDR": "localhost"}, (), "HOST_ADDR=localhost resolves to 127.0.0.1, a loopback address"),
    ({**NODE, "HOST_ADDR": "0.0.0.0"}, (), "HOST_ADDR=0.0.0.0 is an unspecified address"),
    # no route to the Lighthouse host to take the default from (connecting a UDP socket to a broadcast
    # address fails at once: nothing is sent, no network needed)
    ({**{k: v for k, v in NODE.items() if k != "HOST_ADDR"}, "LIGHTHOUSE": "255.255.255.255:29510"}, (),
     "cannot find this node's address towards the Lighthouse 255.255.255.255:29510"),
])
def test_multinode_refuses_bad_input(env: dict[str, str], args: tuple[str, ...], needle: str) -> None:
    proc = multinode(*args, **env)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def route_source(host: str) -> str | None:
    """The source address the kernel picks for a route to `host` (a UDP connect sends nothing); None: no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 29510))
            return str(s.getsockname()[0])
    except OSError:
        return None


def test_multinode_default_host_addr_is_this_nodes_address_towards_the_lighthouse() -> None:
    """Without HOST_ADDR a node's cross-cluster address is the source address of its route to the Lighthouse
    (not `hostname`, which is 127.0.1.1 on Debian): 127.0.0.1 for a Lighthouse on loopback, this host's
    outgoing address for one elsewhere (198.51.100.7, a documentation address: only the route is looked up)."""
    nodefault = {k: v for k, v in NODE.items() if k != "HOST_ADDR"}
    local = multinode(**{**nodefault, "LIGHTHOUSE": "127.0.0.1:29510"})
    assert local.returncode == 0, local.stderr
    assert parse_cmd(local.stdout.strip())[0]["EDIT_TRAIN_HOST"] == "127.0.0.1"
    loopback_ok = multinode(**{**NODE, "LIGHTHOUSE": "127.0.0.1:29510", "HOST_ADDR": "127.0.0.1"})
    assert loopback_ok.returncode == 0, loopback_ok.stderr  # a one-host federation may stay on loopback
    expected = route_source("198.51.100.7")
    if expected is None:
        pytest.skip("this host has no route to 198.51.100.7 (no default route)")
    remote = multinode(**{**nodefault, "LIGHTHOUSE": "198.51.100.7:29510"})
    assert remote.returncode == 0, remote.stderr
    assert parse_cmd(remote.stdout.strip())[0]["EDIT_TRAIN_HOST"] == expected != "127.0.0.1"


def test_multinode_without_a_key_only_on_loopback_or_when_told() -> None:
    keyless = {k: v for k, v in NODE.items() if k != "KEY_FILE"}
    for env, args in (({**keyless, "LIGHTHOUSE": "127.0.0.1:29510"}, ()), (keyless, ("federation.insecure=true",))):
        proc = multinode(*args, **env)
        assert proc.returncode == 0, proc.stderr
        assert auth.KEY_ENV not in parse_cmd(proc.stdout.strip())[0]


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_multinode_checks_the_cluster_size_before_launching() -> None:
    """Cluster a has 6 ranks in the config; 2 nodes x 4 workers would be 8: refused before any worker starts."""
    proc = multinode("cluster.clusters=[{name:a,ranks:6},{name:b,ranks:2}]", check=True, **NODE)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "cluster a has 6 rank(s) in the config but NNODES (2) x NPROC_PER_NODE (4) = 8" in proc.stderr
    ok = multinode("cluster.clusters=[{name:a,ranks:8},{name:b,ranks:2}]", check=True, **NODE)
    assert ok.returncode == 0 and "cluster a, node 1/2: cluster ranks 4..7 of 8" in ok.stderr, ok.stderr
    new = multinode("cluster.clusters=[{name:x,ranks:8}]", check=True, **NODE)
    assert new.returncode == 0 and "joins the federation as a new cluster of 8 rank(s)" in new.stderr, new.stderr
    bad = multinode("model=nonexistent", check=True, **NODE)
    assert bad.returncode == 2 and "model=nonexistent: no such model option" in bad.stderr


# --------------------------------------------------------------------------------------------------
# two clusters, each its own torchrun job, around a Lighthouse, on this host

FED_RUN = ["algo=edit", "algo.interval=4", "model=tiny", "logger=none", "train.progress=false", "train.seq_len=32",
           "train.batch_size=2", "train.eval_every=0", "train.eval_batches=1", "train.log_every=2",
           "cluster.clusters=[{name:a,ranks:1,slowdown:3},{name:b,ranks:1,slowdown:3}]", "sim.force=true",
           "federation.min_clusters=1",
           "federation.heartbeat_timeout_s=2", "federation.join_timeout_s=5", "federation.collective_timeout_s=15"]


# slow (CI's 20 minutes): a cluster restarted by its launcher is in the default run
# (test_distributed.py::test_local_launcher_restarts_a_killed_worker, a_edit)
@pytest.mark.parametrize("algo", [pytest.param("edit", marks=pytest.mark.slow),
                                  pytest.param("a_edit", marks=pytest.mark.slow)])
def test_two_cluster_jobs_one_killed_and_restarted_by_its_own_torchrun(tmp_path: Path, small_corpus: str,
                                                                        algo: str) -> None:
    """Clusters a and b are two torchrun_multinode.sh jobs (1 node, 1 worker each) meeting at an
    edit-train-lighthouse. b's worker SIGKILLs itself at step 9; b's torchrun restarts it (MAX_RESTARTS=1), it
    heals from a and both finish. a is never restarted and keeps syncing (alone) while b is down. The a_edit twin
    (syncs every 0.5 s of compute instead of every 4 steps) asserts the same."""
    run_dir = tmp_path / "run"
    fed_run = FED_RUN if algo == "edit" else \
        [o for o in FED_RUN if not o.startswith("algo")] + ["algo=a_edit", "algo.sync_time_s=0.5",
                                                            "algo.rule.verified.probe_tokens=0"]
    house, address = start_lighthouse(tmp_path, f"federation.key_file={KEY}")
    jobs = []
    try:
        for name in ("a", "b"):
            env = cli_env(CLUSTER=name, LIGHTHOUSE=address, NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1",
                          RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", HOST_ADDR="127.0.0.1", MAX_RESTARTS="1",
                          GLOO_SOCKET_IFNAME="lo", KEY_FILE=KEY)
            for var in ("EDIT_DRY_RUN", "EDIT_TRAIN_CLUSTER"):
                env.pop(var, None)
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed below)
            jobs.append((subprocess.Popen(["bash", str(MULTINODE), *fed_run, "train.steps=40",
                                           f"data.source={small_corpus}", f"run.dir={run_dir}",
                                           "faults=[{kind:kill_cluster,cluster:b,step:9}]"],
                                          stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                          start_new_session=True), log))
        codes = [p.wait(timeout=300) for p, _ in jobs]
    finally:
        for p, log in jobs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
        house.send_signal(signal.SIGTERM)
        house.wait(timeout=30)
    logs = "\n".join(f"--- {n}:\n" + (tmp_path / f"{n}.log").read_text()[-3000:] for n in ("a", "b"))
    assert codes == [0, 0], logs
    assert list(run_dir.glob(".fault-kill-b-*")), logs
    summary = json.loads((run_dir / "summary.json").read_text())
    per = summary["per_cluster"]
    assert set(per) == {"a", "b"}, logs
    assert per["a"]["restarts"] == 0 and per["b"]["restarts"] == 1, per
    assert per["b"]["healed_from"] and set(per["b"]["healed_from"]) == {"a"}, per
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    a_syncs = [e for e in events if e.get("event") == "sync" and e.get("cluster") == "a"]
    assert any(e["quorum"] == ["a"] for e in a_syncs), "a never synced alone while b was down"
    assert a_syncs[-1]["quorum"] == ["a", "b"]


# --------------------------------------------------------------------------------------------------
# Slurm (fake srun / scontrol)

FAKE_SCONTROL = r'''#!/usr/bin/env python3
"""scontrol show hostnames LIST: expands 'a[0-1],b3' (order kept, like Slurm's hostlist)."""
import re, sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", sys.argv[3]):
    m = re.fullmatch(r"([^\[]+)\[([^\]]*)\]", part)
    if not m:
        print(part)
        continue
    for rng in m.group(2).split(","):
        lo, _, hi = rng.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            print(f"{m.group(1)}{i:0{len(lo)}d}")
'''

# srun: runs its command once per node, one after the other, as Slurm would on each node (per-node
# SLURM_NODEID, SLURMD_NODENAME, SLURM_GPUS_ON_NODE); records its own options; fails like
# --kill-on-bad-exit when a node fails.
FAKE_SRUN = r'''#!/usr/bin/env bash
set -u
printf '%s\n' "$@" > "$FAKE_LOG/srun.args"
nodes=
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in --nodes=*) nodes=${1#*=} ;; esac
    shift
done
read -r -a hosts <<<"$FAKE_HOSTS"
read -r -a gpus <<<"${FAKE_NODE_GPUS:-}"
rc=0
for ((i = 0; i < nodes; i++)); do
    SLURM_NODEID=$i SLURMD_NODENAME=${hosts[$i]} SLURM_GPUS_ON_NODE=${gpus[$i]:-${SLURM_GPUS_ON_NODE:-}} \
        EDIT_DRY_RUN=1 "$@" || rc=$?
done
exit $rc
'''


@pytest.fixture
def slurm(tmp_path: Path):
    """Run edit.sbatch (with bash, as sbatch would on the first node) under a fake allocation of one cluster."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text.replace("#!/usr/bin/env python3", f"#!{sys.executable}"))
        (bin_dir / name).chmod(0o755)

    def run(*overrides: str, hosts: str = "gpu-a0 gpu-a1", nodelist: str = "gpu-a[0-1]", check: bool = False,
            script: Path = SBATCH, **extra: str) -> subprocess.CompletedProcess[str]:
        env = cli_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(tmp_path),
                      FAKE_HOSTS=hosts, SLURM_JOB_ID="4242", SLURM_JOB_NAME="edit-train",
                      SLURM_JOB_NODELIST=nodelist, SLURM_NNODES=str(len(hosts.split())),
                      SLURM_JOB_NUM_NODES=str(len(hosts.split())), SLURM_NODEID="0", SLURMD_NODENAME=hosts.split()[0],
                      SLURM_GPUS_ON_NODE="4", SLURM_GPUS_PER_NODE="4", SLURM_JOB_CPUS_PER_NODE="32(x2)",
                      SLURM_SUBMIT_DIR=str(tmp_path), EDIT_SKIP_TOPOLOGY_CHECK="0" if check else "1",
                      CLUSTER="a", LIGHTHOUSE="127.0.0.1:29510", KEY_FILE=KEY)
        for var in ("NPROC_PER_NODE", "RDZV_ID", "RDZV_BACKEND", "RDZV_PORT", "HOST_ADDR", "SLURM_HET_SIZE",
                    "SLURM_RESTART_COUNT", "EDIT_DRY_RUN", "EDIT_TRAIN_CLUSTER", auth.KEY_ENV):
            env.pop(var, None)
        for k, v in extra.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return subprocess.run(["bash", str(script), *overrides], capture_output=True, text=True, env=env,
                              timeout=120, cwd=REPO)

    run.srun_args = lambda: (tmp_path / "srun.args").read_text().splitlines()  # type: ignore[attr-defined]
    run.srun_called = lambda: (tmp_path / "srun.args").exists()  # type: ignore[attr-defined]
    run.dir = tmp_path  # type: ignore[attr-defined]
    return run


def node_commands(stdout: str) -> list[tuple[dict[str, str], dict[str, str], list[str]]]:
    return [parse_cmd(line) for line in stdout.splitlines() if line.startswith("env ")]


def test_slurm_one_job_is_one_cluster(slurm) -> None:
    """2 nodes x 4 GPUs = cluster a of 8 ranks; its own rendezvous on its first node; the size check (a real
    config compose) runs on every node and agrees with the allocation."""
    proc = slurm("algo=a_edit", "model=tiny", "cluster.clusters=[{name:a,ranks:8},{name:b,ranks:2}]", check=True)
    assert proc.returncode == 0, proc.stderr
    cmds = node_commands(proc.stdout)
    assert len(cmds) == 2, proc.stdout
    for rank, (env, flags, overrides) in enumerate(cmds):
        # each node's cross-cluster address is its own route's source towards the Lighthouse (here all
        # "nodes" are this host and the Lighthouse is on its loopback), never the node's host name
        assert env == {"EDIT_TRAIN_CLUSTER": "a", "EDIT_TRAIN_HOST": "127.0.0.1", auth.KEY_ENV: KEY}
        assert flags["--nnodes"] == "2" and flags["--node-rank"] == str(rank) and flags["--nproc-per-node"] == "4"
        assert flags["--rdzv-endpoint"] == f"gpu-a0:{10000 + 4242 % 20000}"
        assert flags["--rdzv-id"] == "edit-a-4242" and flags["--rdzv-backend"] == "static"
        assert overrides == ["algo=a_edit", "model=tiny", "cluster.clusters=[{name:a,ranks:8},{name:b,ranks:2}]",
                             "run.dir=runs/edit-train", "federation.lighthouse=127.0.0.1:29510"]
    assert "cluster a, node 1/2: cluster ranks 4..7 of 8" in proc.stderr
    args = slurm.srun_args()
    assert "--ntasks-per-node=1" in args and "--nodes=2" in args and "--cpus-per-task=32" in args
    assert "--kill-on-bad-exit=1" in args


def test_slurm_cluster_name_from_job_name_and_requeue_resumes(slurm) -> None:
    proc = slurm(CLUSTER=None, SLURM_JOB_NAME="site-b", SLURM_RESTART_COUNT="2")
    assert proc.returncode == 0, proc.stderr
    for env, _, overrides in node_commands(proc.stdout):
        assert env["EDIT_TRAIN_CLUSTER"] == "site-b" and "resume=auto" in overrides


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"CLUSTER": None}, "CLUSTER is not set"),
    ({"LIGHTHOUSE": None}, "LIGHTHOUSE is not set"),
    ({"SLURM_HET_SIZE": "2"}, "heterogeneous Slurm jobs"),
    ({"SLURM_JOB_ID": None}, "submit this with sbatch"),
    ({"RDZV_PORT": "99999"}, "RDZV_PORT must be a port number"),
    ({"KEY_FILE": None}, "KEY_FILE is not set"),
    ({"KEY_FILE": "/nonexistent/fed.key"}, "cannot be read"),
    ({"HOST_ADDR": "10.1.0.11"}, "HOST_ADDR=10.1.0.11 would be the cross-cluster address of all 2 nodes"),
])
def test_slurm_refuses_before_launching(slurm, kwargs: dict, needle: str) -> None:
    proc = slurm(**kwargs)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr
    assert not slurm.srun_called()


def test_slurm_host_addr_of_a_one_node_job(slurm) -> None:
    """A one-node job may name its node's address (e.g. its VPN address); a loopback one is refused on the node
    when the Lighthouse is elsewhere."""
    one = {"hosts": "gpu-a0", "nodelist": "gpu-a0", "LIGHTHOUSE": "lh0:29510"}
    proc = slurm(**one, HOST_ADDR="10.77.0.3")
    assert proc.returncode == 0, proc.stderr
    assert [env["EDIT_TRAIN_HOST"] for env, _, _ in node_commands(proc.stdout)] == ["10.77.0.3"]
    loop = slurm(**one, HOST_ADDR="127.0.1.1")
    assert loop.returncode == 2 and node_commands(loop.stdout) == [], loop.stdout
    assert "HOST_ADDR=127.0.1.1 is a loopback address, but the Lighthouse lh0:29510 is not on loopback" in loop.stderr


def test_slurm_refuses_nodes_with_different_gpu_counts(slurm) -> None:
    proc = slurm(FAKE_NODE_GPUS="4 2")
    assert proc.returncode != 0
    assert "node gpu-a1 has 2 GPUs but the first node has 4" in proc.stderr
    assert "make each kind of node its own cluster" in proc.stderr


def test_slurm_lighthouse_job(slurm) -> None:
    """It binds the node's own address (what its name resolves to: what the clusters dial; a loopback one is
    refused), never every interface unless told, and passes the key; without one it refuses unless
    federation.insecure=true."""
    proc = slurm("federation.min_clusters=2", script=LH_SBATCH, EDIT_DRY_RUN="1", LIGHTHOUSE_PORT="29600")
    resolved = socket.gethostbyname(socket.gethostname())
    if resolved.startswith("127."):  # this box (and Debian's 127.0.1.1): the clusters could not reach it
        assert proc.returncode == 2 and proc.stdout == "" and "set LIGHTHOUSE_BIND" in proc.stderr, proc.stderr
        assert f"resolves to '{resolved}'" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        argv = shlex.split(proc.stdout.strip())
        assert argv == ["edit-train-lighthouse", "--bind", f"{resolved}:29600", "--address-file",
                        str(slurm.dir / "lighthouse-4242.addr"), "federation.min_clusters=2",
                        f"federation.key_file={KEY}"]
    chosen = slurm(script=LH_SBATCH, EDIT_DRY_RUN="1", LIGHTHOUSE_BIND="10.0.0.5:29510")
    assert shlex.split(chosen.stdout.strip())[2] == "10.0.0.5:29510"
    keyless = slurm(script=LH_SBATCH, EDIT_DRY_RUN="1", KEY_FILE=None, LIGHTHOUSE_BIND="10.0.0.5:29510")
    assert keyless.returncode == 2 and "KEY_FILE is not set" in keyless.stderr and keyless.stdout == ""
    insecure = slurm("federation.insecure=true", script=LH_SBATCH, EDIT_DRY_RUN="1", KEY_FILE=None,
                     LIGHTHOUSE_BIND="10.0.0.5:29510")
    assert insecure.returncode == 0 and "federation.key_file" not in insecure.stdout


def test_lighthouse_cli_refuses_bad_input(tmp_path: Path) -> None:
    cmd = script_cmd("edit-train-lighthouse", "edit_train.cli.lighthouse")
    bad = subprocess.run([*cmd, "--bind", "127.0.0.1:0", "federation.min_clusters=two"], capture_output=True,
                         text=True, env=cli_env(), timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "min_clusters" in bad.stderr, bad.stderr
    unbound = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=120)
    assert unbound.returncode == 2 and "--bind" in unbound.stderr  # no default address
    exposed = subprocess.run([*cmd, "--bind", "0.0.0.0:0"], capture_output=True, text=True,
                             env={k: v for k, v in cli_env().items() if k != auth.KEY_ENV}, timeout=120)
    assert exposed.returncode == 2 and exposed.stderr.count("\n") == 1 and "needs a key" in exposed.stderr
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        busy = subprocess.run([*cmd, "--bind", f"127.0.0.1:{taken.getsockname()[1]}"], capture_output=True,
                              text=True, env=cli_env(), timeout=120)
    finally:
        taken.close()
    assert busy.returncode == 2 and "cannot start the Lighthouse" in busy.stderr, busy.stderr


# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [LOCAL, MULTINODE, SBATCH, LH_SBATCH], ids=lambda p: p.name)
def test_shell_syntax(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_a_cluster_job_ignores_the_other_clusters_traces_in_a_shared_run_dir(tmp_path: Path, monkeypatch) -> None:
    """Clusters launched on their own share run.dir: cluster b may start after a wrote metrics.jsonl and its
    checkpoints, but not over its own earlier run (without resume)."""
    from edit_train.cli.checks import RunDirError, check_run_dir

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoints" / "a" / "step_00000004").mkdir(parents=True)
    monkeypatch.setenv("EDIT_TRAIN_CLUSTER", "b")
    check_run_dir(tmp_path, "false")
    (tmp_path / "checkpoints" / "b" / "step_00000004").mkdir(parents=True)
    with pytest.raises(RunDirError, match="already holds cluster b's run"):
        check_run_dir(tmp_path, "false")
    check_run_dir(tmp_path, "auto")
    monkeypatch.delenv("EDIT_TRAIN_CLUSTER")
    with pytest.raises(RunDirError, match="an unfinished run"):
        check_run_dir(tmp_path, "false")
