"""`benchmarks/_end_eval.py` scores a finished run's end model on the same val windows the trainer uses: on the
trainer's own number of batches it reproduces the run's final val loss."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from conftest import run_train, tiny_overrides

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _end_eval  # noqa: E402


def test_the_end_model_on_the_trainers_batches_gives_the_runs_final_val_loss(tmp_path: Path,
                                                                              small_corpus: str) -> None:
    run_dir = tmp_path / "run"
    summary = run_train(tiny_overrides(run_dir, small_corpus, "checkpoint.at_end=true"))
    loss, tokens = _end_eval.end_val_loss(run_dir, 2)  # TINY: train.eval_batches=2 of 2 x 32 tokens
    assert tokens == 2 * 2 * 32
    assert loss == pytest.approx(summary["final_val_loss"], rel=1e-6)
    more, more_tokens = _end_eval.end_val_loss(run_dir, 6)
    assert more_tokens == 6 * 2 * 32 and math.isfinite(more) and more != pytest.approx(loss, rel=1e-9)


def test_a_run_without_an_end_checkpoint_is_named(tmp_path: Path, small_corpus: str) -> None:
    run_dir = tmp_path / "run"
    run_train(tiny_overrides(run_dir, small_corpus, "checkpoint.at_end=false", "checkpoint.every=0"))
    with pytest.raises(FileNotFoundError, match="checkpoint.at_end=true"):
        _end_eval.end_val_loss(run_dir, 2)
