"""The training loop, in process: learning, the metrics.jsonl contract, exact resume, W&B offline,
bf16 autocast and gradient accumulation. Every run is the tiny model on a ~500 KB corpus."""

from __future__ import annotations

import glob
import json
import logging
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_events, run_train, tiny_overrides

pytestmark = pytest.mark.usefixtures("torch_one_thread")

# model=tiny: 4 layers, the first dense, 8 routed experts, top-2.
MOE_LAYERS, NUM_EXPERTS, TOP_K = 3, 8, 2
BATCH, SEQ = 2, 32
TOKENS_PER_STEP = BATCH * SEQ

TRAIN_KEYS = {"step", "cluster_index", "cluster", "loss", "lr", "tokens", "tokens_per_s", "wall"}
EVAL_KEYS = {"step", "val_loss", "val_ppl"}
MOE_KEYS = {"step", "expert_load", "aux_loss", "z_loss"}
SUMMARY_KEYS = {"algo", "completed", "steps", "tokens", "wall_s", "tokens_per_s", "final_val_loss",
                "cross_cluster_bytes", "syncs", "anomalies", "blocked_s", "per_cluster"}


def is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def ckpt_file(run_dir: Path, step: int, part: str) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}" / f"rank0-{part}.safetensors"


# ---------------------------------------------------------------------------------------- one 40-step run
@pytest.fixture(scope="module")
def run40(tmp_path_factory, small_corpus, torch_one_thread):
    run_dir = tmp_path_factory.mktemp("run40")
    summary = run_train(tiny_overrides(run_dir, small_corpus, "train.steps=40", "train.eval_every=20",
                                       "train.log_every=10"))
    return run_dir, summary


def test_loss_goes_down(run40):
    run_dir, summary = run40
    init, final = summary["initial_val_loss"], summary["final_val_loss"]
    assert is_num(init) and is_num(final)
    assert init > 5.0  # ~ln(320) for an untrained byte-level model (vocab 320)
    assert final < init - 1.0, (init, final)
    evals = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 20, 40]
    assert evals[0]["val_loss"] == pytest.approx(init) and evals[-1]["val_loss"] == pytest.approx(final)


def test_summary_contract(run40):
    run_dir, summary = run40
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= on_disk.keys(), SUMMARY_KEYS - on_disk.keys()
    assert on_disk["completed"] is True
    assert on_disk["steps"] == summary["steps"] == 40
    assert on_disk["tokens"] == 40 * TOKENS_PER_STEP
    assert on_disk["final_val_loss"] == pytest.approx(summary["final_val_loss"])
    for key in ("wall_s", "tokens_per_s", "final_val_loss", "blocked_s"):
        assert is_num(on_disk[key]), key
    assert on_disk["per_cluster"]["c0"]["steps"] == 40


def test_metrics_jsonl_contract(run40):
    run_dir, _ = run40
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    events = [json.loads(line) for line in text.splitlines()]  # every line is strict JSON
    assert all(isinstance(e, dict) and isinstance(e.get("event"), str) for e in events)
    by_kind: dict[str, list[dict]] = {}
    for e in events:
        by_kind.setdefault(e["event"], []).append(e)

    trains = by_kind["train"]
    assert [e["step"] for e in trains] == [10, 20, 30, 40]
    for e in trains:
        assert TRAIN_KEYS <= e.keys(), TRAIN_KEYS - e.keys()
        assert e["cluster_index"] == 0
        assert e["tokens"] == e["step"] * TOKENS_PER_STEP
        for key in ("loss", "lr", "tokens_per_s", "wall"):
            assert is_num(e[key]), (key, e)
        assert e["lr"] > 0 and e["tokens_per_s"] > 0
    walls = [e["wall"] for e in trains]
    assert walls == sorted(walls)

    for e in by_kind["eval"]:
        assert EVAL_KEYS <= e.keys()
        assert e["val_ppl"] == pytest.approx(math.exp(e["val_loss"]), rel=1e-6)

    moes = by_kind["moe"]
    assert [e["step"] for e in moes] == [10, 20, 30, 40]
    for e in moes:
        assert MOE_KEYS <= e.keys(), MOE_KEYS - e.keys()
        assert is_num(e["aux_loss"]) and e["aux_loss"] >= 0
        assert is_num(e["z_loss"]) and e["z_loss"] >= 0
        load = e["expert_load"]
        assert isinstance(load, list) and len(load) == MOE_LAYERS
        for layer in load:
            assert len(layer) == NUM_EXPERTS
            assert all(isinstance(n, int) and n >= 0 for n in layer), layer
            # every token of the logged step's micro-batch is routed to exactly k experts
            assert sum(layer) == TOKENS_PER_STEP * TOP_K, layer


