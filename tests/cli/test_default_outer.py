"""The outer step's default by cluster count (issue 66): the table, where it is applied, that a named value wins,
and that the run says which it used (summary.json `outer`, the closing block)."""

from __future__ import annotations

import math

import pytest

from edit_train.cli.common import compose
from edit_train.config import outer_step, validate
from edit_train.local_sgd.sync.outer import DEFAULT_OUTER_STEPS, OuterConfig, default_outer_step

EDIT2 = ["algo=edit", "cluster.count=2", "cluster.ranks=1", "model=tiny", "algo.interval=8"]


@pytest.mark.parametrize("clusters,interval,want", [
    (1, 8, (0.5, 0.5)),  # one cluster: the first row (M <= 2)
    (2, 8, (0.5, 0.5)),  # measured: the 9-point grid's best at 2 clusters, H = 8 (results/convergence_tuned.json)
    (2, 1, (0.5, 0.5)),  # the interval does not move it yet (only H = 8 measured)
    (2, 32, (0.5, 0.5)),
    (3, 8, (0.7, 0.5)),  # M >= 3: the longer of the two steps tried at 4 clusters (seed 0)
    (4, 8, (0.7, 0.5)),
    (8, 16, (0.7, 0.5)),
    (64, 8, (0.7, 0.5)),
])
def test_the_table_by_cluster_count_and_interval(clusters, interval, want):
    assert default_outer_step(clusters, interval) == want


def test_the_table_covers_every_cluster_count_and_is_not_the_old_default():
    assert DEFAULT_OUTER_STEPS[-1][0] == math.inf
    assert [row[0] for row in DEFAULT_OUTER_STEPS] == sorted(row[0] for row in DEFAULT_OUTER_STEPS)
    assert default_outer_step(2, 8) != (0.7, 0.8)  # the EDiT paper's step: 1.19-1.25 x DDP at 2 clusters
    with pytest.raises(ValueError, match="needs >= 1 cluster"):
        default_outer_step(0, 8)


def test_an_unset_field_takes_the_table_and_a_set_one_is_kept():
    both = OuterConfig(lr=None, momentum=None)
    assert both.unset == ("lr", "momentum")
    r = both.resolved(2, 8)
    assert (r.lr, r.momentum, r.nesterov, r.unset) == (0.5, 0.5, True, ())
    only_lr = OuterConfig(lr=0.9, momentum=None).resolved(2, 8)
    assert (only_lr.lr, only_lr.momentum) == (0.9, 0.5)
    named = OuterConfig(lr=0.7, momentum=0.8)
    assert named.resolved(2, 8) is named
    with pytest.raises(ValueError, match=r"algo.outer.lr is unset"):
        both.validate()


def test_edit_leaves_it_to_the_default_and_the_config_resolves_it():
    cfg = compose(EDIT2)
    assert (cfg.algo.outer.lr, cfg.algo.outer.momentum) == (None, None)  # conf/algo/edit.yaml: null
    validate(cfg)
    step = outer_step(cfg)
    assert (step.config.lr, step.config.momentum, step.config.nesterov) == (0.5, 0.5, True)
    assert (step.clusters, step.interval, step.unset) == (2, 8, ("lr", "momentum"))
    four = outer_step(compose([*EDIT2, "cluster.count=4"]))
    assert (four.clusters, four.config.lr, four.config.momentum) == (4, *default_outer_step(4, 8))
    listed = outer_step(compose(["algo=edit", "cluster=local", "cluster.clusters=[{name: a}, {name: b}, {name: c}]"]))
    assert listed.clusters == 3  # the configured clusters, however they are given


def test_an_explicit_outer_lr_wins():
    step = outer_step(compose([*EDIT2, "algo.outer.lr=0.9"]))
    assert (step.config.lr, step.config.momentum, step.unset) == (0.9, 0.5, ("momentum",))
    both = outer_step(compose([*EDIT2, "algo.outer.lr=0.7", "algo.outer.momentum=0.8"]))
    assert (both.config.lr, both.config.momentum, both.unset) == (0.7, 0.8, ())


