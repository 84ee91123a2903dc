"""`edit-train plan`: the simulator's semantics on crafted cases with exact answers, calibration (a synthetic
run with known costs, and a real short run, round-tripped), the CLI's one-line errors, and the
recommendation's overrides composing as an `edit-train` config. No timing assertions: numerics only."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edit_train.model.presets import available_presets
from edit_train.plan import hardware, traffic
from edit_train.plan.calibrate import CalibrationError, calibrate
from edit_train.plan.costs import resolve
from edit_train.plan.engine import simulate
from edit_train.plan.profile import Profile
from edit_train.plan.simbase import SimOptions
from edit_train.plan.spec import Candidate, PlanError, scenario_from_dict

STEP = 0.1
BATCH, SEQ = 4, 64


def zero_profile() -> Profile:
    """No software cost anywhere: only steps and the modelled link remain."""
    return Profile(per_op_s=0.0, sw_bytes_per_s=0.0, quorum_s=0.0, sync_work_s=0.0, sync_work_per_param_s=0.0,
                   startup_s=0.0, eval_s=0.0, other_step_s=0.0)


def scenario(slowdowns=(1.0, 1.0), bw=0.0, lat=0.0, **kw):
    clusters = [{"name": f"c{i}", "ranks": 1, "step_s": STEP, "step_cv": 0.0, "slowdown": s}
                for i, s in enumerate(slowdowns)]
    return scenario_from_dict({"name": "t", "clusters": clusters, "model": "tiny", "batch_size": BATCH,
                               "seq_len": SEQ, "link": {"bandwidth_mbps": bw, "latency_ms": lat}, **kw})


def run(scn, cand, steps=64, kills=(), restart_s=5.0):
    fed = resolve(scn, zero_profile())
    return fed, simulate(fed, cand, SimOptions(steps=steps, startup=False, kills=list(kills), restart_s=restart_s))


@pytest.mark.parametrize("algo", ["diloco", "edit", "post_local_sgd"])
def test_equal_clusters_free_link_never_block_and_add_up(algo):
    _, res = run(scenario(), Candidate(algo, "at_end", "none", 16))
    assert res.buckets["blocked"] == pytest.approx([0.0, 0.0], abs=1e-12)
    assert res.tokens_per_s == pytest.approx(2 * BATCH * SEQ / STEP, rel=1e-9)  # the sum of the clusters
    assert res.syncs == 4 and res.goodput == pytest.approx(1.0)


def _prefetched(xfer: list[float], lat: float) -> float:
    """Reference: units moved one at a time, the next one launched with it (`BlockingDriver`), on one link
    queue; a unit is ready `lat` after its bytes left; the sync waits for each in turn."""
    free = now = 0.0
    ready: list[float] = []
    for u in range(len(xfer)):
        for v in (u, u + 1):
            if v == len(ready) and v < len(xfer):
                free = max(now, free) + xfer[v]
                ready.append(free + lat)
        now = max(now, ready[u])
    return now


def test_slow_link_costs_latency_plus_bytes_over_bandwidth():
    bw, lat = 100.0, 50.0
    fed, res = run(scenario(bw=bw, lat=lat), Candidate("edit", "at_end", "none", 16))
    units = hardware.model_facts("tiny").unit_sizes
    nbytes = sum(4 * n + traffic.TAG for n in units)  # 2 clusters gather: one copy of every unit to the peer
    assert res.bytes == pytest.approx([4 * nbytes] * 2)
    # per sync: the norm exchange and the commit vote (one latency each) + the units, one at a time, prefetched
    xfer = [(4 * n + traffic.TAG) / (bw * 1e6 / 8) for n in units]
    per_sync = 2 * lat / 1e3 + _prefetched(xfer, lat / 1e3)
    assert per_sync > 3 * lat / 1e3 + nbytes / (bw * 1e6 / 8)  # small units expose their latency
    assert res.buckets["blocked"] == pytest.approx([4 * per_sync] * 2, rel=1e-9)
    assert res.wall_s == pytest.approx(64 * STEP + 4 * per_sync, rel=1e-9)
    assert res.tokens_per_s == pytest.approx(2 * 64 * BATCH * SEQ / (64 * STEP + 4 * per_sync), rel=1e-9)


def test_simulated_link_hides_software_shorter_than_the_wire():
    """edit-train's simulated link is a clock beside the real work (`Pending.wait` waits for both): software
    shorter than a unit's wire time costs nothing there, and adds up on a real link."""
    bw, lat = 100.0, 50.0
    prof = zero_profile()
    prof.per_op_s = 0.001  # far below any big unit's wire time at 100 Mbit/s
    cand = Candidate("edit", "overlap", "none", 16)
    costs = {}
    for sim in (False, True):
        fed = resolve(scenario(bw=bw, lat=lat, simulated_link=sim), prof)
        costs[sim] = fed.sync_cost(np.array([0, 1]), cand)
    units = hardware.model_facts("tiny").unit_sizes
    wire = sum(4 * n + traffic.TAG for n in units) / (bw * 1e6 / 8)
    assert costs[True]["background"] == pytest.approx(wire + lat / 1e3, rel=1e-9)
    assert costs[False]["background"] == pytest.approx(wire + lat / 1e3 + len(units) * 0.001, rel=1e-9)
    assert costs[True]["exchange"] == pytest.approx(lat / 1e3) and costs[False]["exchange"] == pytest.approx(0.051)