def test_ddp_logs_routed_tokens_every_log_every_steps(run40):
    """Without local SGD an `experts` interval is `log_every` steps (issue 41): each event holds the tokens x k its
    10 steps routed per MoE layer."""
    events = [e for e in read_events(run40[0] / "metrics.jsonl") if e["event"] == "experts"]
    assert [(e["step"], e["steps"]) for e in events] == [(10, 10), (20, 10), (30, 10), (40, 10)]
    assert all(sum(row) == 10 * TOKENS_PER_STEP * TOP_K for e in events for row in e["counts"])


# ------------------------------------------------------------------------------------------------ resume
def test_resume_continues_and_is_bit_identical(tmp_path, small_corpus, caplog):
    """6 steps (checkpoint every 3) then resume=auto to 9 == 9 steps uninterrupted, bit for bit.

    lr_warmup_steps (30) > 9, so the LR of a step does not depend on train.steps and both runs see the
    same schedule. The uninterrupted run saves only at the end, so checkpointing itself is also shown not
    to perturb training."""
    common = ("train.log_every=1", "train.eval_every=3")
    full = tmp_path / "full"
    s_full = run_train(tiny_overrides(full, small_corpus, *common, "train.steps=9"))

    seg = tmp_path / "seg"
    s1 = run_train(tiny_overrides(seg, small_corpus, *common, "train.steps=6", "checkpoint.every=3"))
    assert s1["steps"] == 6
    assert sorted(p.name for p in (seg / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    n_first = len(read_events(seg / "metrics.jsonl"))

    with caplog.at_level(logging.INFO, logger="edit_train"):
        s2 = run_train(tiny_overrides(seg, small_corpus, *common, "train.steps=9", "checkpoint.every=3",
                                      "resume=auto"))
    assert any("resumed from" in r.getMessage() and "step_00000006" in r.getMessage() for r in caplog.records)
    assert s2["steps"] == 9 and s2["completed"] is True
    assert s2["tokens"] == 9 * TOKENS_PER_STEP  # token count carried over from the first segment

    second = read_events(seg / "metrics.jsonl")[n_first:]
    trains = [e for e in second if e["event"] == "train"]
    assert trains and trains[0]["step"] == 7 and [e["step"] for e in trains] == [7, 8, 9]
    assert all(e["step"] > 6 for e in second)  # no step-0 eval, nothing re-done
    assert trains[0]["tokens"] == 7 * TOKENS_PER_STEP

    # the same batches (loader + RNG state restored) -> the same weights and optimizer state, exactly
    assert s2["final_val_loss"] == s_full["final_val_loss"]
    for part in ("model", "optim"):
        a, b = load_file(str(ckpt_file(full, 9, part))), load_file(str(ckpt_file(seg, 9, part)))
        assert a.keys() == b.keys(), part
        diff = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
        assert not diff, f"{part}: {len(diff)} tensors differ after resume, e.g. {diff[:5]}"


def test_a_edit_resume_continues_from_its_newest_checkpoint(tmp_path, small_corpus, caplog):
    """The a_edit twin of the resume test: a lone a_edit cluster checkpoints mid-run (each sync ends a 0.05 s
    interval; `checkpoint.every` bounds the steps a crash loses) and `resume=auto` continues from the newest
    one. Not bit-identical to an uninterrupted run: the interval is wall-clock time, so where the syncs fall
    (and the outer steps they take) depends on measured step times."""
    run_dir = tmp_path / "run"
    # algo.interval=1: the run is train.steps syncs (pacer.run_syncs), each at least one step
    common = ("algo=a_edit", "algo.sync_time_s=0.05", "algo.interval=1", "algo.rule.verified.probe_tokens=0",
              "train.log_every=1",
              "train.eval_every=0", "checkpoint.every=3", "checkpoint.keep=10", "checkpoint.at_end=false")
    s1 = run_train(tiny_overrides(run_dir, small_corpus, *common, "train.steps=6"))
    steps = [int(p.name[5:]) for p in sorted((run_dir / "checkpoints").glob("step_*"))]
    assert steps and all(b - a <= 3 for a, b in zip([0, *steps], steps)), steps  # never more than 3 unsaved
    assert s1["steps"] - steps[-1] <= 3
    n_first = len(read_events(run_dir / "metrics.jsonl"))
    with caplog.at_level(logging.INFO, logger="edit_train"):
        s2 = run_train(tiny_overrides(run_dir, small_corpus, *common, "train.steps=10", "resume=auto"))
    assert any("resumed from" in r.getMessage() and f"step_{steps[-1]:08d}" in r.getMessage() for r in caplog.records)
    trains = [e["step"] for e in read_events(run_dir / "metrics.jsonl")[n_first:] if e["event"] == "train"]
    assert trains[0] == steps[-1] + 1 and s2["completed"] and s2["steps"] >= 10


def test_resume_auto_without_checkpoint_starts_fresh(tmp_path, small_corpus):
    s = run_train(tiny_overrides(tmp_path / "run", small_corpus, "train.steps=2", "train.eval_every=0",
                                 "resume=auto"))
    assert s["steps"] == 2 and s["initial_val_loss"] is not None


@pytest.mark.parametrize("change", ["model.num_hidden_layers=5", "model.moe_intermediate_size=64"])
def test_resume_with_another_model_is_a_user_error(tmp_path, small_corpus, change):
    """A checkpoint from another model config is a mistake the user made: it must surface as one of the
    errors `edit-train` turns into one `error:` line (not a traceback), naming what does not match."""
    from edit_train.cli.train import _user_errors

    run_dir = tmp_path / "run"
    quick = ("train.steps=2", "train.eval_every=0", "train.eval_batches=1")
    run_train(tiny_overrides(run_dir, small_corpus, *quick))
    with pytest.raises(_user_errors()) as exc:
        run_train(tiny_overrides(run_dir, small_corpus, *quick, "train.steps=4", "resume=auto", change))
    field = change.split("=")[0]
    assert field in str(exc.value) and "different model" in str(exc.value)


# ------------------------------------------------------------------------------------------ W&B offline
def _wandb_records(path: Path) -> list:
    """Decode a `.wandb` transaction log with wandb's own protobuf schema.

    The file is a 7-byte header (":W&B", magic, version) then LevelDB-log framing: 32 KiB blocks of
    chunks [crc32c u32][length u16][type u8] (1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, pos, buf, out = 32 * 1024, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
            buf = b""
    records = []
    for raw in out:
        rec = pb.Record()
        rec.ParseFromString(raw)
        records.append(rec)
    return records


def test_wandb_offline_run_logs_metrics(tmp_path, small_corpus, monkeypatch, caplog):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_API_KEY", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        summary = run_train(tiny_overrides(run_dir, small_corpus, "logger=wandb"))
    assert summary["completed"] is True
    # MetricsLogger.close swallows a failing sink: make that visible here
    failures = [r.getMessage() for r in caplog.records if "closing" in r.getMessage()]
    assert not failures, failures

    run_dirs = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert len(run_dirs) == 1, run_dirs
    files = glob.glob(str(Path(run_dirs[0]) / "run-*.wandb"))
    assert len(files) == 1, files
    path = Path(files[0])
    raw = path.read_bytes()
    assert b"train/loss" in raw and b"eval/val_loss" in raw

    try:
        records = _wandb_records(path)
    except ImportError:
        return  # no protobuf schema in this wandb: the byte check above is all we can do
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "exit" in kinds, f"the W&B run was never finished (record types: {sorted(set(kinds))})"
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {("/".join(i.nested_key) if i.nested_key else i.key): json.loads(i.value_json)
                   for i in r.history.item}
            history.append(row)
    logged = {row["step"]: row["train/loss"] for row in history if "train/loss" in row}
    expected = {e["step"]: e["loss"] for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "train"}
    assert sorted(expected) == [2, 4, 6]
    assert logged.keys() == expected.keys()
    for step, loss in expected.items():
        assert logged[step] == pytest.approx(loss), step
    assert any("eval/val_loss" in row for row in history)
    assert any("moe/aux_loss" in row for row in history)


# ---------------------------------------------------------------------------------- precision, accumulation
def test_bf16_autocast_runs_on_cpu(tmp_path, small_corpus):
    s = run_train(tiny_overrides(tmp_path / "run", small_corpus, "train.precision=bf16", "train.steps=3",
                                 "train.eval_every=0", "checkpoint.at_end=false"))
    assert s["completed"] is True and s["steps"] == 3
    assert is_num(s["final_val_loss"]) and s["per_cluster"]["c0"]["skipped_steps"] == 0
    train_events = [e for e in read_events(tmp_path / "run" / "metrics.jsonl") if e["event"] == "train"]
    assert train_events and all(is_num(e["loss"]) for e in train_events)


def test_grad_accum(tmp_path, small_corpus):
    s = run_train(tiny_overrides(tmp_path / "run", small_corpus, "train.grad_accum=2", "train.steps=3",
                                 "train.eval_every=0", "checkpoint.at_end=false"))
    assert s["completed"] is True and s["steps"] == 3
    assert s["tokens"] == 3 * 2 * TOKENS_PER_STEP  # each step consumes two micro-batches
    assert is_num(s["final_val_loss"]) and s["per_cluster"]["c0"]["skipped_steps"] == 0
