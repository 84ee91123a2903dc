"""The `edit-train` and `edit-train-info` command lines: a real run, one-line user errors, sizing."""

from __future__ import annotations

import json
import math
import re
import sys
from types import SimpleNamespace

import pytest

from conftest import read_events, run_cli, tiny_overrides
from words import retired_in_run

TRAIN = ("edit-train", "edit_train.cli.train")

TRAIN_KEYS = {"step", "cluster_index", "cluster", "loss", "lr", "tokens", "tokens_per_s", "wall"}
EVAL_KEYS = {"step", "val_loss", "val_ppl"}
MOE_KEYS = {"step", "expert_load", "aux_loss", "z_loss"}
SUMMARY_KEYS = {"algo", "completed", "steps", "tokens", "wall_s", "tokens_per_s", "final_val_loss",
                "cross_cluster_bytes", "syncs", "anomalies", "blocked_s", "per_cluster"}


def assert_one_line_error(proc, *must_name: str) -> str:
    """Exit code 2, stderr exactly one `error: ...` line naming every string given, no traceback."""
    assert proc.returncode == 2, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    # the thread budget's warning depends on what else trains on this host, not on the command under test
    lines = [ln for ln in proc.stderr.strip().splitlines() if "host oversubscribed" not in ln]
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{proc.stderr}"
    line = lines[0]
    assert line.startswith("error:"), line
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    for name in must_name:
        assert name in line, f"{name!r} not named in: {line}"
    return line


