"""The first five minutes (issue 11): every papercut a new user hit, one test each.

Most run `main()` in process with the argv a console script would get (the checks fail before Hydra runs or
any torch work starts); the ones that need a real process (Hydra's run directory, torchrun, a signal, a wheel
installed outside the repository) start one."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import cli_env, run_cli, tiny_overrides
from test_cli import TRAIN, assert_one_line_error

REPO = Path(__file__).resolve().parents[2]


def _main(monkeypatch, capsys, *argv: str) -> SimpleNamespace:
    """`edit-train ARGV` in process; returncode 0 when main() returns."""
    from edit_train.cli.train import main

    monkeypatch.setattr(sys, "argv", ["edit-train", *argv])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


# 1 ---------------------------------------------------------------------------------------------------------
def test_text_data_without_source_is_refused(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    line = assert_one_line_error(_main(monkeypatch, capsys, *tiny_overrides(run_dir), "data=text"), "data.source")
    assert "data=text" in line
    assert not run_dir.exists()


def test_text_data_with_source_and_stdlib_default_still_compose():
    from edit_train.cli.common import compose

    assert compose([]).data.source == "stdlib"
    assert compose(["data=text", "data.source=/corpus/*.txt"]).data.source == "/corpus/*.txt"


# 2 ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # the default suite's 20-minute budget: a multi-process run covered in part by faster tests
def test_wheel_install_works_outside_the_repo(tmp_path):
    """A non-editable install (a wheel, in a fresh venv) finds its config tree: `edit-train --cfg job` from a
    directory outside the repository prints the composed config."""
    from packaging.version import Version

    setuptools = pytest.importorskip("setuptools")  # --no-build-isolation: the build backend must be here
    if Version(setuptools.__version__) < Version("70.1"):
        pytest.importorskip("wheel")
    src = tmp_path / "src"  # build from a copy: the build leaves build/ and *.egg-info behind
    for tree in ("edit_train", "conf"):  # the config tree is the top-level conf/, mapped to edit_train.conf
        shutil.copytree(REPO / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    env = {k: v for k, v in cli_env().items() if k != "PYTHONPATH"}
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, env=env, cwd=tmp_path, capture_output=True, timeout=120)
    (wheel,) = wheels.glob("edit_train-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--force-reinstall", str(wheel)], check=True, env=env, capture_output=True, timeout=120)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import edit_train; print(edit_train.__file__)"],
                           capture_output=True, text=True, env=env, cwd=elsewhere, check=True)
    assert where.stdout.strip().startswith(str(venv)), where.stdout  # the wheel, not the repository
    # the wheel's own config tree, not the checkout's conf/ (which an editable install, visible through
    # --system-site-packages, maps to edit_train.conf as well)
    conf = subprocess.run([str(venv / "bin" / "python"), "-c", "from edit_train.cli.common import CONF_DIR; "
                           "print(CONF_DIR)"], capture_output=True, text=True, env=env, cwd=elsewhere, check=True)
    conf_dir = Path(conf.stdout.strip())
    assert conf_dir.is_relative_to(venv) and (conf_dir / "config.yaml").is_file(), conf_dir
    proc = subprocess.run([str(venv / "bin" / "edit-train"), "--cfg", "job", "model=small", "algo=edit"],
                          capture_output=True, text=True, env=env, cwd=elsewhere, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Primary config directory not found" not in proc.stderr
    assert re.search(r"^algo:\n  name: edit$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^model:\n  vocab_size: 1024\n  hidden_size: 256$", proc.stdout, re.M), proc.stdout  # small
    assert re.search(r"^data:\n  source: stdlib$", proc.stdout, re.M), proc.stdout
    assert not (elsewhere / "runs").exists()


def test_every_subpackage_ships():
    """pyproject.toml lists the packages (discovery cannot map the top-level conf/ to edit_train.conf): every
    package under edit_train/ is listed, and the config tree is the package edit_train.conf, from conf/."""
    from setuptools import find_packages

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(str(REPO), include=["edit_train", "edit_train.*"]))
    assert set(tool["packages"]) == found | {"edit_train.conf"}, "update [tool.setuptools] packages"
    assert tool["package-dir"] == {"edit_train.conf": "conf"}
    assert (REPO / "conf" / "__init__.py").is_file() and (REPO / "conf" / "config.yaml").is_file()
    assert not (REPO / "edit_train" / "conf").exists()  # a leftover would shadow the mapped package


# 3 ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_info_help_prints_usage(capsys, flag):
    from edit_train.cli.info import main

    main([flag])  # returns: exit code 0
    out = capsys.readouterr()
    assert out.out.startswith("usage: edit-train-info") and "total_params" in out.out
    assert out.err == ""


# 4 ---------------------------------------------------------------------------------------------------------
def _fake_checkpoint(run_dir: Path, step: int, complete: bool) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    if complete:
        (path / "manifest.json").write_text("{}")
    return path


def test_interrupt_message_says_whether_a_checkpoint_exists(tmp_path):
    from edit_train.cli.checks import interrupted_message

    run_dir = tmp_path / "run"
    for msg in (interrupted_message(run_dir, 4), interrupted_message(tmp_path / "never-created")):
        assert "before the first checkpoint" in msg and "nothing to resume" in msg and "intact" not in msg
    _fake_checkpoint(run_dir, 8, complete=False)  # a half-written one does not count
    assert "before the first checkpoint" in interrupted_message(run_dir)
    # checkpoint.every was set (an A-EDiT run used to ignore it): the message does not tell the user to set it
    msg = interrupted_message(run_dir, every=50)
    assert "checkpoint.every=50" in msg and "before the first was written" in msg and "set checkpoint" not in msg
    assert "set checkpoint.every=N" in interrupted_message(run_dir, every=0)
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"checkpoint": {"every": 7}}))  # what the run wrote
    assert "checkpoint.every=7 saves" in interrupted_message(run_dir)
    good = _fake_checkpoint(run_dir, 4, complete=True)
    msg = interrupted_message(run_dir, 4)
    assert f"{good} is intact" in msg and "all 4 processes stopped" in msg and "resume=auto" in msg


def test_ctrl_c_before_the_first_checkpoint(tmp_path, small_corpus):
    """One process, no checkpoints (checkpoint.at_end=false: under the default a Ctrl-C saves one, see
    test_interrupt_checkpoint.py): SIGINT mid-run says there is nothing to resume from."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "edit_train.cli.train",
           *tiny_overrides(run_dir, small_corpus, "train.steps=100000", "train.eval_every=0",
                           "checkpoint.at_end=false")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        metrics = run_dir / "metrics.jsonl"
        while time.time() < deadline and '"event":"train"' not in (metrics.read_text() if metrics.exists() else ""):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        assert time.time() < deadline, "no train event appeared"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: interrupted") and "before the first checkpoint" in last, err
    assert "intact" not in err
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


