"""A cluster added mid-run (issue 48, problem 7): `edit-train-keygen add` puts it on the roster, and it gets an
index and a data part of its own — after the configured clusters, in the order the operator added clusters — or
is refused in one line when the data plan kept no part for it; the report draws its curves apart and the
closing block counts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edit_train.cli.common import compose
from edit_train.cli.train import closing_block
from edit_train.config import ConfigError, cluster_specs
from edit_train.federation import enrol
from edit_train.report.model import Run
from edit_train.train.build import fingerprint, my_cluster
from edit_train.train.site_data import site_data


def _cfg(fed: Path, name: str, *extra: str):
    return compose(["cluster=local", "cluster.clusters=[{name:a},{name:b}]", "algo=diloco", "train.steps=20",
                    f"federation.roster_file={fed / enrol.ROSTER}", f"federation.identity_file={fed / name}.identity",
                    *extra])


@pytest.fixture
def fed(tmp_path: Path) -> Path:
    """A federation of a and b (as `edit-train-keygen federation` makes it), then c and d added mid-run."""
    cfg = compose(["cluster=local", "cluster.clusters=[{name:a},{name:b}]", "algo=diloco", "train.steps=20"])
    d = tmp_path / "fed"
    enrol.make(d, ["a", "b"], (fingerprint(cfg), cfg.train.steps, cfg.algo.name))
    enrol.add(d, "d")  # added first, though its name sorts after c's
    enrol.add(d, "c")
    return d


def _spec(fed: Path, name: str, monkeypatch: pytest.MonkeyPatch, *extra: str):
    monkeypatch.setenv("EDIT_TRAIN_CLUSTER", name)
    cfg = _cfg(fed, name, *extra)
    specs = cluster_specs(cfg)
    return cfg, specs, my_cluster(cfg, specs)


def test_a_joiner_gets_its_own_index_and_data_part(fed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Today a joiner's index is crc32(name) % 2: always one of a's or b's, and so is its data part."""
    sites = {}
    for name in ("a", "b", "c", "d"):
        cfg, specs, spec = _spec(fed, name, monkeypatch, "data.parts=4")
        sites[name] = (spec.index, site_data(cfg, specs, spec))
    assert {n: i for n, (i, _) in sites.items()} == {"a": 0, "b": 1, "d": 2, "c": 3}  # the order they were added
    assert {n: (s.part, s.parts) for n, (_, s) in sites.items()} == {"a": (0, 4), "b": (1, 4), "d": (2, 4),
                                                                     "c": (3, 4)}