def test_the_algorithm_runs_the_resolved_step():
    from edit_train.train.build import local_sgd_config

    assert (local_sgd_config(compose(EDIT2)).outer.lr, local_sgd_config(compose(EDIT2)).outer.momentum) == (0.5, 0.5)
    named = local_sgd_config(compose([*EDIT2, "algo.outer.lr=1.1", "algo.outer.momentum=0.0",
                                      "algo.outer.nesterov=false"])).outer
    assert (named.lr, named.momentum, named.nesterov) == (1.1, 0.0, False)


def test_the_other_algorithms_keep_their_named_steps():
    """a_edit (the demo), diloco and post_local_sgd name their outer step: the default does not touch them."""
    for algo, want in (("a_edit", (0.7, 0.8)), ("diloco", (0.7, 0.9)), ("post_local_sgd", (1.0, 0.0))):
        step = outer_step(compose([f"algo={algo}", "cluster.count=2"]))
        assert (step.config.lr, step.config.momentum, step.unset) == (*want, ()), algo


def test_a_cluster_naming_the_defaults_numbers_agrees_with_one_that_leaves_them_unset():
    from edit_train.train.build import fingerprint

    default = fingerprint(compose(EDIT2))
    assert default == fingerprint(compose([*EDIT2, "algo.outer.lr=0.5", "algo.outer.momentum=0.5"]))
    assert default != fingerprint(compose([*EDIT2, "algo.outer.lr=0.7", "algo.outer.momentum=0.8"]))


def test_the_summary_and_the_closing_block_say_the_outer_step_and_where_it_came_from():
    from edit_train.cli.train import closing_block
    from edit_train.train.summary import merge

    rec = outer_step(compose(EDIT2)).record()
    assert rec == {"optimizer": "SGD", "lr": 0.5, "momentum": 0.5, "nesterov": True,
                   "default_for": ["lr", "momentum"], "clusters": 2, "interval": 8}

    def cluster(name: str) -> dict:
        return {"name": name, "index": int(name[1]), "ranks": 1, "steps": 40, "tokens": 2560, "wall_s": 10.0,
                "tokens_per_s": 256.0, "syncs": 5, "syncs_joined": 5, "syncs_missed": 0, "local_steps": [8] * 5,
                "blocked_frac": 0.1, "blocked_s": 1.0, "anomalies": 0, "restarts": 0, "final_val_loss": 3.5,
                "initial_val_loss": 6.1, "cross_cluster_bytes": 1000, "algo": "edit", "total_params": 10,
                "active_params": 10, "useful_s": 9.0, "first_start": 0.0, "outer": rec}

    summary = merge([cluster("c0"), cluster("c1")], ["c0", "c1"])
    assert summary["outer"] == rec
    block = closing_block(summary, "runs/x")
    line = next(x for x in block.splitlines() if x.startswith("  outer step:"))
    assert line == ("  outer step: lr 0.5, momentum 0.5 Nesterov (lr and momentum: the default for 2 clusters, "
                    "interval 8; docs/algorithms.md)"), line
    named = outer_step(compose([*EDIT2, "algo.outer.lr=0.9"])).record()
    block = closing_block({**summary, "outer": named}, "runs/x")
    assert "  outer step: lr 0.9, momentum 0.5 Nesterov (momentum: the default for 2 clusters, interval 8;" in block
    set_all = outer_step(compose([*EDIT2, "algo.outer.lr=0.7", "algo.outer.momentum=0.8"])).record()
    assert "  outer step: lr 0.7, momentum 0.8 Nesterov (as set)" in closing_block({**summary, "outer": set_all}, "x")
    ddp = {k: v for k, v in summary.items() if k != "outer"}
    assert "outer step" not in closing_block(ddp, "runs/x")  # DDP has none


