"""Issue 51: the convergence grid's options stage and the smoke modes of convergence.py / compression.py, checked
without training (the grids themselves run in a later session; `--smoke` runs them in miniature)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _tuning as T  # noqa: E402
import compression  # noqa: E402
import convergence  # noqa: E402

from edit_train.cli.common import compose  # noqa: E402
from edit_train.codec.dense import CompressionConfig  # noqa: E402
from edit_train.config import validate  # noqa: E402


def test_every_algorithm_gets_the_same_options_budget() -> None:
    a = convergence.parse_args(["--tune", "--confirm"])
    assert a.options and a.inner_lrs == [2e-3, 3e-3, 5e-3] and a.muon_lrs == [1e-2, 2e-2, 4e-2]
    sizes = {}
    for algo in convergence.ALGOS:
        base = T.Setting(algo, 3e-3, 0.7, 0.8) if algo in T.OUTER_TUNED else T.base_setting(algo, 3e-3)
        grid = T.option_grid(base, a.muon_lrs, a.steps, a.interval)
        sizes[algo] = len(grid)
        assert all(s.variant and s.extra for s in grid) and len({s.tag() for s in grid}) == len(grid)
        # every algorithm's Muon on the same lr grid (DDP tuned with Muon as hard as ours)
        assert sorted(s.lr for s in grid if s.variant == "muon") == a.muon_lrs
    assert sizes == {"ddp": 3, "post_local_sgd": 3, "diloco": 5, "edit": 5}
    edit = {s.variant: s for s in T.option_grid(T.Setting("edit", 3e-3, 0.7, 0.8), a.muon_lrs, 1000, 8)}
    assert edit["outer_schedule"].overrides()[-2:] == ["algo.outer.lr_warmup_syncs=12", "algo.outer.lr_decay_syncs=125"]
    assert T.Setting.from_dict(edit["outer_warmup"].as_dict()) == edit["outer_warmup"]
    with_opts = T.planned_tune_runs(convergence.ALGOS, a.inner_lrs, a.base_lr, a.outer_lrs, a.outer_momenta, True)
    assert with_opts == T.planned_tune_runs(convergence.ALGOS, a.inner_lrs, a.base_lr, a.outer_lrs,
                                            a.outer_momenta) + sum(sizes.values())


@pytest.mark.parametrize("algo", convergence.ALGOS)
def test_every_option_override_is_a_valid_config(algo: str) -> None:
    """Each options-stage run's overrides build a config edit_train accepts (a typo would fail every run)."""
    a = convergence.parse_args(["--smoke"])
    base = T.Setting(algo, 3e-3, 0.7, 0.8) if algo in T.OUTER_TUNED else T.base_setting(algo, 3e-3)
    for st in T.option_grid(base, a.muon_lrs, a.steps, a.interval):
        validate(compose(T.tuned_overrides(st, a, 0, 2)))


def test_smoke_modes_are_small_and_complete() -> None:
    a = convergence.parse_args(["--smoke"])
    assert a.tune and a.confirm and a.steps <= 16 and a.seeds == [0] and a.clusters == [2] and a.options
    assert a.out.name == "smoke.json"
    c = compression.parse_args(["--smoke"])
    assert c.steps <= 16 and c.seeds == [0] and c.settings == ["convergence"] and c.no_small
    assert any("efm" in s for s in c.schemes) and c.out.name == "smoke.json"


def _unpinned(overrides: list[str]) -> list[str]:
    """A scheme's overrides less the old top-k defaults it pins (compression._PINS)."""
    return [o for o in overrides if o not in {f"{k}={v}" for k, v in compression._PINS.items()}]


