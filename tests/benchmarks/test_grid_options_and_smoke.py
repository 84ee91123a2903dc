"""Issue 51: the convergence grid's options stage and the smoke modes of convergence.py / compression.py, checked
without training (the grids themselves run in a later session; `--smoke` runs them in miniature)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
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


def test_heterogeneity_muon_lr_replaces_both_arms_lr_and_nothing_else() -> None:
    import heterogeneity as H

    a = H.parse_args(["--quick", "--muon-lr", "0.01", "--runs", "ddp", "ddp+muon", "a_edit+muon"])
    for name in ("ddp+muon", "a_edit+muon"):
        assert compose(H.run_overrides(name, a)).train.lr == 0.01
    assert compose(H.run_overrides("ddp", a)).train.lr == compose([]).train.lr


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


def test_compression_runs_four_clusters_only_when_asked() -> None:
    """`--settings convergence_4` is the convergence setting at 4 clusters; a plain run does not start it."""
    assert "convergence_4" not in compression.parse_args([]).settings
    a = compression.parse_args(["--settings", "convergence_4"])
    cfg = compose([*compression.common(a), *compression.SETTINGS["convergence_4"], *compression.EDIT, "seed=0",
                   *compression.SCHEMES["topk_9pct_2b_g8_efm60_lr17"]])
    validate(cfg)
    assert cfg.cluster.count == 4 and cfg.sync.error_feedback_decay == 0.6


