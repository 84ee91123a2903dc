"""Multi-node launchers: two torchrun "nodes" on this host, and the Slurm batch script under fake
`srun` / `scontrol` (dry run: every node prints the torchrun command it would run)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

REPO = Path(__file__).resolve().parents[1]
MULTINODE = REPO / "launchers" / "torchrun_multinode.sh"
SBATCH = REPO / "launchers" / "slurm" / "edit.sbatch"
LOCAL = REPO / "launchers" / "local.sh"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_torchrun(line: str) -> tuple[dict[str, str], list[str]]:
    """`torchrun --a=1 ... -m edit_train.cli.train over=rides` -> ({"--a": "1", ...}, [overrides])."""
    argv = shlex.split(line)
    assert argv[0] == "torchrun" or argv[1:3] == ["-m", "torch.distributed.run"], line
    i = argv.index("-m", 1 if argv[0] == "torchrun" else 3)
    assert argv[i + 1] == "edit_train.cli.train", line
    flags = dict(a.split("=", 1) for a in argv[1 if argv[0] == "torchrun" else 3:i])
    return flags, argv[i + 2:]


# --------------------------------------------------------------------------------------------------
# torchrun_multinode.sh


def multinode(*overrides: str, check: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"EDIT_DRY_RUN": "1", "EDIT_SKIP_TOPOLOGY_CHECK": "0" if check else "1"}
    full = cli_env(**{**base, **env})
    for var in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "RDZV_ENDPOINT", "RDZV_ID", "MAX_RESTARTS",
                "RDZV_BACKEND", "RDZV_CONF"):
        if var not in env:
            full.pop(var, None)
    return subprocess.run(["bash", str(MULTINODE), *overrides], capture_output=True, text=True, env=full,
                          timeout=120, cwd=REPO)


NODE = {"NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "4", "RDZV_ENDPOINT": "a0:29500"}


def test_multinode_dry_run_defaults() -> None:
    proc = multinode("algo=edit", "cluster.groups=2", "cluster.shard_size=4", **NODE)
    assert proc.returncode == 0, proc.stderr
    flags, overrides = parse_torchrun(proc.stdout.strip())
    assert flags == {"--nnodes": "2", "--nproc-per-node": "4", "--rdzv-backend": "static",
                     "--rdzv-endpoint": "a0:29500", "--rdzv-id": "edit-train", "--max-restarts": "3",
                     "--node-rank": "1"}
    assert overrides == ["algo=edit", "cluster.groups=2", "cluster.shard_size=4", "run.dir=runs/edit-train"]


def test_multinode_keeps_run_dir_and_supports_c10d() -> None:
    proc = multinode("run.dir=/shared/x", **NODE, RDZV_ID="job7", MAX_RESTARTS="0", RDZV_BACKEND="c10d")
    assert proc.returncode == 0, proc.stderr
    flags, overrides = parse_torchrun(proc.stdout.strip())
    assert flags["--rdzv-backend"] == "c10d" and flags["--rdzv-id"] == "job7" and flags["--max-restarts"] == "0"
    assert flags["--rdzv-conf"] == "is_host=false" and "--node-rank" not in flags
    assert overrides == ["run.dir=/shared/x"]


@pytest.mark.parametrize(("env", "needle"), [
    ({k: v for k, v in NODE.items() if k != "NODE_RANK"}, "NODE_RANK is not set"),
    ({**NODE, "NODE_RANK": "2"}, "NODE_RANK must be an integer in 0..1"),
    ({**NODE, "RDZV_ENDPOINT": "a0"}, "RDZV_ENDPOINT must be host:port"),
    ({**NODE, "NPROC_PER_NODE": "gpu"}, "NPROC_PER_NODE must be a positive integer"),
    ({**NODE, "RDZV_BACKEND": "etcd"}, "RDZV_BACKEND must be static or c10d"),
])
def test_multinode_refuses_bad_input(env: dict[str, str], needle: str) -> None:
    proc = multinode(**env)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_multinode_checks_the_topology_before_launching() -> None:
    """3 nodes x 4 workers = 2 groups x 6: the world matches, but group 0 would be node 0 plus half of
    node 1 (a group straddling nodes); refused before any worker starts."""
    proc = multinode("cluster.groups=2", "cluster.shard_size=6", check=True,
                     **{**NODE, "NNODES": "3"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert "cluster.shard_size (6) must be a multiple or a divisor of NPROC_PER_NODE (4)" in proc.stderr


# --------------------------------------------------------------------------------------------------
# two nodes on this host


def two_nodes(tmp_path: Path, overrides: list[str], max_restarts: int = 0) -> str:
    """Start torchrun_multinode.sh twice (NODE_RANK 0 and 1, one worker each) on 127.0.0.1, wait for both
    (180 s at most), assert both exit 0; returns both logs. Node 0 runs the topology check."""
    port = free_port()
    procs = []
    for node in (0, 1):
        env = cli_env(NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1", RDZV_ENDPOINT=f"127.0.0.1:{port}",
                      RDZV_ID=f"test-{port}", MAX_RESTARTS=str(max_restarts), EDIT_SKIP_TOPOLOGY_CHECK=str(node))
        env.pop("EDIT_DRY_RUN", None)
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(["bash", str(MULTINODE), *overrides], stdout=log, stderr=subprocess.STDOUT,
                                       env=env, cwd=tmp_path, start_new_session=True), log))
    try:
        codes = [p.wait(timeout=180) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    logs = "\n".join(f"--- node {n}:\n" + (tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert codes == [0, 0], logs
    return logs


TWO_NODE_RUN = ["cluster.groups=2", "cluster.shard_size=1", "algo=edit", "algo.interval=2", "logger=none",
                "train.progress=false", "train.seq_len=32", "train.batch_size=2", "train.eval_every=0",
                "train.eval_batches=1"]


def test_two_nodes_on_one_host(tmp_path: Path, small_corpus: str) -> None:
    """Two invocations of torchrun_multinode.sh (one per "node") rendezvous on 127.0.0.1 and train one
    run: node 0 is worker group 0, node 1 is worker group 1, both write to the same run.dir."""
    run_dir = tmp_path / "run"
    logs = two_nodes(tmp_path, [*TWO_NODE_RUN, "train.steps=4", f"data.source={small_corpus}", f"run.dir={run_dir}"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is True, logs
    assert set(summary["per_group"]) == {"0", "1"}
    assert "node 0/2: ranks 0..0, worker group 0" in logs


def test_two_nodes_restart_after_a_killed_worker(tmp_path: Path, small_corpus: str) -> None:
    """Static rendezvous: group 1's worker (node 1) is SIGKILLed at step 5; node 0's worker fails on the
    broken link, both agents restart their workers (same restart count), which resume from step 4."""
    run_dir = tmp_path / "run"
    logs = two_nodes(tmp_path, [*TWO_NODE_RUN, "train.steps=8", "checkpoint.every=2", f"data.source={small_corpus}",
                                f"run.dir={run_dir}", "faults=[{kind:kill,group:1,start:5}]"], max_restarts=1)
    assert (run_dir / ".fault-kill-g1-s5").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is True and summary["steps"] == 8, logs
    assert re.search(r"resumed from \S+step_00000004 \(step 4\)", logs), logs


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
    """Run edit.sbatch (with bash, as sbatch would on the first node) under a fake 2-node allocation."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text.replace("#!/usr/bin/env python3", f"#!{sys.executable}"))
        (bin_dir / name).chmod(0o755)

    def run(*overrides: str, hosts: str = "gpu-a0 gpu-a1", nodelist: str = "gpu-a[0-1]", check: bool = False,
            **extra: str) -> subprocess.CompletedProcess[str]:
        env = cli_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(tmp_path),
                      FAKE_HOSTS=hosts, SLURM_JOB_ID="4242", SLURM_JOB_NAME="edit-train",
                      SLURM_JOB_NODELIST=nodelist, SLURM_NNODES=str(len(hosts.split())),
                      SLURM_JOB_NUM_NODES=str(len(hosts.split())), SLURM_NODEID="0", SLURMD_NODENAME=hosts.split()[0],
                      SLURM_GPUS_ON_NODE="4", SLURM_GPUS_PER_NODE="4", SLURM_JOB_CPUS_PER_NODE="32(x2)",
                      SLURM_SUBMIT_DIR=str(REPO), EDIT_SKIP_TOPOLOGY_CHECK="0" if check else "1")
        for var in ("NPROC_PER_NODE", "NODES_PER_GROUP", "RDZV_ID", "RDZV_BACKEND", "RDZV_PORT", "EDIT_NODE_ORDER",
                    "SLURM_HET_SIZE", "SLURM_RESTART_COUNT", "EDIT_DRY_RUN"):
            env.pop(var, None)
        env.update(extra)
        return subprocess.run(["bash", str(SBATCH), *overrides], capture_output=True, text=True, env=env,
                              timeout=120, cwd=REPO)

    run.srun_args = lambda: (tmp_path / "srun.args").read_text().splitlines()  # type: ignore[attr-defined]
    run.srun_called = lambda: (tmp_path / "srun.args").exists()  # type: ignore[attr-defined]
    return run