def test_every_top_k_scheme_names_the_defaults_that_changed() -> None:
    """The top-k defaults changed (issue 51); a scheme must mean the same run before and after: every top-k scheme
    names its density, group and decay, and a record from before the change that did not is still the same run."""
    from edit_train.retired import CHANGED_DEFAULTS, implicit_before

    for name, ov in compression.SCHEMES.items():
        if "sync.compression=topk" in ov:
            assert {k for k in CHANGED_DEFAULTS} <= {o.split("=", 1)[0] for o in ov}, name
    ov = compression.SCHEMES["topk_1pct_2b"]
    old = _unpinned(ov)
    since = min(t for _, t in CHANGED_DEFAULTS.values())
    assert implicit_before(ov, old, since - 1) == old  # recorded before: the same run
    assert implicit_before(ov, old, since + 1) == ov  # recorded after: it ran today's defaults, not the same run
    assert implicit_before(["sync.topk_group=8"], [], since - 1) == ["sync.topk_group=8"]  # not the old value
    assert implicit_before(["sync.error_feedback_decay=null"], [], since - 1) == ["sync.error_feedback_decay=null"]


def test_error_feedback_as_momentum_schemes_keep_their_twins_payloads() -> None:
    for name, ov in compression.SCHEMES.items():
        if "_efm" not in name:
            continue
        twin = name.rsplit("_efm", 1)[0]
        assert _unpinned(ov)[:len(_unpinned(compression.SCHEMES[twin]))] == _unpinned(compression.SCHEMES[twin])
        kv = dict(x.split("=", 1) for x in ov)
        beta = float(kv["sync.error_feedback_decay"])
        CompressionConfig(kv["sync.compression"], int(kv.get("sync.block_size", 256)), kv["sync.scale_dtype"], True,
                          float(kv["sync.topk_density"]), int(kv["sync.bits"]), error_feedback_decay=beta).validate()


def test_muon_lr_benchmark_settings_are_valid_and_tune_both_sides_alike(tmp_path: Path) -> None:
    """benchmarks/muon_lr.py: every setting builds a config edit_train accepts; DDP and edit sweep Muon's lr over
    grids of the same reach; a run started by hand is adopted only when its resolved config is the setting's."""
    import json

    import muon_lr as M

    from edit_train.config import to_container

    sweep = M.sweep()
    assert len({s["name"] for s in sweep}) == len(sweep)
    for s in sweep:
        validate(compose([*M.C.BASE_OVERRIDES, *s["overrides"]]))
    lrs = {a: sorted({s["lr"] for s in sweep if s["algo"] == a and s["optimizer"] == "muon"}) for a in ("ddp", "edit")}
    assert len(lrs["ddp"]) >= 4 and min(lrs["ddp"]) <= min(lrs["edit"]) and max(lrs["ddp"]) >= 4e-2
    s = M.setting("edit", "muon", 4e-2, "1.0/0")
    run = tmp_path / s["name"]
    run.mkdir()
    (run / "summary.json").write_text("{}")
    cfg = to_container(compose([*M.C.BASE_OVERRIDES, *s["overrides"], "run.dir=/elsewhere"]))
    (run / "config.json").write_text(json.dumps(cfg))
    assert M.adoptable(run, s["overrides"])  # only run.dir differs
    cfg["train"]["lr"] = 0.02
    (run / "config.json").write_text(json.dumps(cfg))
    assert not M.adoptable(run, s["overrides"])


def test_muon_momentum_and_run_length_studies_treat_both_sides_alike() -> None:
    """benchmarks/muon_lr.py: Muon's momentum is tried at the same values for DDP and edit (each at its best lr),
    and the run-length study takes each algorithm's best seed-0 point to LONG_STEPS; neither enters the lr sweep's
    best (a 1280-step run is not a 320-step setting)."""
    import muon_lr as M

    sweep = M.sweep()
    momenta = {a: sorted({s["momentum"] for s in sweep if s["algo"] == a and s["momentum"] is not None
                          and s["outer"] in (None, "1.0/0")}) for a in ("ddp", "edit")}
    assert momenta["ddp"] == momenta["edit"] == sorted(M.MOMENTA) and 0.95 not in M.MOMENTA
    rows = [{**{k: v for k, v in s.items() if k != "overrides"}, "final_val_loss": 2.0 + i / 100}
            for i, s in enumerate(sweep)]
    rows.append({**M.setting("edit", "muon", 6e-2, "1.0/0", steps=M.LONG_STEPS), "final_val_loss": 0.1})
    best = M.best_of(rows, "edit", "muon")
    assert best["steps"] == 320 and best["final_val_loss"] > 2.0
    long = M.long_runs(rows)
    n = 2 * len(M.LONG_AT)
    assert [(s["algo"], s["clusters"], s["seed"]) for s in long][:n] == [(a, g, sd) for g, sd in M.LONG_AT
                                                                        for a in ("ddp", "edit")]
    assert all(s["steps"] == M.LONG_STEPS for s in long)
    assert all(s["algo"] == "edit" and s["outer"] == "1.0/0" and (s["clusters"], s["seed"]) == (2, 0)
               for s in long[n:])  # edit's best with the clip on
    for s in long:
        assert f"train.steps={M.LONG_STEPS}" in s["overrides"]
        validate(compose([*M.C.BASE_OVERRIDES, *s["overrides"]]))
    for s in sweep:
        if s["momentum"] is not None:
            assert f"train.muon_momentum={s['momentum']!r}" in s["overrides"]