def test_compression_shrinks_the_transfer_only():
    _, none = run(scenario(bw=100.0, lat=50.0), Candidate("edit", "at_end", "none", 16))
    _, int8 = run(scenario(bw=100.0, lat=50.0), Candidate("edit", "at_end", "int8", 16))
    units = hardware.model_facts("tiny").unit_sizes
    assert int8.bytes[0] == pytest.approx(4 * sum(traffic.wire_bytes(n, "int8") + traffic.TAG for n in units))
    pipe = {c: _prefetched([traffic.wire_bytes(n, c) / (100e6 / 8) + traffic.TAG / (100e6 / 8) for n in units], 0.05)
            for c in ("none", "int8")}
    saved = 4 * (pipe["none"] - pipe["int8"])
    assert none.buckets["blocked"][0] - int8.buckets["blocked"][0] == pytest.approx(saved, rel=1e-9)


def test_step_schedule_waits_for_the_straggler_a_edit_does_not():
    scn = scenario(slowdowns=(1.0, 3.0))
    _, edit = run(scn, Candidate("edit", "at_end", "none", 10), steps=60)
    # edit: every 10 steps the fast cluster (1 s) waits for the slow one (3 s): 2 s of every 3
    assert edit.blocked_frac[0] == pytest.approx(2 / 3, rel=1e-6)
    assert edit.blocked_frac[1] == pytest.approx(0.0, abs=1e-12)
    _, aedit = run(scn, Candidate("a_edit", "at_end", "none", 10, sync_time_s=1.0), steps=60)
    # A-EDiT: tau = 1 s -> the slow cluster plans floor(1 / 0.3) = 3 steps (0.9 s), the fast one 10 (1 s)
    assert aedit.blocked_frac[0] < 0.1 and aedit.blocked_frac[1] < 0.2
    assert aedit.tokens_per_s > 1.5 * edit.tokens_per_s


def test_the_lighthouse_needs_more_than_half_of_the_heartbeating_clusters():
    """torchft's quorum rule: with two clusters neither syncs alone however short the grace window (the fast
    one waits for the 5x slower one every interval); with three, two fast ones go on without a straggler once
    the grace window has passed."""
    _, two = run(scenario(slowdowns=(1.0, 5.0), join_timeout_s=1.0), Candidate("edit", "at_end", "none", 8), steps=32)
    assert two.syncs == 4 and two.missed == 0
    assert two.blocked_frac[0] == pytest.approx(4 / 5, rel=1e-6)  # the fast one waits 3.2 s of every 4 s
    _, three = run(scenario(slowdowns=(1.0, 1.0, 5.0), join_timeout_s=1.0), Candidate("edit", "at_end", "none", 8),
                   steps=32)
    assert three.missed > 0 and three.blocked_frac[0] < 0.5


def test_a_failure_costs_the_uncommitted_compute():
    scn = scenario()
    _, clean = run(scn, Candidate("edit", "at_end", "none", 8), steps=32)
    _, hit = run(scn, Candidate("edit", "at_end", "none", 8), steps=32, kills=[(1, 12, -1.0)])
    assert clean.buckets["compute"] - clean.useful == pytest.approx([0.0, 0.0], abs=1e-9)
    # killed at its step 12 of the interval 8..16: the 4 steps since the commit at 8 are lost
    lost = hit.buckets["compute"] - hit.useful
    assert lost[0] == pytest.approx(0.0, abs=1e-9) and lost[1] == pytest.approx(4 * STEP, rel=1e-9)
    assert hit.restarts == 1 and hit.goodput < clean.goodput