def test_train_runs_on_default_stdlib_corpus(tmp_path):
    """The user path end to end: default `data=stdlib` (prepared into the test cache), one process."""
    run_dir = tmp_path / "run"
    proc = run_cli(*TRAIN, tiny_overrides(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    done = [line for line in proc.stdout.splitlines() if line.startswith("done:")]
    assert len(done) == 1, proc.stdout
    assert str(run_dir) in done[0]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys(), SUMMARY_KEYS - summary.keys()
    assert summary["completed"] is True
    assert summary["algo"] == "ddp"
    assert summary["steps"] == 6
    assert summary["tokens"] == 6 * 2 * 32
    assert math.isfinite(summary["final_val_loss"])
    assert summary["cross_cluster_bytes"] == 0 and summary["syncs"] == 0 and summary["anomalies"] == 0
    assert set(summary["per_cluster"]) == {"c0"}
    assert retired_in_run(run_dir) == []  # one word per concept (tests/docs/test_words.py)

    events = read_events(run_dir / "metrics.jsonl")
    kinds = {e["event"] for e in events}
    assert {"train", "eval", "moe"} <= kinds
    for e in events:
        want = {"train": TRAIN_KEYS, "eval": EVAL_KEYS, "moe": MOE_KEYS}.get(e["event"], set())
        assert want <= e.keys(), (e, want - e.keys())
    assert [e["step"] for e in events if e["event"] == "train"] == [2, 4, 6]

    ckpt = run_dir / "checkpoints" / "step_00000006"
    assert (ckpt / "manifest.json").is_file()
    assert (ckpt / "rank0-model.safetensors").is_file()


@pytest.mark.parametrize("override,key", [("train.nope=1", "train.nope"), ("train.steps=abc", "train.steps")])
def test_bad_override_is_one_line(tmp_path, monkeypatch, capsys, override, key):
    """Overrides Hydra rejects fail before anything runs. In-process (`main()` with this argv, as the
    console script calls it) to spare a torch import; the subprocess tests below cover the Hydra path."""
    from edit_train.cli.train import main

    monkeypatch.setattr(sys, "argv", ["edit-train", *tiny_overrides(tmp_path / "run"), override])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    assert_one_line_error(SimpleNamespace(returncode=exc.value.code, stdout=out.out, stderr=out.err), key)
    assert not (tmp_path / "run").exists()


def test_inconsistent_config_is_one_line(tmp_path):
    proc = run_cli(*TRAIN, [*tiny_overrides(tmp_path / "run"), "cluster.count=2", "cluster.slowdown=[1,2,3]"])
    assert_one_line_error(proc, "cluster.slowdown")
    assert not (tmp_path / "run").exists()  # checked before Hydra creates run.dir


def test_bad_data_source_is_one_line(tmp_path):
    source = "/nonexistent/*.txt"
    proc = run_cli(*TRAIN, tiny_overrides(tmp_path / "run", source))
    assert_one_line_error(proc, source)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "summary.json").exists()
    assert not (tmp_path / "run").exists()  # a failed check leaves no empty run directory


@pytest.mark.parametrize("how", ["--config-dir", "hydra.searchpath"])
def test_user_config_dir_adds_options(tmp_path, how):
    """docs/configuration.md (linked from the README's "Configure"): a directory of the user's own configs (laid out like conf/) on Hydra's search
    path adds options to the groups; one may start from a shipped option. Through the console script, run
    from outside the repository."""
    mine = tmp_path / "my-conf"
    (mine / "algo").mkdir(parents=True)
    (mine / "algo" / "my_edit.yaml").write_text("defaults:\n  - edit\n  - _self_\ninterval: 8\n")
    where = ["--config-dir", str(mine)] if how == "--config-dir" else [f"hydra.searchpath=[file://{mine}]"]
    proc = run_cli(*TRAIN, [*where, "algo=my_edit", "--cfg", "job"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    algo = re.search(r"^algo:\n((?:  .*\n)+)", proc.stdout, re.M)
    assert algo, proc.stdout
    assert re.search(r"^  name: edit$", algo[1], re.M) and re.search(r"^  interval: 8$", algo[1], re.M), algo[1]
    assert re.search(r"^    nesterov: true$", algo[1], re.M), algo[1]  # the rest of the shipped edit.yaml too
    assert not (tmp_path / "runs").exists()


def _check_info(stdout: str, model: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, stdout
    info = json.loads(lines[0])
    total, active = info["total_params"], info["active_params"]
    assert isinstance(total, int) and isinstance(active, int)
    assert 0 < active < total
    assert info["model"] == model
    return info


@pytest.mark.parametrize("model,lo,hi", [
    ("ling_lite", 15e9, 18e9),  # 16.8B total / 2.75B active
    ("ling_plus", 2.5e11, 3.2e11),  # 290B total / 29B active
    ("tiny", 1e6, 3e6),
])
def test_info_prints_param_counts(monkeypatch, capsys, model, lo, hi):
    """`edit-train-info model=...` (its `main()` with this argv, as the console script calls it)."""
    from edit_train.cli.info import main

    monkeypatch.setattr(sys, "argv", ["edit-train-info", f"model={model}"])
    main()
    info = _check_info(capsys.readouterr().out, model)
    assert lo < info["total_params"] < hi


def test_info_bad_override_is_one_line(capsys):
    from edit_train.cli.info import main

    with pytest.raises(SystemExit) as exc:
        main(["model=ling_lite", "model.num_experts=abc"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "num_experts" in err[0], err


def test_n_equal_clusters_from_the_default_config() -> None:
    """`edit-train cluster.count=3 cluster.ranks=1` (as the README says): the default preset's
    two-entry slowdown does not carry over; an explicit slowdown still has to match."""
    from edit_train.cli.common import compose
    from edit_train.config import ConfigError, cluster_specs, validate

    cfg = compose(["cluster.count=3", "cluster.ranks=1"])
    validate(cfg)
    assert [(s.name, s.ranks, s.slowdown) for s in cluster_specs(cfg)] == [("c0", 1, 1.0), ("c1", 1, 1.0), ("c2", 1, 1.0)]
    with pytest.raises(ConfigError, match="cluster.slowdown"):
        validate(compose(["cluster.count=3", "cluster.slowdown=[1,3]"]))
    out = run_cli("edit-train", "edit_train.cli.train", ["cluster.count=3", "cluster.ranks=1", "--cfg", "job"])
    assert out.returncode == 0, out.stderr
    assert "count: 3" in out.stdout and "slowdown: []" in out.stdout