def test_compression_with_muon_runs_every_scheme_and_its_reference_at_muons_point() -> None:
    """`compression.py --inner muon`: the uncompressed reference and each scheme take Muon at edit's tuned Muon point;
    every run's overrides build a valid config, and the scheme's own outer lr (1.0) agrees with that point."""
    a = compression.parse_args(["--inner", "muon", "--schemes", "topk_1pct_2b_efm95", "--settings", "convergence"])
    assert a.inner == "muon" and a.schemes[0] == "none"
    for name in a.schemes:
        ov = [*compression.common(a), *compression.INNER[a.inner], "seed=0", *compression.SCHEMES[name]]
        cfg = compose(ov)
        validate(cfg)
        assert cfg.train.optimizer == "muon" and cfg.train.lr == 0.06 and cfg.algo.outer.lr == 1.0
    assert compression.parse_args([]).inner == "adamw"


def test_heterogeneity_muon_arms_are_valid_configs() -> None:
    import heterogeneity as H

    a = H.parse_args(["--quick", "--runs", "ddp+muon", "a_edit+muon"])
    for name in a.runs:
        cfg = compose(H.run_overrides(name, a))
        validate(cfg)
        assert cfg.train.optimizer == "muon" and cfg.algo.name == H.RUNS[name][0]


def test_heterogeneity_top_k_arms_run_the_defaults_on_a_edit() -> None:
    """The `+topk` arms: a_edit with `sync.compression=topk` at its defaults (3 of 32 groups of 8, β 0.6), one at
    a_edit's own outer step, one at the outer lr the pair was found at."""
    import heterogeneity as H

    a = H.parse_args(["--quick", "--runs", "a_edit+topk", "a_edit+topk_lr17"])
    cfgs = [compose(H.run_overrides(name, a)) for name in a.runs]
    for cfg in cfgs:
        validate(cfg)
        assert cfg.algo.name == "a_edit" and (cfg.sync.topk_group, cfg.sync.topk_density) == (8, 0.09375)
        assert CompressionConfig.of(cfg.sync).error_feedback_decay == 0.6
    assert [c.algo.outer.lr for c in cfgs] == [compose(H.run_overrides("a_edit", a)).algo.outer.lr, 1.7]
    assert set(H.COLORS) == set(H.RUNS) and len(set(H.COLORS.values())) == len(H.COLORS)  # one colour each


def test_a_winning_momentum_gets_its_lr_checked_on_the_algorithms_own_grid() -> None:
    import muon_lr as M

    rows = [{**{k: v for k, v in s.items() if k != "overrides"}, "final_val_loss": 2.0} for s in M.sweep()]
    for r in rows:
        if (r["algo"], r["lr"], r["momentum"]) in (("ddp", 3e-2, 0.8), ("edit", 6e-2, 0.9)):
            r["final_val_loss"] = 1.0
    got = {(s["algo"], s["lr"], s["momentum"], s["outer"]) for s in M.lr_at_best_momentum(rows)}
    assert got == {("ddp", 2e-2, 0.8, None), ("ddp", 4e-2, 0.8, None),
                   ("edit", 4e-2, 0.9, "1.0/0"), ("edit", 8e-2, 0.9, "1.0/0")}
    plain = [{**r, "final_val_loss": 1.0 if r["momentum"] is None and r["lr"] == 3e-2 else 2.0} for r in rows]
    assert M.lr_at_best_momentum(plain) == []  # the default momentum won: nothing to check again