def test_order_statistic_makes_a_big_synchronous_cluster_slower():
    from edit_train.plan.dist import StepDist, fit_max

    d = StepDist(1.0, 0.1)
    assert d.mean_max(1) == pytest.approx(math.exp(0.005), rel=2e-3)  # lognormal mean
    assert d.mean_max(1024) > d.mean_max(64) > d.mean_max(8) > d.mean_max(1)
    f = fit_max(d.mean_max(16), d.std_max(16), 16)  # the fit inverts the order statistic
    assert f.sigma == pytest.approx(0.1, rel=0.02) and f.median_s == pytest.approx(1.0, rel=0.01)


def test_scenario_errors_name_the_field():
    with pytest.raises(PlanError, match=r"clusters\[0\] \(a\)\.ranks"):
        scenario_from_dict({"name": "x", "clusters": [{"name": "a", "ranks": 0, "step_s": 1}]})
    with pytest.raises(PlanError, match="candidates.algos"):
        scenario_from_dict({"name": "x", "clusters": [{"name": "a", "ranks": 1, "step_s": 1}],
                            "candidates": {"algos": ["sgd"]}})
    with pytest.raises(PlanError, match="unknown field"):
        scenario_from_dict({"name": "x", "clusters": [{"name": "a", "ranks": 1, "step_s": 1, "gpus": 3}]})


# ------------------------------------------------------------------------------------------ calibration
def _waited(work: list[float], lat: float, between: list[float]) -> float:
    """Reference: units one at a time, the next launched with it, each ready when both its software (one queue)
    and the simulated link's latency are done; the training thread's `between` seconds after each."""
    free = now = waited = 0.0
    ready: list[float] = []
    for u in range(len(work)):
        for v in (u, u + 1):
            if v == len(ready) and v < len(work):
                free = max(now, free) + work[v]
                ready.append(max(now + lat, free))
        wait = max(ready[u] - now, 0.0)
        waited, now = waited + wait, now + wait + between[u]
    return waited


def _synthetic_run(path: Path, per_op: float, sw_bps: float, scheme: str, compute: float, lat: float = 0.0,
                   apply_s: float = 0.0) -> int:
    """A run dir whose syncs cost what the simulator charges exactly: `lat` latency (infinite bandwidth), the
    exchange and the vote (max(latency, an op) each), the units one at a time (an op + bytes / sw_bps each),
    each applied (`apply_s` per sync by parameters) as it lands. Returns the bytes of one sync."""
    path.mkdir(parents=True)
    model = hardware.load_preset("tiny")
    sizes = hardware.model_facts("tiny").unit_sizes
    unit_bytes = [traffic.sync_bytes([n], 2, scheme) for n in sizes]
    cfg = {"model": model, "train": {"batch_size": BATCH, "seq_len": SEQ, "steps": 40, "eval_every": 0},
           "cluster": {"link": {"bandwidth_mbps": 0, "latency_ms": lat * 1e3}, "clusters": [], "slowdown": []},
           "federation": {}, "sync": {"mode": "at_end", "compression": scheme}}
    (path / "config.json").write_text(json.dumps(cfg))
    per = {n: {"name": n, "index": i, "ranks": 1, "steps": 40, "tokens_per_step": BATCH * SEQ, "syncs_joined": 5,
               "time": {"compute": 40 * compute, "sync": 5 * apply_s, "probe": 5 * 0.003, "eval": 2 * 0.2,
                        "startup": 1.5, "data": 0.4, "other": 0.0, "blocked": 1.0, "wall_s": 10.0}}
           for i, n in enumerate(["c0", "c1"])}
    (path / "summary.json").write_text(json.dumps({"algo": "edit", "steps": 40, "per_cluster": per}))
    apply = [apply_s * n / sum(sizes) for n in sizes]
    cost = 2 * max(lat, per_op) + _waited([per_op + b / sw_bps for b in unit_bytes], lat, apply)
    lines = []
    for n in ("c0", "c1"):
        lines += [{"event": "eval", "cluster": n, "step": 0}, {"event": "eval", "cluster": n, "step": 40}]
        for k, step in enumerate(range(8, 41, 8)):
            jitter = (-1) ** k * 0.001
            lines.append({"event": "train", "cluster": n, "step": step,
                          "time_s": {"compute": 8 * (compute + jitter), "slowdown": 0.0}})
            lines.append({"event": "sync", "cluster": n, "sync": k + 1, "bytes": sum(unit_bytes),
                          "blocked_s": cost + (0.5 if n == "c1" else 0.0)})  # c1 also waited: min is taken
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return sum(unit_bytes)


