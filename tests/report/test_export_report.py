"""Issue 22 (2, 3): `edit-train-export RUN_DIR` on a multi-cluster run (checkpoints/<cluster>/…) exports the
clusters' common final anchor with a tokenizer; `edit-train-report` takes a sweep folder and skips what a glob
over it picks up beside the runs.

One real sweep (two jobs, each two one-rank clusters with EDiT) is made once per session by `tiny_sweep` and
shared with tests/docs/test_readme.py, which runs the README's own export and report commands on it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import cli_env, script_cmd
from edit_train.model.hf import normalized_head

SWEEP_OVERRIDES = ["model=tiny", "logger=none", "train.progress=false", "train.seq_len=32", "train.batch_size=2",
                   "train.eval_every=0", "train.eval_batches=1", "train.steps=8", "cluster=local", "cluster.count=2",
                   "algo=edit", "algo.interval=4"]
SWEEP = "cluster.count=2,1"  # job 0: two one-rank clusters (checkpoints/<cluster>/…); job 1: one (checkpoints/…)
_SWEEPS: dict[str, Path] = {}  # one sweep per session, whichever test module asks first


def tiny_sweep(tmp_path_factory: pytest.TempPathFactory, corpus: str) -> Path:
    """`edit-train -m … cluster.count=2,1` run in a fresh directory with the shipped hydra.sweep.dir, so it writes
    `runs/multirun-<timestamp>/{0,1,multirun.yaml}` exactly as a user's sweep does. Returns the sweep folder."""
    key = str(tmp_path_factory.getbasetemp())
    if key in _SWEEPS:
        return _SWEEPS[key]
    base = tmp_path_factory.mktemp("sweep")
    proc = subprocess.run([*script_cmd("edit-train", "edit_train.cli.train"), "-m", *SWEEP_OVERRIDES,
                           f"data.source={corpus}", SWEEP],
                          cwd=base, env=cli_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    found = glob.glob(str(base / "runs" / "multirun-*"))
    assert len(found) == 1, found
    sweep = Path(found[0])
    for cluster in ("c0", "c1"):
        assert (sweep / "0" / "checkpoints" / cluster / "step_00000008" / "manifest.json").is_file()
    assert (sweep / "1" / "checkpoints" / "step_00000008" / "manifest.json").is_file()
    assert (sweep / "multirun.yaml").is_file()
    _SWEEPS[key] = sweep
    return sweep


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, small_corpus) -> Path:
    return tiny_sweep(tmp_path_factory, small_corpus)