def test_heterogeneity_muon_lr_replaces_both_arms_lr_and_nothing_else() -> None:
    import heterogeneity as H

    a = H.parse_args(["--quick", "--muon-lr", "0.01", "--runs", "ddp", "ddp+muon", "a_edit+muon"])
    for name in ("ddp+muon", "a_edit+muon"):
        assert compose(H.run_overrides(name, a)).train.lr == 0.01
    assert compose(H.run_overrides("ddp", a)).train.lr == compose([]).train.lr


def test_inner_state_harness_averages_parameters_and_the_named_state_only() -> None:
    import inner_state as I

    torch = pytest.importorskip("torch")
    models = [torch.nn.Linear(3, 2) for _ in range(2)]
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in models]
    for m, o in zip(models, opts):
        m(torch.randn(4, 3)).sum().backward()
        o.step()
    w = [m.weight.detach().clone() for m in models]
    avg1 = [o.state[m.weight]["exp_avg"].clone() for m, o in zip(models, opts)]
    sq = [o.state[m.weight]["exp_avg_sq"].clone() for m, o in zip(models, opts)]
    I.average_params(models)
    I.average_state(models, opts, ("exp_avg",))
    for m, o, s in zip(models, opts, sq):
        assert torch.equal(m.weight, (w[0] + w[1]) / 2)
        assert torch.allclose(o.state[m.weight]["exp_avg"], (avg1[0] + avg1[1]) / 2)
        assert torch.equal(o.state[m.weight]["exp_avg_sq"], s)  # not named: left alone
        assert o.state[m.weight]["step"].ndim == 0  # counters untouched


def test_interval_power_benchmark_pairs_each_edit_run_with_its_ddp_and_only_adds_the_power() -> None:
    import interval_power as IP
    import muon_lr as M

    runs = IP.settings()
    for s in runs:
        validate(compose(s["overrides"]))
    edit = [s for s in runs if s["algo"] == "edit"]
    # each p = 1 run is its p = 0 twin (the muon_lr.py run, same name) plus the one override
    for s in (s for s in edit if s["power"] > 0):
        twin = next(t for t in edit if t["power"] == 0 and t["name"] == s["name"].removesuffix(f"_p{IP.POWER:g}"))
        assert s["overrides"] == [*twin["overrides"], f"algo.interval_power={IP.POWER!r}"]
    assert {s["name"] for s in runs if s["power"] == 0} <= {x["name"] for x in M.sweep()} | {
        M.setting(a, "muon", 3e-2, o, seed=sd, clusters=g, momentum=m)["name"]
        for a, o, m in (("ddp", None, 0.8), ("edit", "1.0/0-noclip", 0.9))
        for g, sd in ((2, 0), (2, 1), (2, 2), (4, 0))}
    rows = [{**{k: v for k, v in s.items() if k != "overrides"}, "final_val_loss": 1.0 + 0.1 * (s["algo"] == "edit")
             - 0.05 * (s["power"] > 0)} for s in runs]
    summary = IP.summarize(rows)
    assert summary["muon g2 s1"]["p0"]["ratio"] == pytest.approx(1.1)
    assert summary["adamw g2 s0"]["p1"]["ratio"] == pytest.approx(1.05)


def test_inner_state_harness_places_the_syncs_like_the_product() -> None:
    import inner_state

    from edit_train.local_sgd.schedule import lr_boundaries
    assert sorted(inner_state.sync_steps(320, 8, 0.0)) == list(lr_boundaries([1.0] * 320, 0, 8, 1.0))
    grow = sorted(inner_state.sync_steps(320, 8, 0.75))
    assert len(grow) == 40 and grow[-1] == 320 and grow[1] - grow[0] < 8 < grow[-1] - grow[-2]


