"""The GPU benchmarks without a GPU: `gpu_step.py` and `gpu_profile.py` refuse in one line, their `--quick` CPU
smoke runs write what the GPU run writes (rows, the profile table), `gpu_all.sh` refuses in one line; the device
name -> file name mapping. The GPU figures themselves come only from a lent device (`bash benchmarks/gpu_all.sh`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import gpu_profile  # noqa: E402
import gpu_step  # noqa: E402
import gpu_train  # noqa: E402
from _gpu import device_slug  # noqa: E402

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.mark.parametrize("label,slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "l40s"),
                                        ("CPU (x86_64)", "cpu"), ("AMD Instinct MI300X", "mi300x")])
def test_device_slug(label: str, slug: str) -> None:
    assert device_slug(label) == slug


@no_gpu
def test_refuse_without_a_gpu_in_one_line(capsys) -> None:
    for main in (gpu_step.main, gpu_profile.main):
        assert main([]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no CUDA device" in err[0]


@no_gpu
@pytest.mark.slow  # a fresh interpreter importing torch: seconds for one line
def test_gpu_all_refuses_without_a_gpu_in_one_line() -> None:
    proc = subprocess.run(["bash", str(BENCH / "gpu_all.sh"), "/nonexistent/never"], capture_output=True, text=True,
                          env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "no CUDA" in proc.stderr


@no_gpu
def test_gpu_step_quick_smoke_rows_and_append(tmp_path) -> None:
    out = tmp_path / "gpu_step.json"
    args = ["--quick", "--experts", "grouped", "--loss-chunk", "16", "--out", str(out)]
    assert gpu_step.main([*args, "--checkpointing", "none"]) == 0
    assert gpu_step.main([*args, "--checkpointing", "full", "--append"]) == 0
    result = json.loads(out.read_text())
    assert result["device_slug"] == "cpu" and result["note"] and len(result["loadavg"]) == 3
    rows = result["rows"]
    assert [r["checkpointing"] for r in rows] == ["none", "full"]
    for r in rows:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["mfu"] is None, r
        assert r["loss_chunk"] == 16 and r["experts_ran"] == ["grouped"] and r["plan_gib"] > 0
        assert r["total_params"] > r["active_params"] > 0


@no_gpu
def test_gpu_profile_quick_smoke(tmp_path) -> None:
    out = tmp_path / "profile.txt"
    assert gpu_profile.main(["--quick", "--loss-chunk", "8", "--out", str(out)]) == 0
    text = out.read_text()
    assert "self CPU time per category" in text and "dense GEMMs" in text
    assert "lm_head_loss range" in text  # the fused head loss is timed on its own
    assert "aten::mm" in text  # the torch.profiler table itself


@no_gpu
def test_gpu_train_smoke_trainer_and_harness_rows(tmp_path, small_corpus) -> None:
    """`gpu_train.py --smoke`: the Trainer's own rows at grad_accum 1 and 4 beside the harness row, appended to the
    gpu_step JSON with the plan's figure; no GPU figure is written on the CPU (no MFU, no peak)."""
    out = tmp_path / "gpu_step_cpu.json"
    assert gpu_train.main(["--smoke", "--rows", "trainer", "harness", "--out", str(out),
                           "--data-source", small_corpus]) == 0
    assert gpu_train.main(["--smoke", "--rows", "harness", "--out", str(out), "--data-source", small_corpus]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["what"], r["grad_accum"]) for r in rows] == [("trainer", 1), ("trainer", 4), ("harness", 1)]
    for r in rows:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["plan_gib"] > 0, r
        assert r["mfu"] is None and r["peak_gib"] is None
    trainer = [r for r in rows if r["what"] == "trainer"]
    assert trainer[1]["plan_gib"] > trainer[0]["plan_gib"]  # grad_accum 4: gradients live beside the activations


@no_gpu
def test_gpu_train_refuses_without_a_gpu_in_one_line(capsys) -> None:
    assert gpu_train.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


@no_gpu
@pytest.mark.slow  # a Lighthouse and two cluster processes on the CPU: about a minute on two loaded cores
def test_gpu_train_smoke_federation_row(tmp_path, small_corpus) -> None:
    out = tmp_path / "gpu_step_cpu.json"
    assert gpu_train.main(["--smoke", "--rows", "federation", "--out", str(out), "--data-source", small_corpus]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok" and row["completed"], row
    assert all(c["syncs"] == 3 and c["plan_gib"] > 0 and c["peak_gib"] is None for c in row["clusters"].values())


@no_gpu
def test_the_ling_mini_2_slice_rows_smoke_on_tiny_v2(tmp_path, small_corpus) -> None:
    """`gpu_all.sh`'s ling2 stage (`gpu_train.py --model ling_mini_2_slice --rows trainer harness`) and gpu_step.py's
    slice rows, smoked on the CPU: the same rows through the same code on Ling 2.0's CPU preset (tiny_v2)."""
    out = tmp_path / "gpu_step_cpu.json"
    assert gpu_train.main(["--smoke", "--model", "ling_mini_2_slice", "--rows", "trainer", "harness",
                           "--grad-accum", "1", "--out", str(out), "--data-source", small_corpus]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["what"], r["model"]) for r in rows] == [("trainer", "tiny_v2"), ("harness", "tiny_v2")]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["plan_gib"] > 0 for r in rows), rows
    step = tmp_path / "gpu_step.json"
    assert gpu_step.main(["--quick", "--models", "ling_mini_2_slice", "--experts", "grouped", "--checkpointing",
                          "none", "--out", str(step)]) == 0
    (row,) = json.loads(step.read_text())["rows"]
    assert row["model"] == "tiny_v2" and row["status"] == "ok" and row["experts_ran"] == ["grouped"], row
    assert row["mtp_params"] > 0 and row["flops_per_token"] > 0
