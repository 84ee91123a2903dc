"""Heterogeneous clusters: the WAN-link model, overlapped sync, slowdown and A-EDiT planning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from edit_train.cluster.group import RankGroup
from edit_train.federation import heal
from edit_train.federation.forming import Forming
from edit_train.federation.link import LinkClock, LinkModel
from edit_train.federation import auth
from edit_train.federation.quorum import Lighthouse
from edit_train.federation.transport import LaneTransport, lighthouse_transport
from edit_train.local_sgd.sync.algorithms import LocalSGD, LocalSGDConfig
from edit_train.local_sgd.errors import FederationError, FederationRefused
from edit_train.local_sgd.sync.membership import MembershipConfig
from edit_train.local_sgd.sync.outer import OuterConfig
from edit_train.local_sgd.aggregation.rules import RuleConfig
from edit_train.local_sgd.sync.schedule import ScheduleConfig
from edit_train.sim.hetero import HeteroError, Slowdown, parse_schedule
from mp_utils import run_processes

PLAIN = RuleConfig(name="uniform", clip=False)


def _toy() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))


def _local_sgd(model: nn.Sequential, comm: LaneTransport, group: int, mode: str, outer: OuterConfig,
               interval: int = 2) -> LocalSGD:
    cfg = LocalSGDConfig(schedule=ScheduleConfig(interval=interval), outer=outer, rule=PLAIN, mode=mode,
                         total_steps=1000)
    return LocalSGD(cfg, model, [model[0], model[1]], comm, (heal.encode, heal.decode), cluster_index=group)


def _cluster_comm(rank: int, lighthouse: str | None, link: LinkModel | None = None) -> LaneTransport:
    """Process `rank` of a run_processes test as a one-rank cluster `c<rank>` of a federation."""
    return lighthouse_transport(f"c{rank}", RankGroup(), lighthouse, link=link)


def _form(comm: LaneTransport, sync: int, data: dict) -> None:
    comm.form_start(sync, data)
    comm.form_poll(block=True)


@pytest.fixture()
def lighthouse():
    house = Lighthouse("127.0.0.1:0", auth.INSECURE, 2, 5.0, 5.0)
    yield house.address
    house.shutdown()


# ------------------------------------------------------------ background quorum
def _early_and_late(rank: int, world: int, lighthouse: str, flag: str) -> dict:
    """c0 reaches its sync point first and asks for the quorum in the background; c1 asks only after c0 has
    polled five times (and found no quorum yet, because c1 has not asked). Then both get the same quorum and
    its lanes work."""
    comm = _cluster_comm(rank, lighthouse)
    out: dict = {"early_polls": []}
    if rank == 0:
        comm.form_start(1, {"local_steps": 3})
        for _ in range(5):  # "local steps" taken while the quorum forms
            time.sleep(0.05)
            out["early_polls"].append(comm.form_poll()[0])
        Path(flag).write_text("asked")
        done, m = False, None
        while not done:
            time.sleep(0.01)
            done, m = comm.form_poll()
    else:
        while not Path(flag).exists():
            time.sleep(0.01)
        comm.form_start(1, {"local_steps": 1})
        done, m = comm.form_poll(block=True)
    t = torch.full((4,), float(rank + 1))
    comm.reduce_([t]).wait()
    out.update(names=m.names, quorum=m.quorum_id, sum=float(t[0]), forming=comm.forming)
    comm.close()
    return out


def test_background_quorum_lets_the_early_cluster_keep_training(lighthouse: str, tmp_path: Path) -> None:
    results = run_processes(_early_and_late, 2, lighthouse, str(tmp_path / "asked"))
    assert results[0]["early_polls"] == [False] * 5  # not issued while c1 had not asked: c0 kept going
    assert results[0]["names"] == results[1]["names"] == ["c0", "c1"]
    assert results[0]["quorum"] == results[1]["quorum"]
    assert results[0]["sum"] == results[1]["sum"] == 3.0  # the lanes connected in the background work
    assert not results[0]["forming"] and not results[1]["forming"]


# ------------------------------------------------------------------ refusal
def _other_config(rank: int, world: int, lighthouse: str) -> dict:
    """Two clusters whose configurations differ (another fingerprint) meet at start."""
    comm = _cluster_comm(rank, lighthouse)
    cfg = LocalSGDConfig(outer=OuterConfig(), rule=PLAIN, mode="at_end", total_steps=10,
                         membership=MembershipConfig(fingerprint=f"config-{rank}", expected=("c0", "c1"),
                                                     quorum_timeout_s=30))
    model = _toy()
    algo = LocalSGD(cfg, model, [model[0], model[1]], comm, (heal.encode, heal.decode), cluster_index=rank)
    try:
        algo.join()
        out = {"refused": None}
    except FederationRefused as exc:
        out = {"refused": str(exc)}
    out["left_out"] = sorted({name for name, _ in algo.suspects._said})  # noqa: SLF001 - its one-line refusals
    comm.close()
    return out


def test_two_clusters_with_other_configurations_leave_each_other_out(lighthouse: str) -> None:
    """Two clusters whose configurations differ meet at start, with no roster to say which is the federation's:
    neither can tell who is misconfigured, so neither refuses itself (a liar could otherwise make an honest
    cluster stop by claiming another configuration and the newest sync); each leaves the other out and goes on
    (with a roster, the roster's configuration decides: tests/local_sgd/test_liars.py)."""
    results = run_processes(_other_config, 2, lighthouse)
    assert [r["refused"] for r in results] == [None, None], results
    assert [r["left_out"] for r in results] == [["c1"], ["c0"]], results


def test_a_refusal_keeps_its_kind_across_the_cluster() -> None:
    """The leader asks the Lighthouse on a thread and hands its answer to the cluster as JSON: a refusal
    (a name already taken) must still stop the run rather than skip one sync."""
    def forming(answer: dict) -> Forming:
        return Forming(RankGroup(), LinkClock(), lambda: answer, lambda q: True, lambda: None)

    with pytest.raises(FederationRefused, match="name taken"):
        forming({"ok": False, "error": "name taken", "refused": True}).poll(block=True)
    with pytest.raises(FederationError, match="no quorum") as info:
        forming({"ok": False, "error": "no quorum", "refused": False}).poll(block=True)
    assert not isinstance(info.value, FederationRefused)


# ------------------------------------------------------------------ link model
def _blocking_link(rank: int, world: int, lighthouse: str) -> dict:
    comm = _cluster_comm(rank, lighthouse, LinkModel(bandwidth_mbps=8, latency_ms=50))
    _form(comm, 0, {"local_steps": 1})
    blocked0 = comm.blocked_s
    t = torch.full((12_500,), float(rank + 1))  # 50 kB -> 0.05 s at 8 Mbit/s
    t0 = time.perf_counter()
    comm.reduce_([t]).wait()
    out = {"elapsed": time.perf_counter() - t0, "value": float(t[0]), "bytes": comm.bytes_sent,
           "blocked": comm.blocked_s - blocked0}
    comm.close()
    return out


def test_blocking_sync_pays_latency_plus_transfer(lighthouse: str) -> None:
    for r in run_processes(_blocking_link, 2, lighthouse):
        assert r["value"] == 3.0 and r["bytes"] == 50_000
        assert r["elapsed"] >= 0.05 + 50_000 * 8 / 8e6 - 1e-3
        assert r["blocked"] > 0.05  # waited for the link (minus the time spent issuing the collective)


def test_link_seconds_and_queueing() -> None:
    link = LinkModel(bandwidth_mbps=100, latency_ms=50)
    assert link.seconds(1_250_000) == pytest.approx(0.05 + 0.1)
    clock = LinkClock(link)
    t0 = time.perf_counter()
    first, second = clock.account(1_250_000), clock.account(1_250_000)
    # two transfers share the bandwidth: the second lands one transfer time after the first
    assert second - first == pytest.approx(0.1, abs=1e-3)
    assert first - t0 >= 0.15  # latency + transfer after the moment it was accounted


# ------------------------------------------------------------ overlapped sync
def _overlap_vs_blocking(rank: int, world: int, lighthouse: str) -> dict:
    out = {}
    outer = OuterConfig(lr=0.7, momentum=0.8, nesterov=True)
    for mode in ("at_end", "overlap"):
        model = _toy()
        comm = _cluster_comm(rank, lighthouse)
        algo = _local_sgd(model, comm, rank, mode, outer)
        for step in range(6):
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p.add_(torch.sin(torch.arange(p.numel(), dtype=p.dtype).view_as(p) * (rank + 1) + step + i))
            algo.after_step(step, 0.01)
            algo.flush()  # land at once: no local steps in flight
        out[mode] = [p.detach().flatten().tolist() for p in model.parameters()]
        comm.close()
    return out


@pytest.mark.slow  # test_sync_inproc.py: overlap and at_end both equal the closed form, in one process
def test_overlap_without_steps_in_flight_equals_blocking(lighthouse: str) -> None:
    results = run_processes(_overlap_vs_blocking, 2, lighthouse)
    for r in results:
        for a, b in zip(r["at_end"], r["overlap"]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
    # and both groups hold the same anchor
    for a, b in zip(results[0]["overlap"], results[1]["overlap"]):
        assert torch.equal(torch.tensor(a), torch.tensor(b))


def test_overlap_carries_local_progress_exactly() -> None:
    """theta_0 -a-> theta_1 (sync starts, snapshot) -b-> theta_2, then it lands:
    with outer SGD lr=0.5, no momentum and one group: anchor' = theta_0 - 0.5(theta_0 - theta_1),
    theta = anchor' + (theta_2 - theta_1) = theta_0 + 0.5 a + b."""
    model = _toy()
    theta0 = [p.detach().clone() for p in model.parameters()]
    algo = _local_sgd(model, _cluster_comm(0, None), 0, "overlap",
                      OuterConfig(lr=0.5, momentum=0.0, nesterov=False), interval=1)
    a = [torch.randn_like(p) for p in model.parameters()]
    b = [torch.randn_like(p) for p in model.parameters()]
    with torch.no_grad():
        for p, d in zip(model.parameters(), a):
            p.add_(d)
    algo.after_step(0, 0.01)  # interval 1: the sync starts here, in the background
    assert algo.driver is not None and algo.driver.pending
    with torch.no_grad():
        for p, d in zip(model.parameters(), b):
            p.add_(d)
    algo.flush()
    for p, t0, da, db in zip(model.parameters(), theta0, a, b):
        assert torch.allclose(p.detach(), t0 + 0.5 * da + db, atol=1e-6)


def _lost_before_the_vote(rank: int, world: int, lighthouse: str) -> dict:
    """Both clusters' reductions land; c1 then leaves without voting. c0's background vote fails, so the
    overlapped sync is dropped whole: anchors untouched, local progress kept, the abort reported."""
    model = _toy()
    comm = lighthouse_transport(f"c{rank}", RankGroup(), lighthouse, collective_timeout_s=5)
    algo = _local_sgd(model, comm, rank, "overlap", OuterConfig(lr=1.0, momentum=0.0, nesterov=False), interval=1)
    aborted: list[str] = []
    algo.records.aborted = lambda _report, why: aborted.append(why)  # type: ignore[method-assign]
    if rank == 1:
        def leave(ok: bool):  # type: ignore[no-untyped-def]
            comm.close()
            raise FederationError("left before voting")
        comm.vote = leave  # type: ignore[method-assign]
    assert algo.driver is not None
    anchors = [a.clone() for u in algo.replica.units for a in algo.driver.core.outer.anchors[u.name]]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * (rank + 1))
    algo.after_step(0, 0.01)  # interval 1: the overlapped sync starts here
    algo.flush()
    if rank == 1:
        return {"left": True}
    outer = algo.driver.core.outer
    out = {"pending": algo.driver.pending, "aborted": aborted,
           "anchors_kept": all(torch.equal(a, b) for a, b in zip(anchors, [a for u in algo.replica.units
                                                                            for a in outer.anchors[u.name]])),
           "progress_kept": all(torch.allclose(p, a + 0.1) for p, a in zip(model.parameters(), anchors))}
    comm.close()
    return out


@pytest.mark.slow  # the in-process test_sync_inproc.py::test_a_participant_lost_mid_round_changes_nothing shows it
def test_overlap_sync_is_dropped_when_a_participant_does_not_vote(lighthouse: str) -> None:
    r0, r1 = run_processes(_lost_before_the_vote, 2, lighthouse)
    assert r1 == {"left": True}
    assert not r0["pending"] and r0["aborted"] and r0["anchors_kept"] and r0["progress_kept"], r0


# -------------------------------------------------------------- heterogeneity
def test_slowdown_factor_follows_schedule() -> None:
    s = Slowdown(1, [1.0, 3.0], [{"cluster": 1, "step": 10, "factor": 5.0}, {"cluster": 0, "step": 2, "factor": 9}],
                 groups=2)
    assert [s.factor(i) for i in (0, 9, 10, 50)] == [3.0, 3.0, 5.0, 5.0]
    assert s.after_step(0, 0.01) == pytest.approx(0.02)
    with pytest.raises(HeteroError, match="slowdown_schedule\\[0\\].cluster"):
        parse_schedule([{"cluster": 4, "step": 1, "factor": 2}], groups=2)
    with pytest.raises(HeteroError, match="factor"):
        parse_schedule([{"cluster": 0, "step": 1, "factor": 0.5}], groups=2)


def test_a_clusters_simulation_hooks_are_built_from_its_config(tmp_path: Path) -> None:
    """The loop's one seam (sim/hooks.py): a cluster no fault and no slowdown concern gets the no-op `StepHooks`
    (the loop then makes no call that could change a number); a faulty, slowed-down one its injector, its
    transport wrapper and its slowdown, chained."""
    from types import SimpleNamespace

    from edit_train.cli.common import compose
    from edit_train.config import cluster_specs
    from edit_train.sim.build import step_hooks
    from edit_train.sim.byzantine import ByzantineTransport
    from edit_train.sim.hooks import Chain, StepHooks

    def hooks(index: int, *overrides: str) -> StepHooks:
        cfg = compose(["cluster=local_2x1", *overrides])
        topo = SimpleNamespace(index=index, name=f"c{index}", is_leader=True, rank=0)
        return step_hooks(cfg, topo, cluster_specs(cfg), tmp_path, step=lambda: 0)  # type: ignore[arg-type]

    faults = "faults=[{kind:lr_spike,cluster:1,start:2,end:4,factor:3},{kind:sign_flip,cluster:1,start:0}]"
    assert type(hooks(0, faults, "cluster.slowdown=[1,2]")) is StepHooks  # all of it is c1's
    assert type(hooks(1, "cluster.slowdown=[1,1]")) is StepHooks
    c1 = hooks(1, faults, "cluster.slowdown=[1,2]")
    assert isinstance(c1, Chain)
    assert [type(h).__name__ for h in c1.parts] == ["FaultInjector", "PayloadFaults", "Slowdown"]
    assert (c1.lr(1, 0.5), c1.lr(2, 0.5)) == (0.5, 1.5)
    x, y = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    assert all(a is b for a, b in zip(c1.batch(0, x, y), (x, y)))
    assert isinstance(c1.transport(object()), ByzantineTransport)
    assert c1.after_step(0, 0.01) == pytest.approx(0.01) and c1.slept_s == pytest.approx(0.01)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    import sysconfig

    out = tmp_path_factory.mktemp("corpus")
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]:
        (out / f.name).write_bytes(f.read_bytes())
    return str(out / "*.py")