def test_a_removed_joiner_keeps_its_place(fed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    enrol.remove(fed, "d")
    assert _spec(fed, "c", monkeypatch)[2].index == 3  # d's index is never handed to another cluster


def test_a_joiner_without_a_part_of_its_own_is_refused_in_one_line(fed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, specs, spec = _spec(fed, "c", monkeypatch, "data.parts=3")  # one part kept: d's
    with pytest.raises(ConfigError) as exc:
        site_data(cfg, specs, spec)
    line = str(exc.value)
    assert "\n" not in line and "cluster c joins the federation" in line and "data.parts=4" in line, line
    cfg, specs, spec = _spec(fed, "d", monkeypatch, "data.split=by_family")
    with pytest.raises(ConfigError, match="by_family gives every family to the 2 configured clusters"):
        site_data(cfg, specs, spec)


def test_a_joiner_without_a_roster_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDIT_TRAIN_CLUSTER", "c")
    cfg = compose(["cluster=local", "cluster.clusters=[{name:a},{name:b}]", "algo=diloco"])
    with pytest.raises(ConfigError, match=r"^cluster c is not one of the configured clusters \(a, b\)") as exc:
        my_cluster(cfg, cluster_specs(cfg))
    assert "\n" not in str(exc.value)


def test_the_report_draws_a_joiners_curves_apart(fed: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Events as each cluster logs them (its index from `my_cluster`): three clusters, three curves."""
    events, per_cluster = [], {}
    for name in ("a", "b", "c"):
        index = _spec(fed, name, monkeypatch, "data.parts=4")[2].index
        for step in (10, 20):
            events.append({"event": "train", "step": step, "cluster_index": index, "cluster": name,
                           "loss": 3.0 + index, "tokens": step * 100, "tokens_per_s": 100.0, "wall": step})
        per_cluster[name] = {"name": name, "index": index, "tokens_per_s": 100.0, "blocked_s": 0.0}
    run = Run(tmp_path, events, {"algo": "diloco", "per_cluster": per_cluster})
    assert run.clusters == [(0, "a"), (1, "b"), (3, "c")]
    assert [list(run.train(i)["loss"]) for i, _ in run.clusters] == [[3.0, 3.0], [4.0, 4.0], [6.0, 6.0]]


def test_the_closing_block_counts_a_joiner() -> None:
    """c joined mid-run and finished first; b is still training: 2 of 3, not 2 of 2."""
    rec = {"ranks": 1, "steps": 20, "tokens": 2000, "wall_s": 10.0, "tokens_per_s": 200.0, "syncs_joined": 2,
           "syncs_missed": 0, "anomalies": 0, "restarts": 0, "blocked_frac": 0.0, "local_steps": [10, 10],
           "final_val_loss": 3.0}
    summary = {"algo": "diloco", "completed": False, "steps": 20, "tokens": 4000, "wall_s": 10.0, "syncs": 2,
               "anomalies": 0, "cross_cluster_bytes": 0, "final_val_loss": 3.0, "initial_val_loss": None,
               "goodput": 0.5, "per_cluster": {"a": {**rec, "name": "a"}, "c": {**rec, "name": "c"}}}
    block = closing_block(summary, "runs/fed", cluster="c", expected=["a", "b"])
    assert "2 of 3 clusters so far" in block and "b still training" in block, block
    assert json.dumps(summary)  # the summary itself is untouched


def test_a_joiner_has_no_simulated_slowdown_of_another_cluster() -> None:
    """Its index is past the configured clusters' factors: its own hardware's speed (today an IndexError at
    start once the index is its own; with crc32 % 2 it took a or b's factor)."""
    from edit_train.sim.hetero import Slowdown

    assert Slowdown(2, [1.0, 3.0], groups=2).base == 1.0 and not Slowdown(2, [1.0, 3.0], groups=2).active
    assert Slowdown(1, [1.0, 3.0], groups=2).base == 3.0


def test_an_a_edit_cluster_syncs_at_its_planned_intervals_and_stops_at_the_runs_last_sync() -> None:
    """Issue 48 (7) had a fast A-EDiT cluster sync early at train.steps to carry its stop vote, and issue 49 had it
    train on past train.steps until most clusters reached it. Now the run is its syncs (`pacer.run_syncs`): a
    cluster syncs at its planned intervals only, past train.steps or not, and the exchange of the run's last
    sync stops it, whatever the counts."""
    import torch

    from edit_train.cluster.group import RankGroup
    from edit_train.local_sgd.sync.pacer import PaceConfig, Pacer
    from edit_train.local_sgd.sync.schedule import ScheduleConfig

    pacer = Pacer(PaceConfig(ScheduleConfig(kind="time", sync_time_s=1e6, interval=10), local_sgd=True,
                             total_steps=20), RankGroup())
    assert pacer.syncs == 2
    pacer.planned = 36  # what τ gave this fast cluster at its last sync
    due = []
    for step in range(0, 40):
        pacer.stepped(step + 1)
        pacer.local_step(step, 0.01)
        due.append(pacer.due)
    assert due.index(True) == 35  # at its planned interval, not at train.steps
    rows = torch.tensor([[36.0, 0.01, 36.0, 1.0, 36.0], [7.0, 0.03, 7.0, 0.0, 7.0]], dtype=torch.float64)
    pacer.exchanged(rows, 0, background_quorum=False, sync=1)
    assert not pacer.stopped and not pacer.should_stop(40)  # past train.steps, one sync to go
    pacer.exchanged(rows, 0, background_quorum=False, sync=2)
    assert pacer.stopped and pacer.should_stop(41)


def test_a_cluster_past_its_target_says_so_in_its_progress_line(caplog) -> None:
    """Issue 48 (7): "step 30/20" under a_edit. A line past train.steps says what the cluster is doing."""
    import io
    import logging

    from edit_train.train.progress import Progress

    p = Progress(["c0"], total=20, desc="a_edit", stream=io.StringIO(), every_s=0.0)
    with caplog.at_level(logging.INFO):
        p.report("c0", 12, 3.0, 100.0)
        p.report("c0", 30, 2.5, 100.0)
        p.close()
    out = "\n".join(r.getMessage() for r in caplog.records)
    assert "step 12/20 " in out and "step 30 (past train.steps 20: a fast cluster trains on to the run's last sync)" in out
    assert "30/20" not in out