def test_calibrate_recovers_known_costs_and_round_trips(tmp_path):
    big = _synthetic_run(tmp_path / "a", 0.004, 50e6, "none", 0.05)
    small = _synthetic_run(tmp_path / "b", 0.004, 50e6, "int8", 0.05)
    prof = calibrate([tmp_path / "a", tmp_path / "b"])
    assert prof.per_op_s == pytest.approx(0.004, rel=1e-3)
    assert prof.sw_bytes_per_s == pytest.approx(50e6, rel=1e-3)
    assert prof.fit["sync"]["message_sizes"] == [small, big]
    assert prof.clusters["c0"].mean_step_s == pytest.approx(0.05 + 0.001 / 5, rel=1e-6)  # 5 intervals, ±1 ms
    assert prof.eval_s == pytest.approx(0.2) and prof.startup_s == pytest.approx(1.5)
    assert prof.other_step_s == pytest.approx(0.01) and prof.sync_work_s == pytest.approx(0.0)
    assert prof.probe_s == pytest.approx(0.003)
    # a latency and the apply hide part of the software: the fit still reproduces every wait it was given
    _synthetic_run(tmp_path / "c", 0.004, 50e6, "none", 0.05, lat=0.02, apply_s=0.01)
    _synthetic_run(tmp_path / "d", 0.004, 50e6, "int8", 0.05, lat=0.02, apply_s=0.01)
    assert calibrate([tmp_path / "c", tmp_path / "d"]).fit["sync"]["rms_residual_s"] < 1e-4
    back = Profile.load(prof.save(tmp_path / "p.json"))
    assert back.to_json() == prof.to_json()
    one = calibrate([tmp_path / "a"])  # one message size: the per-byte cost is not identifiable
    assert "note" in one.fit["sync"]