def test_heterogeneity_same_box_reads_each_sides_result_and_links_an_old_config_tree(tmp_path: Path) -> None:
    import heterogeneity_same_box as S

    d = {"results": {"a_edit": {"final_val_loss": 2.46, "train_tokens_per_s": 7000.0},
                     "ddp": {"final_val_loss": 2.96}},
         "standalone": {"standalone_x1": {"train_tokens_per_s": 6400.0}}}
    r = S.row(d, "this checkout", 1)
    assert (r["a_edit"], r["ddp"], r["alone_train_tokens_per_s"]) == (2.46, 2.96, 6400.0)
    assert S.row({**d, "results": {"a_edit": d["results"]["a_edit"]}}, "baseline", 2)["ddp"] is None
    # a checkout from before the config tree moved into the package: edit_train/conf is linked to conf/
    old = tmp_path / "old"
    (old / ".git").mkdir(parents=True)
    (old / "conf").mkdir()
    (old / "conf" / "config.yaml").write_text("defaults: []\n")
    (old / "edit_train").mkdir()
    assert S.worktree("unused", old) == old and (old / "edit_train" / "conf" / "config.yaml").is_file()


def test_the_grouped_pairs_send_at_most_a_hundredth_of_fp32s_bytes_and_are_valid_configs() -> None:
    """Issue 51's grouped top-k family: each format's payloads over the tiny model's units are <= 1/100 of fp32's
    bytes (the codec's own count; the runs measured 0.0097 with the small exchange); each scheme composes and
    validates; every `_efm` scheme is its twin plus the decay (and an outer lr), nothing else."""
    from edit_train.codec.dense import wire_bytes

    units = compression.unit_sizes("tiny")
    for twin in compression._GROUPED_FORMATS:
        kv = dict(x.split("=", 1) for x in compression.GROUPED_51[twin])
        cfg = CompressionConfig("topk", int(kv["sync.block_size"]), kv["sync.scale_dtype"], True,
                                float(kv["sync.topk_density"]), int(kv["sync.bits"]), topk_group=int(kv["sync.topk_group"]))
        cfg.validate()
        ratio = sum(wire_bytes(n, cfg) for _, n in units) / sum(4 * n for _, n in units)
        assert ratio <= (0.0175 if twin == "topk_19pct_2b_g8" else 0.01), (twin, ratio)
    for name, ov in compression.GROUPED_51.items():
        twin = next(t for t in sorted(compression._GROUPED_FORMATS, key=len, reverse=True) if name.startswith(t))
        ov, base = _unpinned(ov), _unpinned(compression.SCHEMES[twin])
        assert ov[:len(base)] == base
        extra = {o.split("=", 1)[0] for o in ov[len(base):]}
        assert extra <= {"sync.error_feedback_decay", "algo.outer.lr", "sync.unsent", "sync.error_feedback"}, name
        assert ("sync.error_feedback_decay" in extra) == ("_efm" in name)
    validate(compose([*compression.common(compression.parse_args([])), *compression.EDIT, "seed=0",
                      *compression.SCHEMES["topk_9pct_2b_g8_efm60_lr17"]]))


def test_ef_momentum_grid_reads_each_schemes_place_and_plots_what_ran(tmp_path: Path) -> None:
    """`benchmarks/ef_momentum_grid.py`: a scheme's row and outer lr come from its overrides (the later one
    wins, as on the command line); the figure is drawn from the ratios it is given."""
    import ef_momentum_grid as G

    assert G.point("none") == ("fp32 (uncompressed)", 0.7)
    assert G.point("none_lr14") == ("fp32 (uncompressed)", 1.4)
    assert G.point("topk_9pct_2b_g8") == ("β = 1", 0.7)
    assert G.point("topk_9pct_2b_g8_efm60_lr17") == ("β = 0.6", 1.7)
    assert G.point("topk_9pct_2b_g8_keep_lr14") == ("keep", 1.4)
    assert G.point("topk_9pct_2b_g8_noef") == ("no error feedback", 1.0)
    assert set(G.CONFIRM) <= set(G.grid_schemes()) and not any(n.endswith("_outer") for n in G.grid_schemes())
    out = G.plot({"none": [1.0], "topk_9pct_2b_g8_efm60_lr17": [0.96]},
                 {"topk_9pct_2b_g8_efm60_lr17": [0.96, 0.98, 0.97]}, tmp_path / "g.png")
    assert Path(out).stat().st_size > 0


