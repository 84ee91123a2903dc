"""Docs that run (issue 48): the shell blocks of README "Run across sites", docs/across_sites.md and
launchers/README.md.

* `test_every_doc_block_is_run_or_says_why_not` (default suite, no hosts): every shell block of the three
  documents is one this file runs on namespace hosts, or is listed in NOT_RUN with the reason; a new or
  changed block fails it until it is one or the other.
* `test_the_recipe_runs_as_written_on_hosts` (multi-host tier, slow): the recipe block executed line by line
  as written on hosts lh0, a0, a1, b0 (network namespaces with those hostnames, every link shaped to 100 Mbit/s
  with `tc tbf`, no netem), with the documented files (`launchers/torchrun_multinode.sh`,
  `launchers/slurm/edit.sbatch` under a stand-in Slurm of one node, b0), then the Lighthouse restart block of
  docs/across_sites.md while the clusters train. Substituted is only what the docs say is the user's: `ARGS`
  (the run: sizes for CPU ranks, a test-sized run), the paths (/shared -> a temporary directory), the
  Lighthouse's address (10.0.0.5 -> lh0's) and NPROC_PER_NODE (no GPUs here). Acceptance 1: `config.json`
  has no simulated link or slowdown, and a sync's blocked time on the 100 Mbit/s link is bytes / rate plus
  less than what the demo's simulated link (100 Mbit/s, 50 ms) would have added on top.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = {"README.md": REPO / "README.md", "docs/across_sites.md": REPO / "docs" / "across_sites.md",
        "launchers/README.md": REPO / "launchers" / "README.md"}
RECIPE = "README.md"  # its block is docs/across_sites.md's "Multi-node" block, line for line
RESTART = ("docs/across_sites.md", "lh0$ edit-train-lighthouse --bind 10.0.0.5:29510 federation.key_file=$KEY_FILE "
           "federation.roster_file=$ROSTER_FILE federation.identity_file=/shared/fed/gate.identity "
           "federation.min_clusters=2")
WORKED = ("launchers/README.md", "# the same arguments for every cluster")
SLURM = ("launchers/README.md", "export KEY_FILE=/secrets/fed/federation.key ROSTER_FILE=/secrets/fed/roster.json   "
                                "# sbatch passes them on")
# (document, the block's first line) -> why the hosts test does not run it
NOT_RUN = {
    ("docs/across_sites.md", "edit-train cluster=local_2x2 algo=edit          # a Lighthouse + 2 clusters of 2 "
                             "ranks on this host"): "local runs on one host: tests/integration/test_federation.py and "
                                                    "tests/integration/test_distributed.py run them",
    ("docs/across_sites.md", "edit-train-keygen fed.key                 # once, on a machine you trust: 32 random "
                             "bytes, mode 0600"): "copies the key over ssh/scp, which the namespace hosts do "
                                                  "not run; the recipe's keygen makes and uses the same file",
    ("docs/across_sites.md", "rsync -a --exclude checkpoints siteA:/scratch/edit/exp1/ runs/exp1-a/"):
        "copies run directories from two sites over ssh (rsync); the merge block after it is plain files",
    ("docs/across_sites.md", "mkdir -p runs/exp1/clusters"): "merges two sites' run directories, which the "
                                                             "recipe run (one shared run.dir) does not make",
}


def shell_blocks(doc: str) -> list[list[str]]:
    """The ```bash blocks of `doc` (README: its "Run across sites" section only), each as its commands: lines
    dedented, a line continued with a backslash joined to the next."""
    text = DOCS[doc].read_text()
    if doc == "README.md":
        text = text[text.index("## Run across sites"):]
        text = text[:text.index("\n## ", 5)]
    blocks = []
    for m in re.finditer(r"^( *)```(?:bash|sh)\n(.*?)^\1```", text, flags=re.M | re.S):
        indent = len(m.group(1))
        lines: list[str] = []
        for ln in m.group(2).splitlines():
            ln = ln[indent:]
            if lines and lines[-1].endswith("\\"):  # a continued line: one command, as the shell reads it
                lines[-1] = lines[-1][:-1].rstrip() + " " + ln.strip()
            else:
                lines.append(ln)
        blocks.append(lines)
    return blocks


def test_every_doc_block_is_run_or_says_why_not() -> None:
    run = {(RECIPE, shell_blocks(RECIPE)[0][0]), ("docs/across_sites.md", shell_blocks(RECIPE)[0][0]), RESTART, WORKED, SLURM}
    seen = set()
    for doc in DOCS:
        for block in shell_blocks(doc):
            key = (doc, block[0])
            seen.add(key)
            assert key in run or key in NOT_RUN, f"{doc}: a shell block neither run nor marked: {block[0]!r}"
    assert run | set(NOT_RUN) == seen, sorted((run | set(NOT_RUN)) - seen)  # no stale entries
    # the recipe of docs/across_sites.md is the README's, line for line (the hosts test runs it once)
    multi = [b for b in shell_blocks("docs/across_sites.md") if b[0].startswith("ARGS=")]
    assert multi == [shell_blocks(RECIPE)[0]]
    # every cluster job of every recipe names the real preset and, with a roster, its identity (issue 48, 6)
    for doc in DOCS:
        for block in shell_blocks(doc):
            for line in block:
                if line.lstrip().startswith("ARGS="):
                    assert "cluster=real" in line, (doc, line)
                if re.search(r"\bCLUSTER=\w+ ", line) and "ROSTER_FILE" in "\n".join(block):
                    assert "IDENTITY_FILE=" in line, (doc, line)
                if "edit-train-lighthouse" in line and "ROSTER_FILE" in "\n".join(shell_blocks(doc)[0]):
                    assert "federation.roster_file=" in line and "federation.identity_file=" in line, (doc, line)


# ------------------------------------------------------------------------------------------------ the hosts tier
RATE_MBIT = 100.0
# train.steps: A-EDiT's run ends once a strict majority of the clusters reached it (the slow one of two, 1:12 or
# slower here): 400 kept the slow cluster training for 20+ minutes on busy cores (issue 49)
TEST_RUN = ["model=tiny", "logger=none", "train.steps=60", "train.seq_len=32", "train.batch_size=2",
            "train.eval_every=0", "train.eval_batches=1", "train.log_every=10", "train.progress=false",
            "train.threads=1", "sync.mode=at_end", "algo.sync_time_s=3", "checkpoint.at_end=false",
            "federation.heartbeat_timeout_s=3", "federation.join_timeout_s=5", "federation.collective_timeout_s=60"]
LONG = ("edit-train-lighthouse", "launchers/torchrun_multinode.sh")  # run in the background; the rest to the end

FAKE_SBATCH = r"""#!/usr/bin/env bash
# A stand-in sbatch: the job's nodes are FAKE_SLURM_NODES_<cluster> (FAKE_SLURM_NODES_lighthouse for
# lighthouse.sbatch; comma-separated), each node the network namespace FAKE_SLURM_NS_<node>. The batch script runs
# on the first node in the background with the job's Slurm environment: $FAKE_SLURM_DIR/<cluster>-<id>.out, and
# its exit code in <cluster>-<id>.rc.
set -euo pipefail
nodes=1
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in --nodes=*) nodes=${1#--nodes=} ;; esac
    shift
done
if [[ $1 == *lighthouse.sbatch ]]; then job=lighthouse; else job=${CLUSTER:?fake sbatch: CLUSTER is not set}; fi
var=FAKE_SLURM_NODES_$job
list=${!var:?fake sbatch: no nodes for $job}
IFS=, read -ra hosts <<<"$list"
((${#hosts[@]} == nodes)) || { echo "fake sbatch: $job has ${#hosts[@]} node(s), asked for $nodes" >&2; exit 1; }
id=$((4200 + $(ls "$FAKE_SLURM_DIR" | grep -c '\.out$' || true)))
ns=FAKE_SLURM_NS_${hosts[0]}
: >"$FAKE_SLURM_DIR/$job-$id.out"
(
    rc=0
    ip netns exec "${!ns}" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "${hosts[0]}" \
        env SLURM_JOB_ID=$id SLURM_JOB_NODELIST="$list" SLURM_NNODES=$nodes SLURM_SUBMIT_DIR="$PWD" \
        SLURM_JOB_NAME=edit-train bash "$@" >"$FAKE_SLURM_DIR/$job-$id.out" 2>&1 </dev/null || rc=$?
    echo $rc >"$FAKE_SLURM_DIR/$job-$id.rc"
) &
echo "Submitted batch job $id"
"""
FAKE_SRUN = r"""#!/usr/bin/env bash
# A stand-in srun: the command once on every node of the job (in its namespace, SLURM_NODEID = its index).
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
IFS=, read -ra hosts <<<"$SLURM_JOB_NODELIST"
pids=()
for i in "${!hosts[@]}"; do
    ns=FAKE_SLURM_NS_${hosts[$i]}
    ip netns exec "${!ns}" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "${hosts[$i]}" \
        env SLURM_NODEID=$i SLURMD_NODENAME="${hosts[$i]}" "$@" &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = r"""#!/usr/bin/env bash
[[ $1 == show && $2 == hostnames ]] && tr , '\n' <<<"$3"
"""


def substitute(line: str, shared: Path, lh_addr: str, data: str) -> str:
    """What the docs say is the user's: the paths, the Lighthouse's address, the run (ARGS), the GPUs per node."""
    line = line.replace("/shared/", f"{shared}/").replace("10.0.0.5", lh_addr)
    # the key's two places (made in /secure/fed, copied to /secrets/fed) are one directory on these hosts
    line = line.replace("/secure/fed", f"{shared}/fed").replace("/secrets/fed", f"{shared}/fed")
    line = re.sub(r"NPROC_PER_NODE=\d+", "NPROC_PER_NODE=1", line)
    if line.startswith("ARGS="):
        line = re.sub(r"ranks:(\d+)", lambda m: f"ranks:{2 if m.group(1) == '16' else 1}", line)
        line = re.sub(r'"(  #.*)?$', " " + " ".join([*TEST_RUN, f"data.source={data}"]) + '"', line)
    return line


def commands(block: list[str]) -> list[tuple[str | None, str]]:
    """(host or None = the machine you type on, command) per line; `host$ ` prompts name the host."""
    out = []
    for line in block:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.match(r"^(\w+)\$\s+(.*)$", line)
        out.append((m.group(1), m.group(2)) if m else (None, line.strip()))
    return out


class Shell:
    """Runs a block's lines as a user's shell would: assignments and exports carry to the later lines."""

    def __init__(self, net: Any, cwd: Path, env: dict[str, str], logs: Path) -> None:
        self.net, self.cwd, self.env, self.logs = net, cwd, env, logs
        self.state: list[str] = []
        self.bg: dict[str, subprocess.Popen] = {}

    def run(self, host: str | None, cmd: str, log: str) -> None:
        script = "\n".join([*self.state, cmd])
        argv = ["bash", "-c", script]
        if re.match(r"^(export\s+)?[A-Z_]+=", cmd) and not any(x in cmd for x in (" sbatch ", *LONG)):
            self.state.append(cmd)  # `ARGS=…`, `export KEY_FILE=…`
            return
        out = open(self.logs / f"{log}.log", "a")  # noqa: SIM115 - the process owns it
        if any(x in cmd for x in LONG):
            proc = (self.net.popen(host, argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd)
                    if host else subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                                  cwd=self.cwd, start_new_session=True))
            self.bg[log] = proc
            return
        done = (self.net.run(host, argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, timeout=300)
                if host else subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                            timeout=300))
        assert done.returncode == 0, f"{cmd!r} on {host or 'this machine'} exited {done.returncode}:\n" + \
            (self.logs / f"{log}.log").read_text()[-3000:]


def _log_tail(logs: Path) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text()[-2500:]}" for p in sorted(logs.glob("*")) if p.is_file())


class Site:
    """Namespace hosts, the stand-in Slurm (`slurm_nodes`: each job's nodes) and a shell that runs a doc block's
    lines on them."""

    def __init__(self, tmp_path: Path, net: Any, data: str, slurm_nodes: dict[str, str] | None = None) -> None:
        self.net, self.data = net, data
        self.shared, self.logs, bin_dir, self.slurm, cwd = (tmp_path / d for d in ("shared", "logs", "bin", "slurm",
                                                                                   "cwd"))
        for d in (self.shared, self.logs, bin_dir, self.slurm, cwd):
            d.mkdir()
        (cwd / "launchers").symlink_to(REPO / "launchers")  # `launchers/…` from the repository root; writes stay here
        for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("EDIT_TRAIN_", "EDIT_DRY", "KEY_FILE", "ROSTER_FILE", "IDENTITY_FILE", "SLURM_",
                                    "TORCHELASTIC_", "LOCAL_RANK", "WORLD_SIZE", "RANK", "LIGHTHOUSE"))}
        env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]),
                    "FAKE_SLURM_DIR": str(self.slurm), **{f"FAKE_SLURM_NS_{h}": net.ns(h) for h in net.names},
                    **{f"FAKE_SLURM_NODES_{job}": nodes for job, nodes in (slurm_nodes or {}).items()}})
        self.cwd = cwd
        self.shell = Shell(net, cwd, env, self.logs)

    def run(self, block: list[str], tag: str = "") -> None:
        """Every line of `block`, in order, as written (but for the substitutions); a Lighthouse is waited for until
        it serves, as a user would before starting the clusters."""
        for i, (host, cmd) in enumerate(commands(block)):
            cmd = substitute(cmd, self.shared, self.net.address("lh0"), self.data)
            addr = sorted(self.cwd.glob("lighthouse-*.addr"))
            if addr:  # the job id sbatch printed, where the docs say <jobid>
                cmd = cmd.replace("<jobid>", addr[0].name[len("lighthouse-"):-len(".addr")])
            log = f"{tag}{i:02d}-{host or 'local'}"
            self.shell.run(host, cmd, log)
            if "lighthouse.sbatch" in cmd:  # a user waits for the job to start and write its address
                deadline = time.time() + 90
                while not list(self.cwd.glob("lighthouse-*.addr")) or "serving at" not in "".join(
                        p.read_text() for p in self.slurm.glob("lighthouse-*.out")):
                    assert time.time() < deadline, self.tail()
                    time.sleep(0.2)
            if "edit-train-lighthouse" in cmd:
                deadline = time.time() + 90
                while "serving at" not in (self.logs / f"{log}.log").read_text():
                    assert time.time() < deadline, self.tail()
                    time.sleep(0.2)

    def jobs(self) -> list[subprocess.Popen]:
        return [p for name, p in self.shell.bg.items() if "lh0" not in name]

    def finish(self) -> list[int]:
        """Every cluster job's exit code (the stand-in sbatch's jobs write theirs)."""
        codes = [p.wait(timeout=600) for p in self.jobs()]
        submitted = [p.with_suffix(".rc") for p in self.slurm.glob("*.out") if not p.name.startswith("lighthouse-")]
        deadline = time.time() + 600
        while not all(rc.exists() for rc in submitted):
            assert time.time() < deadline, self.tail()
            time.sleep(0.5)
        return codes + [int(rc.read_text()) for rc in sorted(submitted)]

    def tail(self) -> str:
        return _log_tail(self.logs) + "\n" + "\n".join(p.read_text()[-3000:] for p in self.slurm.glob("*.out"))


def _no_simulation(run_dir: Path) -> None:
    """Acceptance 1: the run's config.json has no simulated link, slowdown or fault."""
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["cluster"]["name"] == "real" and cfg["cluster"]["link"] == {"bandwidth_mbps": 0.0, "latency_ms": 0.0}
    assert cfg["cluster"]["slowdown"] == [] and not cfg["faults"] and not cfg["cluster"]["slowdown_schedule"]
    assert all(float(c.get("slowdown", 1.0)) == 1.0 for c in cfg["cluster"]["clusters"])


@pytest.mark.slow
@pytest.mark.hosts
def test_the_recipe_runs_as_written_on_hosts(tmp_path: Path, small_corpus: str) -> None:
    from edit_train.sim import hosts as sim_hosts

    why = sim_hosts.unavailable() if sys.platform == "linux" else "needs Linux network namespaces"
    if why:
        pytest.skip(f"multi-host tier: {why}")
    from fed_utils import events

    with sim_hosts.Hosts(["lh0", "a0", "a1", "b0"], rate_mbit=RATE_MBIT) as net:
        site = Site(tmp_path, net, small_corpus, slurm_nodes={"b": "b0"})
        started = time.time()
        site.run(shell_blocks(RECIPE)[0])
        run_dir = site.shared / "exp1"

        def both() -> list[dict[str, Any]]:
            return [e for e in events(run_dir) if e["event"] == "sync" and sorted(e["quorum"]) == ["a", "b"]]

        deadline = time.time() + 400
        while len({e["sync"] for e in both()}) < 3:
            assert time.time() < deadline and all(p.poll() is None for p in site.jobs()), site.tail()
            time.sleep(0.5)

        # docs/across_sites.md, "When the Lighthouse dies": restart it where it was, with its roster and identity
        net.kill("lh0")
        n_before = len({e["sync"] for e in both()})
        site.run(next(b for b in shell_blocks(RESTART[0]) if b[0] == RESTART[1]), tag="restart-")
        deadline = time.time() + 180
        while len({e["sync"] for e in both()}) <= n_before:
            assert time.time() < deadline, "no sync of a and b after the Lighthouse restart\n" + site.tail()
            time.sleep(0.5)
        codes = site.finish()
        took = time.time() - started
    all_logs = site.tail()
    assert codes == [0, 0, 0], all_logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and set(summary["per_cluster"]) == {"a", "b"}, all_logs
    assert "Traceback" not in all_logs, all_logs
    print(f"the recipe on hosts: {took:.0f}s")
    _no_simulation(run_dir)
    b_syncs = [e for e in both() if e["cluster"] == "b"]
    print("b's syncs: bytes", [e["bytes"] for e in b_syncs], "blocked_s", [round(e["blocked_s"], 3) for e in b_syncs])


@pytest.mark.slow
@pytest.mark.hosts
def test_the_worked_example_runs_as_written_on_hosts(tmp_path: Path, small_corpus: str) -> None:
    """launchers/README.md's three clusters: a on a0 + a1, b on b0, c on c0, the Lighthouse on lh0."""
    from edit_train.sim import hosts as sim_hosts

    why = sim_hosts.unavailable() if sys.platform == "linux" else "needs Linux network namespaces"
    if why:
        pytest.skip(f"multi-host tier: {why}")
    with sim_hosts.Hosts(["lh0", "a0", "a1", "b0", "c0"], rate_mbit=RATE_MBIT) as net:
        site = Site(tmp_path, net, small_corpus)
        started = time.time()
        site.run(next(b for b in shell_blocks(WORKED[0]) if b[0] == WORKED[1]))
        codes = site.finish()
        took = time.time() - started
    all_logs = site.tail()
    assert codes == [0, 0, 0, 0], all_logs
    run_dir = site.shared / "edit" / "ab1"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and set(summary["per_cluster"]) == {"a", "b", "c"}, all_logs
    assert "Traceback" not in all_logs, all_logs
    print(f"the worked example on hosts: {took:.0f}s")
    _no_simulation(run_dir)


@pytest.mark.slow
@pytest.mark.hosts
def test_the_slurm_example_runs_as_written_on_hosts(tmp_path: Path, small_corpus: str) -> None:
    """launchers/README.md "With Slurm", after the worked example's ARGS, keygen and key (its lines before the
    Lighthouse): lighthouse.sbatch on lh0, edit.sbatch for a (two nodes: a0, a1), b (b0) and c (c0), under a
    stand-in Slurm (sbatch, srun, scontrol) that places each job on its nodes' network namespaces."""
    from edit_train.sim import hosts as sim_hosts

    why = sim_hosts.unavailable() if sys.platform == "linux" else "needs Linux network namespaces"
    if why:
        pytest.skip(f"multi-host tier: {why}")
    worked = next(b for b in shell_blocks(WORKED[0]) if b[0] == WORKED[1])
    once = worked[:next(i for i, ln in enumerate(worked) if ln.startswith("lh0$"))]
    with sim_hosts.Hosts(["lh0", "a0", "a1", "b0", "c0"], rate_mbit=RATE_MBIT) as net:
        site = Site(tmp_path, net, small_corpus,
                    slurm_nodes={"lighthouse": "lh0", "a": "a0,a1", "b": "b0", "c": "c0"})
        started = time.time()
        site.run(once)
        site.run(next(b for b in shell_blocks(SLURM[0]) if b[0] == SLURM[1]), tag="slurm-")
        codes = site.finish()
        took = time.time() - started
    all_logs = site.tail()
    assert codes == [0, 0, 0], all_logs
    run_dir = site.shared / "edit" / "ab1"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and set(summary["per_cluster"]) == {"a", "b", "c"}, all_logs
    assert "Traceback" not in all_logs, all_logs
    print(f"the Slurm example on hosts: {took:.0f}s")
    _no_simulation(run_dir)


def _federation(net: Any, tmp_path: Path, tag: str, key: str, data: str, *extra: str) -> list[dict[str, Any]]:
    """Clusters x (on x0) and y (on y0), one rank each, each its own torchrun_multinode.sh job at the Lighthouse
    on lh1; returns y's sync events with both in the quorum."""
    from fed_utils import events

    run_dir = tmp_path / tag
    overrides = ["cluster=real", "cluster.clusters=[{name:x,ranks:1},{name:y,ranks:1}]", "algo=edit",
                 "algo.interval=4", "sync.mode=at_end", "algo.rule.verified.probe_tokens=0", "model=tiny",
                 "logger=none", "train.steps=36", "train.seq_len=32", "train.batch_size=2", "train.eval_every=0",
                 "train.eval_batches=1", "train.progress=false", "train.threads=1", "checkpoint.at_end=false",
                 "federation.min_clusters=2", "federation.join_timeout_s=30", "federation.collective_timeout_s=60",
                 f"data.source={data}", f"run.dir={run_dir}", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EDIT_TRAIN_", "EDIT_DRY", "TORCHELASTIC_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable})
    procs = []
    for name, host in (("x", "x0"), ("y", "y0")):
        out = open(tmp_path / f"{tag}-{name}.log", "w")  # noqa: SIM115 - the process owns it
        e = {**env, "CLUSTER": name, "LIGHTHOUSE": "lh1:29510", "NNODES": "1", "NODE_RANK": "0", "NPROC_PER_NODE": "1",
             "RDZV_ENDPOINT": f"{host}:29500", "KEY_FILE": key, "MAX_RESTARTS": "0"}
        procs.append(net.popen(host, ["bash", str(REPO / "launchers" / "torchrun_multinode.sh"), *overrides],
                               stdout=out, stderr=subprocess.STDOUT, env=e, cwd=tmp_path))
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0, 0], _log_tail(tmp_path)
    return sorted((e for e in events(run_dir) if e["event"] == "sync" and e["cluster"] == "y"
                   and sorted(e["quorum"]) == ["x", "y"]), key=lambda e: e["sync"])


@pytest.mark.slow
@pytest.mark.hosts
def test_a_sync_on_a_real_link_pays_no_simulated_delay(tmp_path: Path, small_corpus: str) -> None:
    """Acceptance 1, the link: two one-rank clusters (real cluster jobs, cluster=real) on hosts whose links are
    shaped to 1 Gbit/s with tbf, `sync.mode=at_end` (each sync blocks: its time is the exchange). A sync's time
    is bytes / rate plus the sync's own work; the same federation with the demo's simulated link forced
    (`sim.force=true`, 100 Mbit/s + 50 ms: what every real job got before) takes at least the link model's
    bytes / 100 Mbit/s longer. One-sided: the real run's sync is not slowed by half that model's delay."""
    from edit_train.federation import auth
    from edit_train.federation.link import LinkModel
    from edit_train.sim import hosts as sim_hosts

    why = sim_hosts.unavailable() if sys.platform == "linux" else "needs Linux network namespaces"
    if why:
        pytest.skip(f"multi-host tier: {why}")
    key = str(auth.new_key(tmp_path / "fed.key"))
    rate = 1000.0
    with sim_hosts.Hosts(["lh1", "x0", "y0"], rate_mbit=rate) as net:
        out = open(tmp_path / "lh1.log", "w")  # noqa: SIM115 - the process owns it
        net.popen("lh1", ["edit-train-lighthouse", "--bind", f"{net.address('lh1')}:29510",
                          f"federation.key_file={key}", "federation.min_clusters=2", "federation.join_timeout_s=30"],
                  stdout=out, stderr=subprocess.STDOUT,
                  env={**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])})
        deadline = time.time() + 90
        while "serving at" not in (tmp_path / "lh1.log").read_text():
            assert time.time() < deadline, _log_tail(tmp_path)
            time.sleep(0.2)
        real = _federation(net, tmp_path, "real", key, small_corpus)[1:]  # the first sync also waits for start-up
        simulated = _federation(net, tmp_path, "simulated", key, small_corpus, "sim.force=true",
                                "cluster.link.bandwidth_mbps=100", "cluster.link.latency_ms=50")[1:]
    assert real and simulated, _log_tail(tmp_path)
    nbytes = statistics.median(e["bytes"] for e in real)
    wire = nbytes * 8 / (rate * 1e6)
    model_extra = LinkModel(100, 50).seconds(int(nbytes)) - wire  # what the demo's link adds over this one, at least
    real_s = statistics.median(e["blocked_s"] for e in real)
    sim_s = statistics.median(e["blocked_s"] for e in simulated)
    print(f"sync of {nbytes / 1e6:.1f} MB: bytes/rate {wire:.3f}s; real link {real_s:.3f}s; with the demo's simulated "
          f"link {sim_s:.3f}s (its model adds >= {model_extra:.3f}s)")
    assert real_s - wire < model_extra / 2, (real_s, wire, model_extra)  # bytes / rate and the sync's own work
    assert sim_s - real_s > model_extra / 2, (real_s, sim_s, model_extra)  # what every real job paid before