# 5 ---------------------------------------------------------------------------------------------------------
def test_run_dir_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    assert_one_line_error(_main(monkeypatch, capsys, *tiny_overrides(afile)), str(afile), "run.dir")
    below = afile / "run"
    assert_one_line_error(_main(monkeypatch, capsys, *tiny_overrides(below)), str(afile), "run.dir")
    assert afile.read_text() == "not a directory"


# 6 ---------------------------------------------------------------------------------------------------------
def _wordlevel(path: Path, vocab_size: int) -> Path:
    from test_data import build_wordlevel

    return build_wordlevel(path, vocab_size)


def test_vocab_size_follows_the_tokenizer_unless_set(tmp_path):
    from edit_train.cli.checks import adopt_tokenizer_vocab, explicit_override
    from edit_train.cli.common import compose

    tok = _wordlevel(tmp_path / "tokenizer.json", 500)
    cfg = compose([f"data.tokenizer={tok}"])
    assert cfg.model.vocab_size == 320
    adopt_tokenizer_vocab(cfg, explicit=False)
    assert cfg.model.vocab_size == 500  # raised to the tokenizer's vocabulary

    argv = [f"data.tokenizer={tok}", "model.vocab_size=400"]
    assert explicit_override(argv, "model.vocab_size") and explicit_override(["++model.vocab_size=1"],
                                                                              "model.vocab_size")
    cfg = compose(argv)
    adopt_tokenizer_vocab(cfg, explicit_override(argv, "model.vocab_size"))
    assert cfg.model.vocab_size == 400  # explicit: kept (the trainer then says it is too small)

    cfg = compose([])  # byte tokenizer (257) under the preset's 320: nothing changes
    adopt_tokenizer_vocab(cfg, explicit=False)
    assert cfg.model.vocab_size == 320


def test_vocab_size_follows_the_tokenizer_in_a_run(tmp_path, small_corpus):
    tok = _wordlevel(tmp_path / "tokenizer.json", 500)
    run_dir = tmp_path / "run"
    proc = run_cli(*TRAIN, tiny_overrides(run_dir, small_corpus, "data=text", f"data.tokenizer={tok}",
                                          "train.steps=2", "train.eval_every=0", "checkpoint.at_end=false"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run_dir / "config.json").read_text())["model"]["vocab_size"] == 500
    readme = (REPO / "README.md").read_text()
    recipe = readme[readme.index("Your own corpus"):][:800]
    assert "model.vocab_size" in recipe and "follows" in recipe