def test_compression_runs_four_clusters_only_when_asked() -> None:
    """`--settings convergence_4` is the convergence setting at 4 clusters; a plain run does not start it."""
    assert "convergence_4" not in compression.parse_args([]).settings
    a = compression.parse_args(["--settings", "convergence_4"])
    cfg = compose([*compression.common(a), *compression.SETTINGS["convergence_4"], *compression.EDIT, "seed=0",
                   *compression.SCHEMES["topk_9pct_2b_g8_efm60_lr17"]])
    validate(cfg)
    assert cfg.cluster.count == 4 and cfg.sync.error_feedback_decay == 0.6


def test_interval_floor_pairs_each_average_with_its_ddp_and_keeps_the_better_momentum(tmp_path: Path) -> None:
    import interval_floor as F

    pts = F.points()
    assert len({p.name for p in pts}) == len(pts)
    for p in pts:  # every replica run has DDP at the same cluster count and seed, at DDP's tuned point
        assert F.Point("ddp", p.clusters, p.seed) in pts
    assert {p.interval for p in pts if (p.mode, p.clusters, p.seed) == ("local", 2, 0)} == {1, 2, 4, 8}
    rows = [{"mode": "ddp", "clusters": 2, "seed": 0, "interval": 8, "momentum": 0.8, "final_val_loss": 1.5},
            {"mode": "local", "clusters": 2, "seed": 0, "interval": 1, "momentum": 0.8, "final_val_loss": 1.56},
            {"mode": "local", "clusters": 2, "seed": 0, "interval": 1, "momentum": 0.9, "final_val_loss": 1.53},
            {"mode": "local", "clusters": 2, "seed": 0, "interval": 8, "momentum": 0.8, "final_val_loss": 1.62},
            {"mode": "local_state", "clusters": 2, "seed": 0, "interval": 1, "momentum": 0.8,
             "final_val_loss": 1.515},
            {"mode": "local", "clusters": 4, "seed": 0, "interval": 1, "momentum": 0.8, "final_val_loss": 9.0}]
    s = F.summarize(rows)
    assert list(s) == ["g2 s0"]  # no DDP at 4 clusters: nothing to divide by, no entry
    h1 = s["g2 s0"]["intervals"]["1"]
    assert (h1["momentum"], h1["ratio"]) == (0.9, pytest.approx(1.02))
    assert h1["tried"] == {"0.8": 1.56, "0.9": 1.53}
    assert s["g2 s0"]["intervals"]["8"]["ratio"] == pytest.approx(1.08)
    assert s["g2 s0"]["state_averaged_H1"]["ratio"] == pytest.approx(1.01)
    two = {"ddp": 1.0, "intervals": {"1": {"ratio": 1.04}}}
    fl = F.floor({**s, "g2 s1": two, "g4 s0": {"ddp": 1.0, "intervals": {"8": {"ratio": 1.2}}}})
    assert list(fl) == ["g2"]  # a cluster count without an H = 1 run has no floor
    assert fl["g2"] == {"mean": pytest.approx(1.03), "min": pytest.approx(1.02), "max": 1.04,
                        "seeds": {"s0": pytest.approx(1.02), "s1": 1.04}}
    # a result on disk is reused only when it was run with exactly these arguments
    p = F.Point("local", 2, 0, 1, 0.8)
    out = tmp_path / f"{p.name}.json"
    args = {"mode": "local", "clusters": "2", "seed": "0", "interval": "1", "lr": "0.03", "momentum": "0.8",
            "optimizer": "muon", "steps": "320"}
    out.write_text(json.dumps({"args": args, "final_val_loss": 1.55}))
    assert F.finished(p, out) == 1.55
    out.write_text(json.dumps({"args": {**args, "interval": "8"}, "final_val_loss": 1.55}))
    assert F.finished(p, out) is None
    assert F.finished(p, tmp_path / "missing.json") is None
