"""The multi-host tier: every cluster and the Lighthouse on a host of its own (edit_train/sim/hosts.py — a
network namespace with its own address and a hostname resolving to it, links shaped to 100 Mbit/s with tc
tbf), driven with the README's multi-host recipe (`edit-train-lighthouse` + `launchers/torchrun_multinode.sh`
per host) and the default algorithm, a_edit.

Marked `hosts`; all three cases run in the default suite (about 150 s on 2 cores; `pytest -q -m hosts` runs
the tier alone). They are the default run's kill / partition / heal tests of the default algorithm; the
loopback ones of tests/integration/test_federation.py (algo=edit) are `slow`. Where namespaces
cannot be built (not root, no `ip netns` / `tc tbf`) the tier skips with one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edit_train.federation import auth
from edit_train.sim import hosts as sim_hosts
from fed_utils import events
from words import retired_in_run

REPO = Path(__file__).resolve().parents[2]
MULTINODE = REPO / "launchers" / "torchrun_multinode.sh"

_why = sim_hosts.unavailable() if sys.platform == "linux" else "needs Linux network namespaces"
pytestmark = [pytest.mark.hosts, pytest.mark.skipif(_why is not None, reason=f"multi-host tier: {_why}")]

# a_edit (the default) with test-sized steps: a 2 s sync budget, steps stretched by the simulated slowdown
RUN = ["algo=a_edit", "algo.sync_time_s=2", "model=tiny", "logger=none", "train.progress=false", "train.seq_len=32",
       "train.batch_size=2", "train.eval_every=0", "train.eval_batches=1", "train.log_every=2", "train.threads=1",
       "cluster.clusters=[{name:a,ranks:1,slowdown:4},{name:b,ranks:1,slowdown:4}]", "sim.force=true",
       "federation.heartbeat_timeout_s=2", "federation.join_timeout_s=3", "federation.collective_timeout_s=10"]


@pytest.fixture
def net() -> Iterator[sim_hosts.Hosts]:
    with sim_hosts.Hosts(["lh", "a", "b", "c"]) as h:
        yield h


@pytest.fixture
def key(tmp_path: Path) -> str:
    return str(auth.new_key(tmp_path / "fed.key"))


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("EDIT_TRAIN_CLUSTER", "EDIT_DRY", "KEY_FILE"))}
    out.pop(auth.KEY_ENV, None)
    return {**out, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def lighthouse(net: sim_hosts.Hosts, tmp_path: Path, key: str, *overrides: str, log: str = "lh") -> subprocess.Popen:
    """`lh$ edit-train-lighthouse --bind <lh's address>:29510 federation.key_file=KEY ...` (the README's line)."""
    out = open(tmp_path / f"{log}.log", "a")  # noqa: SIM115 - the process owns it
    proc = net.popen("lh", ["edit-train-lighthouse", "--bind", f"{net.address('lh')}:29510",
                            f"federation.key_file={key}", *overrides], stdout=out, stderr=subprocess.STDOUT,
                     env=env())
    deadline = time.time() + 60
    while "serving at" not in (tmp_path / f"{log}.log").read_text():
        assert proc.poll() is None and time.time() < deadline, (tmp_path / f"{log}.log").read_text()
        time.sleep(0.1)
    return proc


def cluster(net: sim_hosts.Hosts, tmp_path: Path, name: str, key: str, *overrides: str, host: str | None = None,
            log: str | None = None) -> subprocess.Popen:
    """`a0$ CLUSTER=a LIGHTHOUSE=lh:29510 NNODES=1 NODE_RANK=0 NPROC_PER_NODE=1 RDZV_ENDPOINT=a:29500
    KEY_FILE=... launchers/torchrun_multinode.sh ...` — on its own host, addressed by host names."""
    host = host or name
    out = open(tmp_path / f"{log or name}.log", "a")  # noqa: SIM115 - the process owns it
    e = env(CLUSTER=name, LIGHTHOUSE="lh:29510", NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1",
            RDZV_ENDPOINT=f"{host}:29500", KEY_FILE=key)
    return net.popen(host, ["bash", str(MULTINODE), *overrides], stdout=out, stderr=subprocess.STDOUT, env=e,
                     cwd=tmp_path)


def syncs(run_dir: Path, cluster_name: str) -> list[dict[str, Any]]:
    return [e for e in events(run_dir) if e["event"] == "sync" and e.get("cluster") == cluster_name]


def wait_until(pred: Any, timeout: float, what: str, procs: list[subprocess.Popen] = ()) -> None:
    deadline = time.time() + timeout
    while not pred():
        for p in procs:
            assert p.poll() is None, f"{what}: a process exited early (rc {p.returncode})"
        assert time.time() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.2)


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text()[-2500:]}" for p in sorted(tmp_path.glob("*.log")))


