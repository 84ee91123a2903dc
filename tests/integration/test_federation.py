"""Clusters as independent jobs (issue 9): a cluster that dies, is cut off or joins late never stops the
others; it heals from a live peer and every cluster ends on the same anchor.

The default algorithm's versions of the kill / partition / heal cases run across hosts in tests/integration/test_hosts.py
(algo=a_edit, each cluster on its own network namespace); its kill-and-resume in tests/integration/test_a_edit_checkpoint.py.

Each test starts the real `edit-train` (a torchft Lighthouse + one job per cluster on 127.0.0.1). Steps are
stretched with the simulated slowdown (sleep) so that a restart (a fresh Python + torch import) happens
while the others are still training, without burning the two CPU cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fed_utils import (anchors, cluster_pids, events, finish, kill_cluster, max_gap, same, start, syncs,
                       wait_for)

# collective_timeout_s=5: a survivor blocked in a collective with the killed cluster (gloo does not always see
# the peer's socket close) gives up within 5 s, so its gap stays within the join timeout plus one sync
THREE = ["algo=edit", "cluster.count=3", "cluster.ranks=1", "cluster.slowdown=[8,8,8]", "train.steps=120",
         "federation.join_timeout_s=10", "federation.collective_timeout_s=5",
         "algo.interval=8", "train.batch_size=2", "federation.min_clusters=2", "run.max_restarts=1",
         "train.eval_batches=16"]  # the final val loss over 1,024 tokens (64 in BASE: too noisy to compare runs)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, corpus: str) -> Path:
    run_dir = tmp_path_factory.mktemp("fed") / "clean"
    finish(start(run_dir, corpus, *THREE))
    return run_dir


def _ends_on_one_anchor(run_dir: Path, clusters: list[str]) -> None:
    first = anchors(run_dir, clusters[0])
    for c in clusters[1:]:
        assert same(first, anchors(run_dir, c)) == 0.0, c


@pytest.mark.slow  # the default run has a_edit's kill / partition / heal across hosts (test_hosts.py)
def test_killed_cluster_never_stops_the_others_and_heals(tmp_path: Path, corpus: str, baseline: Path) -> None:
    run_dir = tmp_path / "kill"
    # restarted after 8 s: long enough that the survivors sync without it (a 1 s restart can heal in time for
    # the very next sync, and then no sync of the outage has 2 participants)
    proc = start(run_dir, corpus, *THREE, "run.restart_delay_s=8")
    wait_for(run_dir, lambda e: e["event"] == "train" and e.get("cluster") == "c1" and e["step"] >= 40, proc=proc)
    killed = kill_cluster("c1", run_dir)  # every process of cluster c1, found by EDIT_TRAIN_CLUSTER
    assert killed
    saved_at_kill = json.loads((run_dir / "clusters" / "c1.progress.json").read_text())["steps_trained"]
    killed_at = time.time()
    finish(proc)
    evs = events(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"]
    c1 = summary["per_cluster"]["c1"]
    assert c1["restarts"] == 1 and c1["healed_from"] and set(c1["healed_from"]) <= {"c0", "c2"}
    # the others kept stepping: no gap longer than the grace window plus one sync (and a log interval)
    clean_gap = max(max_gap(events(baseline), c) for c in ("c0", "c2"))
    for c in ("c0", "c2"):
        assert max_gap(evs, c) <= 10.0 + clean_gap + 1.0, c
        assert summary["per_cluster"][c]["restarts"] == 0
    parts = [len(e["quorum"]) for e in syncs(evs, "c0")]
    assert 2 in parts, parts  # syncs during the outage: c0 and c2 only
    first_two = parts.index(2)
    assert 3 in parts[first_two:], parts  # c1 back after healing
    assert all(p >= 2 for p in parts)
    _ends_on_one_anchor(run_dir, ["c0", "c1", "c2"])
    # a restarted cluster's work is counted: every incarnation's tokens (what the first one had recorded when
    # it was killed, plus every step of the one that healed and went on from the federation's step)
    for name, c in summary["per_cluster"].items():
        assert c["tokens"] == c["steps_trained"] * c["tokens_per_step"], name
    logged = [e["step"] for e in evs if e["event"] == "train" and e.get("cluster") == "c1"]  # every 2 steps
    resumed_at = next(b for a, b in zip(logged, logged[1:]) if b != a + 2) - 2  # where the 2nd incarnation began
    assert saved_at_kill >= 20
    assert summary["per_cluster"]["c1"]["steps_trained"] >= saved_at_kill + 120 - resumed_at
    assert summary["tokens"] == sum(c["tokens"] for c in summary["per_cluster"].values())
    clean = json.loads((baseline / "summary.json").read_text())["final_val_loss"]
    assert summary["final_val_loss"] <= 1.03 * clean
    assert not cluster_pids("c1", run_dir) and killed_at > 0


@pytest.mark.slow  # the default run has a_edit's kill / partition / heal across hosts (test_hosts.py)
def test_partitioned_cluster_rejoins_without_any_exit(tmp_path: Path, corpus: str, baseline: Path) -> None:
    run_dir = tmp_path / "partition"
    finish(start(run_dir, corpus, *THREE, "faults=[{kind:partition,cluster:1,step:30,seconds:8}]",
                 "train.steps=160", "run.max_restarts=0"))
    evs = events(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"]
    assert all(r["restarts"] == 0 for r in summary["per_cluster"].values())  # no process exited
    c1 = summary["per_cluster"]["c1"]
    assert c1["syncs_missed"] >= 1 and c1["healed_from"]
    parts = [len(e["quorum"]) for e in syncs(evs, "c0")]
    assert 2 in parts and 3 in parts[parts.index(2):], parts
    assert {"missed"} <= {e["event"] for e in evs if e.get("cluster") == "c1"}
    clean_gap = max(max_gap(events(baseline), c) for c in ("c0", "c2"))
    for c in ("c0", "c2"):
        assert max_gap(evs, c) <= 10.0 + clean_gap + 1.0, c
    _ends_on_one_anchor(run_dir, ["c0", "c1", "c2"])


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_fourth_cluster_joins_mid_run(tmp_path: Path, corpus: str) -> None:
    run_dir = tmp_path / "join"
    proc = start(run_dir, corpus, *THREE, "data.parts=4")  # a part of the corpus kept for the cluster added later
    wait_for(run_dir, lambda e: e["event"] == "sync" and e["sync"] >= 3, proc=proc)
    lighthouse = json.loads((run_dir / "federation.json").read_text())["lighthouse"]
    late = start(run_dir, corpus, *THREE, "data.parts=4", "cluster.only=c3", f"federation.lighthouse={lighthouse}",
                 "resume=auto", "sim.force=true")  # a joiner is a real cluster job: its simulated slowdown is asked for
    finish(late)
    finish(proc)
    evs = events(run_dir)
    c3 = syncs(evs, "c3")
    assert c3 and len(c3[0]["quorum"]) == 4
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["per_cluster"]["c3"]["healed_from"]
    assert summary["per_cluster"]["c3"]["index"] == 3  # its own index (and data part 3 of 4), not c0..c2's
    _ends_on_one_anchor(run_dir, ["c0", "c1", "c2", "c3"])


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_clusters_of_different_size_sync_like_single_rank_ones(tmp_path: Path, corpus: str) -> None:
    """Clusters of 2, 1 and 3 ranks (the same 6 sequences per cluster, split over its ranks) against 1, 1, 1:
    the anchor after 3 syncs agrees to 1e-5 (chunked layout: resharding over fast links, chunks across)."""
    common = ["algo=edit", "sync.mode=at_end", "train.steps=6", "algo.interval=2", "model.router_aux_loss_coef=0",
              "algo.rule.verified.warmup_syncs=1"]
    mixed = "cluster.clusters=[{name:a,ranks:2,batch_size:3},{name:b,ranks:1,batch_size:6},{name:c,ranks:3,batch_size:2}]"
    single = "cluster.clusters=[{name:a,ranks:1,batch_size:6},{name:b,ranks:1,batch_size:6},{name:c,ranks:1,batch_size:6}]"
    finish(start(tmp_path / "mixed", corpus, *common, mixed))
    finish(start(tmp_path / "single", corpus, *common, single))
    ref = anchors(tmp_path / "single", "a")
    for name, ranks in (("a", 2), ("b", 1), ("c", 3)):
        assert same(anchors(tmp_path / "mixed", name, ranks), ref) <= 1e-5, name
    assert json.loads((tmp_path / "mixed" / "summary.json").read_text())["syncs"] == 3


@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_local_run_listens_on_loopback_only(tmp_path: Path, corpus: str) -> None:
    """Every listening socket of a local federation (Lighthouse, stores, gloo) is on 127.0.0.1."""
    run_dir = tmp_path / "sockets"
    proc = start(run_dir, corpus, "algo=edit", "cluster=local_2x2", "train.steps=400", "algo.interval=4",
                 "train.batch_size=1", "cluster.slowdown=[4,4]")
    try:
        wait_for(run_dir, lambda e: e["event"] == "sync" and e["sync"] >= 1, proc=proc)  # lanes connected
        pids = {proc.pid, *cluster_pids("c0", run_dir), *cluster_pids("c1", run_dir)}
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        mine = [line for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]
        assert mine, out
        for line in mine:
            local = line.split()[3]
            assert local.startswith("127.0.0.1:"), line
    finally:
        proc.terminate()
        proc.communicate(timeout=120)