@pytest.fixture(scope="module")
def slowing_run(tmp_path_factory: pytest.TempPathFactory, corpus: str) -> Path:
    """a_edit on two one-rank clusters; group 1 becomes 8x slower at its step 50."""
    run_dir = tmp_path_factory.mktemp("slowing") / "run"
    cmd = [sys.executable, "-m", "edit_train.cli.train", "cluster=local_2x1", "algo=a_edit", "logger=none",
           "train.progress=false", f"data.source={corpus}", f"run.dir={run_dir}", "train.seq_len=32",
           "train.batch_size=2", "train.eval_every=0", "train.eval_batches=1", "train.steps=120",
           "algo.interval=4", "algo.sync_time_s=0.3", "model.num_hidden_layers=2", "train.log_every=10",
           "cluster.slowdown_schedule=[{cluster:1,step:50,factor:8.0}]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_a_edit_follows_a_group_that_slows_down(slowing_run: Path) -> None:
    """Group 1 becomes 8x slower at its step 50: its planned local steps drop at the next sync."""
    syncs = [e for e in map(json.loads, (slowing_run / "metrics.jsonl").read_text().splitlines())
             if e["event"] == "sync" and e["cluster_index"] == 1]
    before = [e["local_steps"] for e in syncs if e["step"] <= 50][1:]  # the first interval is timed locally
    after = [e["local_steps"] for e in syncs if e["step"] > 50][2:]  # from the plan made after the change
    assert before and after, syncs
    assert max(after) < max(before) and sorted(after)[len(after) // 2] < sorted(before)[len(before) // 2], \
        (before, after)


def test_every_cluster_accounts_its_wall_time(slowing_run: Path) -> None:
    """per_cluster.time: the buckets add up to the wall; the simulated slowdown is its own bucket (what the
    sleeps took); the layer-wise sync's work and the waits are charged; train events carry their window."""
    from edit_train.timing import BUCKETS

    summary = json.loads((slowing_run / "summary.json").read_text())
    for name, c in summary["per_cluster"].items():
        t = c["time"]
        assert list(t) == [*BUCKETS, "wall_s"]
        assert sum(t[b] for b in BUCKETS) == pytest.approx(t["wall_s"], abs=1e-6)
        assert all(t[b] >= 0 for b in BUCKETS if b != "other") and t["other"] > -1e-6, t
        assert t["wall_s"] >= c["wall_s"]  # the account starts before the loop (start-up)
        assert t["compute"] > 0 and t["sync"] > 0 and t["startup"] > 0 and t["eval"] > 0, (name, t)
        assert t["slowdown"] == pytest.approx(c["slowdown_slept_s"], rel=0.1, abs=0.2), (name, t)
        assert t["blocked"] <= c["blocked_s"] + 1e-6  # start-up's wait for the federation is start-up
    slow = summary["per_cluster"]["c1"]["time"]
    assert slow["slowdown"] > slow["compute"]  # 8x from step 50 on (7 s of sleep per s of compute)
    fast = summary["per_cluster"]["c0"]["time"]  # not slowed: the hook's own cost, under 1 % of its compute (it
    assert fast["slowdown"] < 0.01 * fast["compute"]  # trains on until most clusters reached train.steps)
    windows = [e["time_s"] for e in map(json.loads, (slowing_run / "metrics.jsonl").read_text().splitlines())
               if e["event"] == "train"]
    assert len(windows) >= 10
    for w in windows:
        assert sum(w[b] for b in BUCKETS) == pytest.approx(w["wall_s"], abs=1e-3)