def test_calibrate_rejects_what_is_not_a_run(tmp_path):
    with pytest.raises(CalibrationError, match="not a directory"):
        calibrate([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match="config.json"):
        calibrate([tmp_path / "empty"])
    with pytest.raises(ValueError, match="not a planner profile"):
        Profile.from_json({"version": 99})


def test_calibrate_a_real_run(tmp_path):
    """A few seconds of a real two-cluster EDiT run, calibrated; the fitted step is the run's own."""
    run_dir = tmp_path / "run"
    args = ["logger=none", "train.progress=false", "checkpoint.at_end=false", "model=tiny", "cluster=local_2x1",
            "algo=edit", "algo.interval=4", "algo.warmup_steps=0", "train.steps=16", "train.batch_size=2",
            "train.seq_len=32", "train.log_every=4", "train.eval_every=0", "train.eval_batches=1",
            f"run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-m", "edit_train.cli.train", *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    prof = calibrate([run_dir])
    summ = json.loads((run_dir / "summary.json").read_text())
    for name, pc in summ["per_cluster"].items():
        t = pc["time"]
        assert prof.clusters[name].mean_step_s == pytest.approx((t["compute"] + t["slowdown"]) / pc["steps"],
                                                                rel=1e-2)  # time_s is logged to 0.1 ms
    assert prof.fit["sync"]["samples"] >= 2 and prof.calibrated
    back = Profile.load(prof.save(tmp_path / "profile.json"))
    assert back.to_json() == prof.to_json()
    out = subprocess.run([sys.executable, "-m", "edit_train.cli.plan", "calibrate", str(run_dir), "--out",
                          str(tmp_path / "p2.json"), "--no-codec"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and (tmp_path / "p2.json").exists(), out.stderr


# ------------------------------------------------------------------------------------------ the CLI
@pytest.mark.parametrize("args, needle", [
    (["scenario=nope"], "scenario=nope: no such scenario option"),
    (["scenario.link.bandwidth_mbps=-1"], "link: bandwidth_mbps"),
    (["scenario.candidates.algos=[sgd]"], "candidates.algos"),
    (["bogus"], "is not an override"),
    (["scenario.nope=1"], "scenario.nope"),
    (["profile=/does/not/exist.json"], "cannot be read"),
    (["calibrate", "/does/not/exist"], "is not a directory"),
    (["check", "/does/not/exist.json"], "cannot be read"),
    (["check"], "check: give one profile"),
    (["scenario.candidates.compressions=[zstd]"], "candidates.compressions"),
])
def test_cli_bad_input_is_one_line(tmp_path, monkeypatch, capsys, args, needle):
    """`edit-train plan …` as a user types it (the console script's main, in this process: one import, not ten)."""
    from edit_train.cli.train import main

    extra = {"calibrate": ["--out=x.json"], "check": []}.get(args[0], [f"out={tmp_path}"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["edit-train", "plan", *args, *extra])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_readme_example_recommendation_composes_as_edit_train_config(tmp_path):
    """The worked three-cluster example (16/8/4 ranks): output files, and overrides `edit-train` accepts."""
    from edit_train.cli.common import compose
    from edit_train.cli.plan import run_plan
    from edit_train.config import cluster_specs, validate

    data = run_plan([f"out={tmp_path}", "quick=true"])
    assert (tmp_path / "plan.json").exists() and (tmp_path / "plan.png").exists()
    rec = data["recommendation"]
    assert rec["fits_memory"] and len(data["candidates"]) > 20
    cfg = compose(rec["overrides"])
    validate(cfg)
    assert [(s.name, s.ranks) for s in cluster_specs(cfg)] == [("hq", 16), ("lab", 8), ("old", 4)]
    assert cfg.algo.name == rec["algo"]
    if rec["algo"] != "ddp":
        assert cfg.sync.mode == rec["mode"] and cfg.sync.compression == rec["compression"]


def test_plan_is_not_imported_by_the_core():
    for pkg in ("local_sgd", "train", "federation", "cluster", "model"):
        for f in (Path(__file__).parents[2] / "edit_train" / pkg).rglob("*.py"):
            assert "edit_train.plan" not in f.read_text(), f


def test_clusters_sharing_a_host_share_its_cores_while_they_compute():
    """Local runs: every rank a one-thread process on one host. Processor sharing: while D cores are wanted of
    C, everyone runs at C / D; a rank slowed s× wants 1/s; whoever finishes (and waits at the sync) frees its
    share; intervals already under way keep theirs until they end."""
    from edit_train.plan.contention import shared

    assert shared([[1.0, 1.0, 1.0]], [1, 1, 1], 2)[0] == pytest.approx([1.5] * 3)  # 3 on 2 cores
    assert shared([[1.0, 3.0]], [1, 1 / 3], 2)[0] == pytest.approx([1.0, 3.0])  # 1 1/3 fits in 2
    # demand 2 1/3: the fast two take 7/6 s; then the slow one has the cores to itself: 3 - 1 s of its work left
    assert shared([[1.0, 1.0, 3.0]], [1, 1, 1 / 3], 2)[0] == pytest.approx([7 / 6, 7 / 6, 7 / 6 + 2.0])
    # one core, another process computing for 0.5 s more: a quarter of the work at half speed, then the rest
    assert shared([[1.0]], [1], 1, ghost_end=[0.5], ghost_q=[1])[0] == pytest.approx([1.25])
    # a lockstep federation of 4 on 2 cores: every step twice as long; the scenario says so with host_cores
    from edit_train.plan.calibrate import RunData, scenario_of_run
    from edit_train.plan.dist import StepDist

    prof = zero_profile()
    prof.rank_step = StepDist(0.1, 0.0)
    per = {f"c{i}": {"index": i, "ranks": 1} for i in range(4)}
    cfg = {"cluster": {"slowdown": []}, "federation": {}, "train": {"batch_size": 8, "seq_len": 64, "steps": 32,
                                                                    "eval_every": 0}}
    raw = scenario_of_run(RunData(Path("r"), cfg, {"per_cluster": per, "steps": 32}, []), prof, host_cores=2)
    assert raw["host_cores"] == 2 and [c["slowdown"] for c in raw["clusters"]] == [1.0] * 4
    _, res = run(scenario_from_dict({**raw, "model": "tiny"}), Candidate("edit", "at_end", "none", 8), steps=32)
    assert res.buckets["compute"] == pytest.approx([32 * 0.2] * 4)


# ------------------------------------------------------------------------------------------ conditions
def test_calibration_conditions_say_in_one_line_whether_they_hold():
    from edit_train.plan.conditions import Conditions, holds, stale

    then = Conditions(0.3, 0.4, 2, 2, 10_000.0, "2026-11-01T10:00:00")
    same = Conditions(0.6, 0.5, 2, 2, 9_500.0)
    assert stale(then, same) is None and "hold" in holds(then, same)
    for now, why in ((Conditions(5.2, 4.0, 2, 2, 4_100.0), "0.41x"), (Conditions(0.3, 0.3, 16, 16, 10_000.0), "16 cores"),
                     (Conditions(2.0, 1.0, 2, 2, 10_000.0), "load 2.0 now, 0.3 then")):
        line = stale(then, now)
        assert line is not None and "\n" not in line and why in line and "no longer apply" in line
    assert stale(None, same) is None


def test_plan_and_plan_check_name_a_profile_taken_under_other_load(tmp_path, capsys):
    """A profile whose recorded conditions differ from the host's now (far more load, a third of the speed)."""
    from edit_train.cli.plan import run_check, run_plan
    from edit_train.plan import conditions

    now = conditions.measure()
    prof = zero_profile()
    prof.calibrated = True
    prof.conditions = conditions.Conditions(now.load_1m + 8 * now.cores, now.load_5m, now.cpu_count, now.cores,
                                            now.speed * 3, "2026-11-01T10:00:00").to_json()
    path = prof.save(tmp_path / "profile.json")
    assert run_check([str(path)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "calibration stale" in out[0] and "no longer apply" in out[0], out
    run_plan([f"out={tmp_path}", "scenario=local_2x1", f"profile={path}", "quick=true", "top=3",
              "scenario.candidates.algos=[edit]", "scenario.candidates.intervals=[8]"])
    printed = capsys.readouterr().out
    assert sum("calibration stale" in ln for ln in printed.splitlines()) >= 1
    assert "calibration stale" in json.loads((tmp_path / "plan.json").read_text())["notes"][0]


def test_top_k_is_planned_and_recommended_where_bytes_are_what_limits():
    """A 5 Mbit/s link: the default top-k pair (3 of 32 groups of 8, 2 bits, error feedback as momentum β = 0.6;
    issue 51) beats the 1/57 keep pair, int8 and fp32 on ddp-equivalent tokens/s — it sends the fewest bytes at no
    loss — and its overrides are a valid edit-train config at the outer lr it was found at."""
    from edit_train.cli.common import compose
    from edit_train.config import validate
    from edit_train.plan.planner import make_plan

    scn = scenario_from_dict({"name": "slow", "model": "tiny", "batch_size": 4, "seq_len": 64, "hours": 1,
                              "clusters": [{"name": "c0", "ranks": 1, "step_s": 0.05}, {"name": "c1", "ranks": 1,
                                                                                       "step_s": 0.05}],
                              "link": {"bandwidth_mbps": 5, "latency_ms": 50}, "simulated_link": True,
                              "candidates": {"algos": ["edit"], "modes": ["overlap"], "intervals": [8],
                                             "compressions": ["none", "int8", "topk"]}})
    plan = make_plan(scn, quick=True)
    labels = {r.cand.label for r in plan.rows}
    assert {"edit/overlap/topk(0.01,2b,g1)/H=8", "edit/overlap/topk(0.1875,2b,g8,keep)/H=8"} <= labels
    best = plan.best.cand
    assert best.compression == "topk" and best.topk.group == 8 and best.topk.ef_decay == 0.6
    cfg = compose(plan.overrides)
    validate(cfg)
    assert (cfg.sync.compression, cfg.sync.topk_density, cfg.sync.bits, cfg.sync.topk_group, cfg.sync.unsent,
            cfg.sync.error_feedback_decay, cfg.algo.outer.lr) == ("topk", 0.09375, 2, 8, "resend", 0.6, 1.7)
    units = hardware.model_facts("tiny").unit_sizes
    cost = resolve(scn, Profile.default()).sync_cost(np.array([0, 1]), best)
    assert list(cost["bytes"]) == [traffic.sync_bytes(units, 2, best.codec(scn))] * 2


def test_a_top_k_setting_the_plan_cannot_run_is_one_line():
    with pytest.raises(PlanError, match=r"candidates.topk\[0\]: sync.bits must be one of"):
        scenario_from_dict({"name": "x", "clusters": [{"name": "a", "ranks": 1, "step_s": 1}],
                            "candidates": {"topk": [{"density": 0.1, "bits": 3}]}})


def test_the_held_out_set_is_apart_and_covers_what_the_issue_asks():
    """benchmarks/_plan_sets.py: calibration, fitting and held-out configurations never share a name; the
    held-out set has >= 12 configurations covering every algorithm, sync mode and compression (top-k with its
    settings and sync.unsent=keep), 2-4 clusters, a 5x slowdown, a 20 Mbit/s link, a kill and a real-TCP run."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import _plan_sets as S

    assert not (set(S.HELD_OUT) & (set(S.FITTING) | set(S.CALIBRATION))) and len(S.HELD_OUT) >= 12
    keys = [dict(o.split("=", 1) for o in over if "=" in o) for over in S.HELD_OUT.values()]
    assert {k["algo"] for k in keys} == {"ddp", "post_local_sgd", "diloco", "edit", "a_edit"}
    assert {k["sync.mode"] for k in keys if "sync.mode" in k} == {"layerwise", "at_end", "overlap"}
    assert {k.get("sync.compression", "none") for k in keys} == {"none", "bf16", "int8", "fp8", "topk"}
    assert {k.get("sync.topk_group") for k in keys} >= {"1", "4"} and any(k.get("sync.unsent") == "keep" for k in keys)
    assert {k.get("cluster.count", "2") for k in keys} == {"2", "3", "4"}
    assert any("5" in k.get("cluster.slowdown", "") for k in keys)
    assert min(float(k.get("cluster.link.bandwidth_mbps", 1e9)) for k in keys) <= 20
    assert any("kill_cluster" in k.get("faults", "") for k in keys)
    assert set(S.HOSTS) & set(S.HELD_OUT) and set(S.HOSTS) & set(S.FITTING)


def test_error_feedback_as_momentum_is_planned_with_its_own_measured_loss():
    """`candidates.topk[].ef_decay` (sync.error_feedback_decay < 1, issue 51): the same bytes as the plain
    setting, its own label, the loss factor `results/compression_2026.json` measured for it (not the plain one's),
    and overrides that are a valid edit-train config at the outer point it was measured at."""
    from edit_train.cli.common import compose
    from edit_train.config import validate
    from edit_train.plan.loss import COMPRESSION_RESULTS, _compression_factors, default_model
    from edit_train.plan.planner import make_plan, overrides
    from edit_train.plan.spec import Candidate, TopK

    plain, efm = {"density": 0.01, "bits": 2}, {"density": 0.01, "bits": 2, "ef_decay": 0.95}
    scn = scenario_from_dict({"name": "efm", "model": "tiny", "batch_size": 4, "seq_len": 64, "hours": 1,
                              "clusters": [{"name": "c0", "ranks": 1, "step_s": 0.05},
                                           {"name": "c1", "ranks": 1, "step_s": 0.05}],
                              "link": {"bandwidth_mbps": 5, "latency_ms": 50}, "simulated_link": True,
                              "candidates": {"algos": ["edit"], "modes": ["overlap"], "intervals": [8],
                                             "compressions": ["topk"], "topk": [plain, efm]}})
    plan = make_plan(scn, quick=True)
    rows = {r.cand.label: r for r in plan.rows}
    a, b = rows["edit/overlap/topk(0.01,2b,g1)/H=8"], rows["edit/overlap/topk(0.01,2b,g1,efm0.95)/H=8"]
    assert a.bytes_per_token == b.bytes_per_token
    # the measured factors: the 2026 file's ratio for the β = 0.95 scheme, the 2024 file's for the plain one
    model = default_model(hardware.model_facts("tiny").total_params)
    ratios = [_compression_factors(json.loads(p.read_text()))[1] for p in COMPRESSION_RESULTS]
    assert ratios[1]["topk(0.01,2b,g1,efm0.95)"] != ratios[0]["topk(0.01,2b,g1)"]
    assert model.compression["topk(0.01,2b,g1,efm0.95)"] != model.compression["topk(0.01,2b,g1)"]
    assert a.multiplier != b.multiplier
    assert json.loads(json.dumps(b.to_json()))["topk"]["ef_decay"] == 0.95
    cfg = compose(overrides(scn, Candidate("edit", "overlap", "topk", 8, topk=TopK(**efm))))
    validate(cfg)
    assert (cfg.sync.error_feedback, cfg.sync.error_feedback_decay, cfg.algo.outer.momentum) == (True, 0.95, 0.0)
    with pytest.raises(PlanError, match=r"candidates.topk\[0\]: sync.error_feedback_decay must be in \(0, 1\]"):
        scenario_from_dict({"name": "x", "clusters": [{"name": "a", "ranks": 1, "step_s": 1}],
                            "candidates": {"topk": [{"density": 0.1, "bits": 2, "ef_decay": 1.5}]}})


def test_the_hundredth_of_the_bytes_pair_is_planned_at_the_outer_lr_it_was_found_at():
    """The default candidates hold issue 51's pair (3 of 32 groups of 8, 2 bits, β = 0.6) with `outer_lr` 1.7:
    its overrides are a valid config at that outer step (momentum 0), and an outer lr without error feedback as
    momentum, or not a positive number, is refused in one line naming the entry."""
    from edit_train.cli.common import compose
    from edit_train.config import validate
    from edit_train.plan.planner import overrides
    from edit_train.plan.spec import Candidate, CandidateSet, TopK

    pair = next(t for t in CandidateSet().topk if t.get("ef_decay", 1.0) < 1.0)
    assert (pair["density"], pair["group"], pair["ef_decay"], pair["outer_lr"]) == (0.09375, 8, 0.6, 1.7)
    scn = scenario_from_dict({"name": "p", "model": "tiny", "clusters": [{"name": "a", "ranks": 1, "step_s": 1},
                                                                         {"name": "b", "ranks": 1, "step_s": 1}],
                              "block_size": 256, "scale_dtype": "bf16"})
    cfg = compose(overrides(scn, Candidate("edit", "layerwise", "topk", 8, topk=TopK(**pair))))
    validate(cfg)
    assert (cfg.sync.topk_group, cfg.sync.error_feedback_decay, cfg.algo.outer.lr, cfg.algo.outer.momentum,
            cfg.sync.scale_dtype) == (8, 0.6, 1.7, 0.0, "bf16")
    base = {"name": "x", "clusters": [{"name": "a", "ranks": 1, "step_s": 1}]}
    with pytest.raises(PlanError, match=r"candidates.topk\[0\].outer_lr: is the outer lr of error feedback"):
        scenario_from_dict({**base, "candidates": {"topk": [{"density": 0.1, "bits": 2, "outer_lr": 1.7}]}})
    with pytest.raises(PlanError, match=r"candidates.topk\[0\].outer_lr: must be a number > 0"):
        scenario_from_dict({**base, "candidates": {"topk": [{"density": 0.1, "bits": 2, "ef_decay": 0.6,
                                                              "outer_lr": "fast"}]}})


def test_the_default_scenario_tries_top_k_and_runs_its_sites_as_a_real_federation():
    """Issue 64: the default scenario (conf/plan/, the README's `edit-train plan`) tried no top-k although the docs
    and the README lead with it, and its overrides for three sites of their own said `cluster=local`."""
    from edit_train.cli.plan import compose_plan
    from edit_train.plan.planner import overrides
    from edit_train.plan.spec import TopK
    from edit_train.plan.traffic import COMPRESSIONS

    raw = dict(compose_plan([])["scenario"])
    scn = scenario_from_dict(raw)
    assert set(scn.candidates.compressions) == set(COMPRESSIONS) and "topk" in scn.candidates.compressions
    cand = Candidate("edit", "overlap", "topk", 32, topk=TopK(**scn.candidates.topk[-1]))
    over = overrides(scn, cand)
    assert "cluster=real" in over and "cluster=local" not in over, over
    local = scenario_from_dict({**raw, "simulated_link": True})  # one host's federation: the local launcher's
    assert "cluster=local" in overrides(local, cand)


@pytest.mark.parametrize("preset", available_presets())
def test_model_facts_are_the_models_units_counts_and_flops(preset: str) -> None:
    """The planner's torch-free facts of every preset (Ling 2.0's QK-norm and MTP layers included) equal the model
    built on the meta device: the sync units the round makes (names, sizes, in order), the total and active counts,
    and the FLOPs per token the trainer's MFU uses."""
    import torch

    from edit_train.cluster.mesh import fsdp_units
    from edit_train.local_sgd.sync.core import build_units
    from edit_train.model import CausalLM, count_params, load_preset
    from edit_train.train.mfu import flops_per_token

    cfg = load_preset(preset)
    facts = hardware.model_facts(preset)
    with torch.device("meta"):
        model = CausalLM(cfg)
    units = tuple((u.name, sum(p.numel() for p in u.params)) for u in build_units(model, fsdp_units(model)))
    assert facts.units == units
    counts = count_params(cfg)
    assert (facts.total_params, facts.active_params) == (counts["total_params"], counts["active_params"])
    assert facts.flops_per_token(4096) == flops_per_token(cfg, 4096, counts["active_params"])