# 7 ---------------------------------------------------------------------------------------------------------
def test_prepare_warms_the_cache_edit_train_reads(tmp_path, small_corpus, capsys):
    from edit_train.cli.common import compose
    from edit_train.cli.prepare import build_parser
    from edit_train.cli.prepare import main as prepare
    from edit_train.config import DataConfig
    from edit_train.data import dataset_key

    defaults = build_parser().parse_args([])
    cfg = compose(["data=text", f"data.source={small_corpus}", f"data.cache_dir={tmp_path}"])
    assert defaults.val_fraction == cfg.data.val_fraction == DataConfig().val_fraction
    assert defaults.seed == cfg.data.seed and defaults.tokenizer == cfg.data.tokenizer

    assert prepare([small_corpus, "--cache-dir", str(tmp_path), "--quiet"]) == 0
    prepared = capsys.readouterr().out.split(":", 1)[0]
    # the directory the trainer's ensure_dataset(cfg.data...) resolves to
    trainer_dir = tmp_path / "data" / dataset_key(cfg.data.source, cfg.data.tokenizer, cfg.data.val_fraction,
                                                  cfg.data.seed)
    assert Path(prepared) == trainer_dir and (trainer_dir / "meta.json").is_file()
    assert [p.name for p in (tmp_path / "data").iterdir()] == [trainer_dir.name]


# 8 ---------------------------------------------------------------------------------------------------------
def test_finished_run_dir_is_refused_without_resume(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"event": "eval", "step": 6, "val_loss": 2.0}\n')
    (run_dir / "summary.json").write_text('{"completed": true}')
    line = assert_one_line_error(_main(monkeypatch, capsys, *tiny_overrides(run_dir)), str(run_dir),
                                 "resume=auto", "new run.dir")
    assert "finished run" in line
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1  # nothing appended


def test_run_dir_rules(tmp_path, monkeypatch):
    from edit_train.cli.checks import RunDirError, check_run_dir

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    fresh, empty, crashed = tmp_path / "fresh", tmp_path / "empty", tmp_path / "crashed"
    check_run_dir(fresh, "false")
    empty.mkdir()
    (empty / "checkpoints").mkdir()  # an empty checkpoints folder holds nothing
    (empty / "job.log").write_text("benchmarks write their log first")
    check_run_dir(empty, "false")
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError, match="an unfinished run"):
        check_run_dir(crashed, "false")
    check_run_dir(crashed, "auto")  # resume continues it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    check_run_dir(crashed, "false")  # a restarted worker resumes by itself


@pytest.mark.parametrize("run_dir", ["runs/20261123-133500", "/tmp/x y/run", "runs/a:b~c+d", "a=b,c"])
def test_run_dir_pin_round_trips(run_dir):
    """The default run.dir holds ${now:}; the directory the precheck checked is pinned for Hydra's own compose."""
    from edit_train.cli.checks import _pin
    from edit_train.cli.common import compose

    assert compose([_pin(run_dir)]).run.dir == run_dir


# 9 ---------------------------------------------------------------------------------------------------------
def test_readme_links_stay_inside_the_repo():
    readme = (REPO / "README.md").read_text()
    assert "../shared" not in readme and "DESIGN.md" not in readme
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert "docs/architecture.md" in local
    for link in local:
        assert not link.startswith(("../", "/")), link
        assert (REPO / link).exists(), f"README links to {link}, which is not in the repository"
    design = (REPO / "docs" / "architecture.md").read_text()
    assert re.search(r"^## 4\.", design, re.M) and re.search(r"^## 5\.", design, re.M)