def export(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*script_cmd("edit-train-export", "edit_train.cli.export"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=cli_env())


def hf_params(out: Path):
    """Our parameter names -> tensors of an exported directory."""
    from edit_train.model.hf import file_layout, from_hf_state_dict, read_hf_config
    from edit_train.model.hf_io import read_hf_weights

    cfg, raw = read_hf_config(out)
    return from_hf_state_dict(read_hf_weights(out)[0], file_layout(cfg, raw)), cfg


def rewrite(step_dir: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Replace a checkpoint file and refresh its manifest entry (a consistent checkpoint, different content)."""
    path = step_dir / name
    save_file(tensors, str(path))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": path.stat().st_size,
                               "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


# ------------------------------------------------------------------------------------------- export
def test_export_run_dir_takes_the_common_final_anchor(sweep, tmp_path):
    """The issue's failing command: a multi-cluster run directory. The export is the anchor every cluster
    holds after the final sync (equal to each cluster's replica here), with a tokenizer a HF user loads."""
    from tokenizers import Tokenizer

    from edit_train.train.checkpoint_reader import open_cluster

    run = sweep / "0"
    out = tmp_path / "hf"
    proc = export(run, "--out", out)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    for part in ("the common final anchor of clusters c0, c1 (identical in both)", "step 8",
                 f"{run}/checkpoints/{{c0,c1}}/step_00000008", str(out), "1,757,312 params",
                 "files: config.json, configuration_edit_train.py, generation_config.json, model.safetensors, "
                 "modeling_edit_train.py, tokenizer.json, tokenizer_config.json"):
        assert part in line, (part, line)

    exported, cfg = hf_params(out)
    for cluster in ("c0", "c1"):
        ck = open_cluster(run / "checkpoints" / cluster / "step_00000008")
        assert ck.anchor is not None and ck.model_cfg == cfg
        for name, t in ck.anchor.items():
            served = normalized_head(t) if name == "lm_head.weight" and cfg.norm_head else t  # served encoding
            assert torch.equal(exported[name], served), (cluster, name)
            assert torch.equal(ck.replica[name], t), (cluster, name)  # after the final sync: replica = anchor

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "def f(x):\n    return 'héllo ☃'\t# \x00\x7f"
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))  # the byte tokenizer the model was trained with
    assert tok.decode(ids) == text
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert eos == 256 == tok.token_to_id("<|endoftext|>")
    conf = json.loads((out / "tokenizer_config.json").read_text())
    assert conf["tokenizer_class"] == "PreTrainedTokenizerFast" and conf["eos_token"] == "<|endoftext|>"



def call_export(capsys, *args) -> tuple[int, list[str], list[str]]:
    """`edit-train-export ARGS` in this process: (exit code, stdout lines, stderr lines)."""
    from edit_train.cli.export import main

    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    cap = capsys.readouterr()
    return code, cap.out.strip().splitlines(), cap.err.strip().splitlines()


def test_export_positional_default_out_and_single_cluster(sweep, tmp_path, capsys):
    run = sweep / "0"
    code, out, err = call_export(capsys, run, tmp_path / "hf_positional")  # the positional form
    assert code == 0 and "common final anchor of clusters c0, c1" in out[0], err
    copy = tmp_path / "run_copy"  # no output directory: RUN_DIR/hf (on a copy: the sweep is shared)
    copy.mkdir()
    (copy / "checkpoints").symlink_to(run / "checkpoints")
    code, out, err = call_export(capsys, copy)
    assert code == 0 and f"-> {copy}/hf:" in out[0], err
    assert load_file(str(copy / "hf" / "model.safetensors")).keys() == \
        load_file(str(tmp_path / "hf_positional" / "model.safetensors")).keys()
    code, out, err = call_export(capsys, run, tmp_path / "a", "--out", tmp_path / "b")
    assert code == 2 and err[0].startswith("error: two output directories"), err

    # a single-cluster run (checkpoints/step_NNNNNNNN): its replica, with the tokenizer too
    code, out, err = call_export(capsys, sweep / "1", "--out", tmp_path / "single")
    assert code == 0 and f"cluster c0's replica, step 8, from {sweep / '1'}/checkpoints/step_00000008" in out[0], err
    assert "tokenizer.json" in out[0]


def test_export_cluster_step_and_refusals(sweep, tmp_path, capsys):
    run = sweep / "0"

    def call(*args) -> tuple[int, list[str], list[str]]:
        return call_export(capsys, *args)

    code, out, _ = call(run, "--out", tmp_path / "c1", "--cluster", "c1", "--step", "8")
    assert code == 0 and len(out) == 1 and "cluster c1's replica, step 8" in out[0] and \
        f"{run}/checkpoints/c1/step_00000008" in out[0], out
    c1, _ = hf_params(tmp_path / "c1")
    code, out, _ = call(run / "checkpoints" / "c0", tmp_path / "c0")  # what used to be the only way
    assert code == 0 and "cluster c0's replica" in out[0], out
    c0, _ = hf_params(tmp_path / "c0")
    assert all(torch.equal(c0[n], c1[n]) for n in c0)

    for args, want in (
        (["--cluster", "c7"], "--cluster c7: no checkpoints of that cluster in"),
        (["--step", "4"], "--step 4: not a complete checkpoint of every cluster (complete steps: c0: 8; c1: 8)"),
        (["--group", "1"], "--group was retired: use --cluster c1"),
    ):
        code, out, err = call(run, "--out", tmp_path / "x", *args)
        assert code == 2 and out == [] and len(err) == 1 and err[0].startswith("error: " + want), err
    assert not (tmp_path / "x").exists()

    # clusters that did not end on one anchor: refused, naming --cluster
    diverged = tmp_path / "diverged"
    shutil.copytree(run / "checkpoints", diverged / "checkpoints")
    step_dir = diverged / "checkpoints" / "c1" / "step_00000008"
    outer = load_file(str(step_dir / "rank0-outer.safetensors"))
    outer["layers.0/anchor/1"] = outer["layers.0/anchor/1"] + 1e-3
    rewrite(step_dir, "rank0-outer.safetensors", outer)
    code, out, err = call(diverged, "--out", tmp_path / "x")
    assert code == 2 and len(err) == 1, err
    assert "clusters c0 and c1 hold different anchors at step 8" in err[0] and "--cluster NAME" in err[0], err
    code, out, _ = call(diverged, "--out", tmp_path / "x", "--cluster", "c0")
    assert code == 0, out

    # no step every cluster completed
    (diverged / "checkpoints" / "c1" / "step_00000008").rename(diverged / "checkpoints" / "c1" / "step_00000004")
    code, out, err = call(diverged, "--out", tmp_path / "y")
    assert code == 2 and "no complete checkpoint step in common (complete steps: c0: 8; c1: 4)" in err[0], err


def test_anchor_names_follow_the_sync_units():
    """export's anchor key -> parameter map is the one the outer state is written with."""
    import dataclasses

    from edit_train.train.checkpoint_reader import anchor_names
    from edit_train.cluster.mesh import fsdp_units
    from edit_train.local_sgd.sync.round import build_units
    from edit_train.model import CausalLM, load_preset

    for tied in (False, True):
        cfg = dataclasses.replace(load_preset("tiny"), tie_word_embeddings=tied)
        model = CausalLM(cfg)
        names = {id(p): n for n, p in model.named_parameters()}
        want = {f"{u.name}/anchor/{i}": names[id(p)]
                for u in build_units(model, fsdp_units(model)) for i, p in enumerate(u.params)}
        assert anchor_names(cfg) == want


# ------------------------------------------------------------------------------------------- report
def report(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*script_cmd("edit-train-report", "edit_train.cli.report"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=cli_env(), cwd=cwd)


def test_report_takes_a_sweep_folder_and_skips_what_is_not_a_run(sweep, tmp_path):
    from edit_train.cli.report import main

    # a sweep folder beside the real one, with a job that never started
    folder = tmp_path / "multirun-x"
    folder.mkdir()
    shutil.copyfile(sweep / "multirun.yaml", folder / "multirun.yaml")
    for job in ("0", "1"):
        (folder / job).symlink_to(sweep / job)
    (folder / "2").mkdir()

    proc = report(folder)  # the sweep folder itself: report goes to FOLDER/report
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [f"skipping {folder / '2'}: not a run directory (no metrics.jsonl)",
                                        f"skipping {folder / 'multirun.yaml'}: not a run directory (a file)"]
    cells = [[c.strip() for c in line.split("|")[1:3]] for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [c for c in cells if c[1] == "edit"] == [["0", "edit"], ["1", "edit"]], proc.stdout
    assert (folder / "report" / "summary.md").is_file() and f"report: {folder / 'report'}" in proc.stdout

    # a glob over it (what the shell makes of FOLDER/*): the report folder written above is skipped as well
    matches = sorted(glob.glob(str(folder / "*")))
    proc = report(*matches, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stderr.splitlines()) == sorted(
        f"skipping {folder / n}: not a run directory ({why})"
        for n, why in (("2", "no metrics.jsonl"), ("multirun.yaml", "a file"), ("report", "no metrics.jsonl")))
    assert (tmp_path / "out" / "summary.md").read_text().count("| edit |") == 2

    # nothing is a run: one error line, nothing written
    with pytest.raises(SystemExit) as exc:
        main([str(folder / "multirun.yaml"), str(folder / "2"), "--out", str(tmp_path / "none")])
    assert exc.value.code == 2 and not (tmp_path / "none").exists()