def test_recipe_across_hosts_with_a_wrong_key_and_a_restarted_lighthouse(net: sim_hosts.Hosts, tmp_path: Path,
                                                                          key: str, small_corpus: str) -> None:
    """The README's recipe verbatim on three hosts whose hostnames resolve to their own LAN addresses, with
    a_edit: both clusters train to the end with syncs together. Meanwhile a cluster started with another key
    exits non-zero within join_timeout_s + 60 s with one line naming its key, and the Lighthouse, killed and
    restarted on its port at once, binds it and the two clusters sync together again."""
    run_dir = tmp_path / "shared" / "exp1"  # one filesystem: the README's run.dir=/shared/exp1
    house = lighthouse(net, tmp_path, key, "federation.min_clusters=2")
    common = [*RUN, f"data.source={small_corpus}", f"run.dir={run_dir}", "train.steps=150"]
    a = cluster(net, tmp_path, "a", key, *common)
    b = cluster(net, tmp_path, "b", key, *common)
    stranger_key = str(auth.new_key(tmp_path / "other.key"))
    started = time.time()
    c = cluster(net, tmp_path, "c", stranger_key, *common)  # a new cluster name: it would join and heal
    both = lambda: [e for e in syncs(run_dir, "a") if e["quorum"] == ["a", "b"]]  # noqa: E731
    wait_until(lambda: len(both()) >= 2, 240, "two syncs of a and b", [a, b])

    # the Lighthouse dies and is restarted on its port at once (well within 2 s of its death): it binds — no
    # EADDRINUSE from the connections it left in TIME-WAIT — and a and b sync together again
    net.kill("lh")
    house.wait(timeout=10)
    house = lighthouse(net, tmp_path, key, "federation.min_clusters=2", log="lh-restarted")  # serving, or fails
    n_before = len(both())
    wait_until(lambda: len(both()) > n_before, 120, "a sync of a and b after the restart", [a, b])

    # a cluster holding another key: one line, exit code != 0, within join_timeout_s (3) + 60 s of starting
    rc = c.wait(timeout=3 + 60 + 30)
    took = time.time() - started
    c_log = (tmp_path / "c.log").read_text()
    assert rc != 0 and took <= 3 + 60 + 30, c_log
    refusal = [ln for ln in c_log.splitlines() if "holds another federation key" in ln]
    assert len(refusal) == 1 and "other.key" in refusal[0] and "lh:29510" in refusal[0], c_log
    assert "Traceback" not in c_log, c_log  # stopped before torchrun: no restarts, no torchrun report
    assert not [e for e in events(run_dir) if e.get("cluster") == "c" and e["event"] == "sync"]

    assert [a.wait(timeout=300), b.wait(timeout=300)] == [0, 0], logs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and set(summary["per_cluster"]) == {"a", "b"}, summary
    for name in ("a", "b"):
        assert summary["per_cluster"][name]["syncs_joined"] >= 3, summary["per_cluster"][name]
        assert "holds another federation key" not in (tmp_path / f"{name}.log").read_text()
    assert retired_in_run(run_dir) == []  # one word per concept (tests/docs/test_words.py)


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_partition_and_host_death_with_a_edit(net: sim_hosts.Hosts, tmp_path: Path, key: str,
                                              small_corpus: str) -> None:
    """A host cut off (its link down) keeps training alone and rejoins; a host killed (every process in it)
    and started again heals from the live peer; the other cluster never stops."""
    run_dir = tmp_path / "run"
    lighthouse(net, tmp_path, key, "federation.min_clusters=1")
    common = [*RUN, f"data.source={small_corpus}", f"run.dir={run_dir}", "train.steps=250",
              "federation.min_clusters=1"]
    a = cluster(net, tmp_path, "a", key, *common)
    b = cluster(net, tmp_path, "b", key, *common)
    both = lambda: [e for e in syncs(run_dir, "a") if e["quorum"] == ["a", "b"]]  # noqa: E731
    wait_until(lambda: len(both()) >= 2, 240, "two syncs of a and b", [a, b])

    net.cut("b")
    n = len(syncs(run_dir, "a"))
    wait_until(lambda: any(e["quorum"] == ["a"] for e in syncs(run_dir, "a")[n:]), 60,
               "a syncing alone while b is cut off", [a, b])
    net.mend("b")
    n = len(both())
    wait_until(lambda: len(both()) > n, 90, "a and b together after the partition", [a, b])

    net.kill("b")  # the host dies: its launcher, torchrun and worker
    b.wait(timeout=10)
    n = len(syncs(run_dir, "a"))
    wait_until(lambda: any(e["quorum"] == ["a"] for e in syncs(run_dir, "a")[n:]), 60,
               "a syncing alone after b's host died", [a])
    b2 = cluster(net, tmp_path, "b", key, *common, "resume=auto", log="b-restarted")  # as the error tells
    assert [a.wait(timeout=400), b2.wait(timeout=400)] == [0, 0], logs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"], summary
    assert summary["per_cluster"]["b"]["healed_from"] == ["a"], summary["per_cluster"]["b"]
    assert both()[-1]["quorum"] == ["a", "b"]


def test_local_demo_on_a_host_whose_name_is_not_loopback(net: sim_hosts.Hosts, tmp_path: Path,
                                                         small_corpus: str) -> None:
    """`edit-train` (a Lighthouse and two clusters on this host) where the hostname resolves to the LAN
    address: it used to fail dialling torchft's Lighthouse by that name."""
    run_dir = tmp_path / "demo"
    proc = net.run("a", [sys.executable, "-m", "edit_train.cli.train", "model=tiny", "logger=none",
                         "train.progress=false", "train.steps=12", "train.batch_size=2", "train.seq_len=32",
                         "train.eval_every=0", "train.eval_batches=1", "train.threads=1", "algo.sync_time_s=1",
                         f"data.source={small_corpus}", f"run.dir={run_dir}"],
                   capture_output=True, text=True, env=env(), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hostname = net.run("a", ["hostname"], capture_output=True, text=True).stdout.strip()
    resolved = net.run("a", [sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"],
                       capture_output=True, text=True).stdout.strip()
    assert hostname == "a" and resolved == net.address("a")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["syncs"] >= 1, summary