def node_commands(stdout: str) -> list[tuple[dict[str, str], list[str]]]:
    return [parse_torchrun(line) for line in stdout.splitlines() if line.startswith(("torchrun", sys.executable))]


def test_slurm_one_group_per_node(slurm) -> None:
    """2 nodes x 4 GPUs, NODES_PER_GROUP=1: 2 groups of 4; rendezvous on the first host. The topology
    check (a real config compose) runs on every node and agrees with what the batch script computed."""
    proc = slurm("algo=a_edit", "model=tiny", check=True)
    assert proc.returncode == 0, proc.stderr
    cmds = node_commands(proc.stdout)
    assert len(cmds) == 2, proc.stdout
    for rank, (flags, overrides) in enumerate(cmds):
        assert flags["--nnodes"] == "2" and flags["--node-rank"] == str(rank) and flags["--nproc-per-node"] == "4"
        assert flags["--rdzv-endpoint"] == f"gpu-a0:{10000 + 4242 % 20000}"
        assert flags["--rdzv-id"] == "edit-4242" and flags["--rdzv-backend"] == "static"
        assert overrides == ["algo=a_edit", "model=tiny", "cluster.groups=2", "cluster.shard_size=4",
                             "run.dir=runs/edit-4242"]
    assert "node 1/2: ranks 4..7, worker group 1" in proc.stderr
    args = slurm.srun_args()
    assert "--ntasks-per-node=1" in args and "--nodes=2" in args and "--cpus-per-task=32" in args
    assert "--kill-on-bad-exit=1" in args