def test_a_benchmark_reuses_an_edit_run_of_the_old_step_only_where_it_pins_that_step(tmp_path):
    """`--reuse`: an edit run recorded before issue 66 that named no outer step ran 0.7 / 0.8 (its config.json says
    so); today's same overrides would run the default by cluster count, so it is not reused — unless today's pin
    0.7 / 0.8. A run of today (config.json: null) and any other algorithm compare as before."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import _common as C

    base = ["algo=edit", "cluster.count=2", "seed=11"]
    old_pin = [*base, "algo.outer.lr=0.7", "algo.outer.momentum=0.8"]

    def recorded(name: str, algo: str, lr: float | None, momentum: float | None, args: list[str]) -> Path:
        run = tmp_path / name
        run.mkdir()
        (run / "summary.json").write_text("{}")
        (run / "config.json").write_text(json.dumps({"algo": {"name": algo, "outer": {"lr": lr,
                                                                                       "momentum": momentum}}}))
        (run / "bench_job.json").write_text(json.dumps({"args": C.job_args(run, args), "wall_s": 1.0}))
        return run

    old = recorded("old", "edit", 0.7, 0.8, base)
    assert C.finished_run(old, base) is None  # it ran the old step; today's run would not
    assert C.finished_run(old, old_pin) is not None  # today's run pinning that step is the same run
    assert C.finished_run(old, [*base, "algo.outer.lr=0.7"]) is None  # the momentum would be the default's today
    today = recorded("today", "edit", None, None, base)
    assert C.finished_run(today, base) is not None and C.finished_run(today, old_pin) is None
    named = recorded("named", "edit", 0.5, 0.5, [*base, "algo.outer.lr=0.5", "algo.outer.momentum=0.5"])
    assert C.finished_run(named, [*base, "algo.outer.lr=0.5", "algo.outer.momentum=0.5"]) is not None
    ddp = recorded("ddp", "ddp", 0.7, 0.8, ["algo=ddp", "seed=11"])
    assert C.finished_run(ddp, ["algo=ddp", "seed=11"]) is not None


def test_the_benchmark_runs_the_issues_command_and_divides_by_ddp_at_the_same_count_and_seed():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import default_outer as B

    runs = {s["name"]: s for s in B.settings()}
    assert runs["edit_g2_s11"]["overrides"] == [
        "algo=edit", "cluster.count=2", "cluster.ranks=1", "model=tiny", "train.steps=320", "algo.interval=8",
        "train.batch_size=8", "train.seq_len=128", "seed=11"]  # nothing about the outer step: the default's
    assert runs["ddp_g2_s11"]["overrides"][1:] == runs["edit_g2_s11"]["overrides"][1:]
    assert runs["edit_g2_s11_o0.7-0.8N"]["overrides"][-3:] == [
        "algo.outer.lr=0.7", "algo.outer.momentum=0.8", "algo.outer.nesterov=true"]
    rows = B.with_ratios([
        {"algo": "ddp", "clusters": 2, "seed": 11, "final_val_loss": 2.0, "outer_named": None},
        {"algo": "edit", "clusters": 2, "seed": 11, "final_val_loss": 2.1, "outer_named": None,
         "outer": {"lr": 0.5}},
        {"algo": "edit", "clusters": 2, "seed": 11, "final_val_loss": 2.5, "outer_named": B.OLD},
        {"algo": "edit", "clusters": 4, "seed": 11, "final_val_loss": 1.9, "outer_named": None}])
    assert [r["ratio_vs_ddp"] for r in rows] == [None, pytest.approx(1.05), pytest.approx(1.25), None]
    summary = B.summarize(rows)
    assert summary["g2_s11"]["default"]["ratio"] == pytest.approx(1.05)
    assert summary["g2_s11"]["0.7/0.8N"]["edit"] == 2.5 and "g4_s11" not in summary  # no DDP at 4: no ratio
    assert B.targets(summary) == {"edit_g2_s11_ratio": pytest.approx(1.05), "edit_g2_s11_le_1.07": True}