# 10 --------------------------------------------------------------------------------------------------------
def test_help_page_is_ours(monkeypatch, capsys):
    from edit_train.cli.common import CONF_DIR
    from edit_train.cli.help import GROUPS, KEYS

    proc = _main(monkeypatch, capsys, "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    page = proc.stdout
    assert page.startswith("edit-train: ") and "powered by Hydra" not in page
    assert "schema" not in page
    groups = sorted(p.name for p in Path(CONF_DIR).iterdir()
                    if p.is_dir() and p.name != "hydra" and not p.name.startswith(("_", ".")))  # __pycache__
    assert sorted(GROUPS) == groups  # every group of the shipped tree has its line
    for group in groups:
        line = next(i for i, text in enumerate(page.splitlines()) if text.strip().startswith(f"{group}="))
        options = page.splitlines()[line + 1]
        for yaml in Path(CONF_DIR, group).glob("*.yaml"):
            assert re.search(rf"\b{yaml.stem}\b", options), (group, yaml.stem, options)
    assert "tiny*" in page  # the default is marked
    assert len(KEYS) == 5 and all(key.split("=")[0] in page for key, _ in KEYS)
    assert "--cfg job" in page and "README" in page
    assert _main(monkeypatch, capsys, "-h").stdout == page


@pytest.mark.parametrize("group", ["algo", "model", "data", "cluster", "logger"])
def test_schema_is_not_a_choice(tmp_path, monkeypatch, capsys, group):
    line = assert_one_line_error(_main(monkeypatch, capsys, *tiny_overrides(tmp_path / "run"), f"{group}=schema"),
                                 f"{group}=schema")
    assert "choose one of" in line and not (tmp_path / "run").exists()


# 11 --------------------------------------------------------------------------------------------------------
def test_config_error_is_said_by_rank_0_only(monkeypatch, capsys):
    from edit_train.cli.checks import fail_user_error
    from edit_train.config import ConfigError
    from edit_train.data import DataError

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exc:
        fail_user_error(ConfigError("cluster.count: bad"))
    assert exc.value.code == 2 and capsys.readouterr().err == ""  # quiet, same code
    with pytest.raises(SystemExit):
        fail_user_error(DataError("shard gone"))  # may be this rank's own: it is said, with the rank
    assert capsys.readouterr().err.strip() == "error: rank 1: shard gone"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as exc:
        fail_user_error(ConfigError("cluster.count: bad"))
    assert exc.value.code == 2 and capsys.readouterr().err.strip() == "error: cluster.count: bad"


def test_topology_error_under_torchrun_is_one_line_once(tmp_path, small_corpus):
    """Two torchrun workers for a cluster configured with three ranks: rank 0 says it once; no run dir is left.
    (torchrun's own ChildFailedError summary, printed by the torchrun process, is outside our code.)"""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "edit_train.cli.train", *tiny_overrides(run_dir, small_corpus, "cluster.ranks=3")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=tmp_path, timeout=180)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(ours) == 1, proc.stderr
    assert "configured with 3 rank(s) but its job has 2 process(es)" in ours[0], ours
    assert "[rank1]" not in proc.stderr and "[rank0]" not in proc.stderr  # no worker traceback
    assert not run_dir.exists()


# 12 --------------------------------------------------------------------------------------------------------
def test_failure_after_hydra_made_the_run_dir_removes_it(tmp_path):
    """An empty corpus directory passes the precheck and fails in the trainer, after Hydra created run.dir."""
    empty = tmp_path / "empty-corpus"
    empty.mkdir()
    run_dir = tmp_path / "runs" / "run"
    proc = run_cli(*TRAIN, tiny_overrides(run_dir, str(empty)))
    assert_one_line_error(proc, str(empty))
    assert not run_dir.exists() and (tmp_path / "runs").is_dir()  # only what this run created is removed


def test_failed_run_keeps_a_directory_that_existed(tmp_path):
    from edit_train.cli.checks import RunDirGuard

    existing, created = tmp_path / "existing", tmp_path / "created"
    existing.mkdir()
    guard_existing, guard_created = RunDirGuard.before(existing), RunDirGuard.before(created)
    created.mkdir()
    (created / "launch_config.json").write_text("{}")  # launcher scaffolding only
    assert not guard_existing.cleanup() and existing.is_dir()
    assert guard_created.cleanup() and not created.exists()
    created.mkdir()
    (created / "metrics.jsonl").write_text("{}\n")  # something of value: kept
    assert not guard_created.cleanup() and created.is_dir()


# 13 --------------------------------------------------------------------------------------------------------
def test_unknown_model_lists_the_models(tmp_path, monkeypatch, capsys):
    line = assert_one_line_error(_main(monkeypatch, capsys, *tiny_overrides(tmp_path / "run"), "model=nonexistent"),
                                 "model=nonexistent", "tiny", "small", "ling_lite", "ling_plus")
    assert "schema" not in line


def test_report_does_not_call_an_interrupted_runs_step0_loss_final(tmp_path):
    from edit_train.report import load_run, table_rows

    run = tmp_path / "interrupted"
    run.mkdir()
    events = [{"event": "eval", "step": 0, "val_loss": 6.1, "val_ppl": 445.0, "tokens": 0, "wall": 0.5},
              {"event": "train", "step": 10, "cluster_index": 0, "loss": 4.0, "lr": 1e-3, "tokens": 640,
               "tokens_per_s": 100.0, "wall": 6.9}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (row,) = table_rows([load_run(run)])
    assert row["final val loss"] == "6.100 (last eval, step 0)"
    assert row["run"] == "interrupted (incomplete)"


# 14 --------------------------------------------------------------------------------------------------------
def test_torch_range_admits_the_current_release():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    import torch

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = SpecifierSet(next(d for d in deps if d.startswith("torch")).removeprefix("torch"))
    assert Version(torch.__version__.split("+")[0]) in spec  # what the tests run on here
    assert Version("2.15.0") in spec and Version("2.6.0") in spec and Version("2.16.0") not in spec