def test_slurm_groups_span_nodes_in_the_given_order(slurm) -> None:
    """4 nodes, 2 per group (cluster); EDIT_NODE_ORDER puts cluster b first: b0, b1 are group 0."""
    proc = slurm("resume=false", hosts="a0 a1 b0 b1", nodelist="a[0-1],b[0-1]", NODES_PER_GROUP="2",
                 EDIT_NODE_ORDER="b[0-1],a[0-1]", NPROC_PER_NODE="2", RDZV_PORT="29400", SLURM_RESTART_COUNT="1")
    assert proc.returncode == 0, proc.stderr
    cmds = node_commands(proc.stdout)
    assert [f["--node-rank"] for f, _ in cmds] == ["2", "3", "0", "1"]  # a0 a1 b0 b1
    for flags, overrides in cmds:
        assert flags["--rdzv-endpoint"] == "b0:29400" and flags["--nproc-per-node"] == "2"
        assert overrides == ["resume=false", "cluster.groups=2", "cluster.shard_size=4", "run.dir=runs/edit-4242"]


def test_slurm_requeued_job_resumes(slurm) -> None:
    proc = slurm(SLURM_RESTART_COUNT="2")
    assert proc.returncode == 0, proc.stderr
    for _, overrides in node_commands(proc.stdout):
        assert "resume=auto" in overrides


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"hosts": "n0 n1 n2", "nodelist": "n[0-2]", "NODES_PER_GROUP": "2"},
     "NNODES (3) is not a multiple of NODES_PER_GROUP (2)"),
    ({"SLURM_HET_SIZE": "2"}, "heterogeneous Slurm jobs"),
    ({"args": ("cluster.groups=3",)}, "cluster.groups=3 contradicts the allocation"),
    ({"EDIT_NODE_ORDER": "gpu-a0,gpu-b7"}, "must list exactly the allocated nodes"),
])
def test_slurm_refuses_before_launching(slurm, kwargs: dict, needle: str) -> None:
    args = kwargs.pop("args", ())
    proc = slurm(*args, **kwargs)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr
    assert not slurm.srun_called()


def test_slurm_refuses_nodes_with_different_gpu_counts(slurm) -> None:
    proc = slurm(FAKE_NODE_GPUS="4 2")
    assert proc.returncode != 0
    assert "node gpu-a1 has 2 GPUs but the first node has 4" in proc.stderr
    assert "heterogeneous GPU counts are not supported" in proc.stderr


# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [LOCAL, MULTINODE, SBATCH], ids=lambda p: p.name)
def test_shell_syntax(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
