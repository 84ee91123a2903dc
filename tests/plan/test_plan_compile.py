"""Start-up pays for compiling a top-k format's kernels the first time a host uses it (issue 42: the held-out
top-k runs at 3 and 4 clusters spent 28 and 42 s of start-up in numba, which the planner did not count): the
record of compiled formats (`codec/compiled.py`), the simulator's start-up (`plan/sim.py: compile_wall`) and
calibration's measurement of the compile (`cli/codec_cost.compile_seconds`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edit_train.codec import compiled
from edit_train.codec.sparse_format import SparseFormat
from edit_train.plan.costs import resolve
from edit_train.plan.engine import simulate
from edit_train.plan.profile import Profile
from edit_train.plan.simbase import SimOptions
from edit_train.plan.spec import Candidate, PlanError, TopK, scenario_from_dict, topk_codec

COMPILE_S = 20.0


def _scenario(n: int, cores: int, done: list[str] | None, **kw):
    clusters = [{"name": f"c{i}", "ranks": 1, "step_s": 0.1, "step_cv": 0.0} for i in range(n)]
    return scenario_from_dict({"name": "t", "clusters": clusters, "model": "tiny", "batch_size": 4, "seq_len": 64,
                               "host_cores": cores, "compiled": done, **kw})


def _startup(scn, cand) -> np.ndarray:
    prof = Profile(per_op_s=0.0, sw_bytes_per_s=0.0, quorum_s=0.0, sync_work_s=0.0, sync_work_per_param_s=0.0,
                   startup_s=2.0, eval_s=0.0, other_step_s=0.0, codec_compile_s=COMPILE_S)
    return simulate(resolve(scn, prof), cand, SimOptions(steps=16)).buckets["startup"]


def _key(scn, cand) -> str:
    c = cand.codec(scn)
    return compiled.key(SparseFormat.of(c.block_size, c.density, c.bits, c.scale_dtype, c.group))


@pytest.mark.skipif(not compiled.available(), reason="no numba: nothing compiles")
@pytest.mark.parametrize("n, want", [(2, 20.0), (3, 30.0), (4, 40.0)])
def test_a_format_not_yet_compiled_costs_every_rank_its_compile_on_the_shared_cores(n, want):
    """n one-rank clusters on 2 cores compile at once: each needs COMPILE_S CPU seconds, so start-up grows by
    COMPILE_S × max(1, n / 2) — what the held-out runs measured (26 s at 3, 40 s at 4 with ~20 s each)."""
    cand = Candidate("diloco", "overlap", "topk", 8, topk=TopK(density=0.02))
    assert _startup(_scenario(n, 2, []), cand) == pytest.approx([2.0 + want] * n)


def test_a_compiled_format_and_every_other_compression_start_as_before():
    topk = Candidate("edit", "at_end", "topk", 8, topk=TopK(density=0.05, bits=4, group=4))
    scn = _scenario(3, 2, [])
    assert _startup(_scenario(3, 2, [_key(scn, topk)]), topk) == pytest.approx([2.0] * 3)
    for compression in ("none", "bf16", "int8", "fp8"):
        assert _startup(scn, Candidate("edit", "at_end", compression, 8)) == pytest.approx([2.0] * 3)
    # another format of the same density (other bits) is another kernel pair: it compiles
    other = Candidate("edit", "at_end", "topk", 8, topk=TopK(density=0.05, bits=2, group=4))
    assert _key(scn, other) != _key(scn, topk)
    if compiled.available():
        assert _startup(_scenario(3, 2, [_key(scn, topk)]), other)[0] > 2.0


def test_the_scenarios_compiled_list_is_checked_in_one_line():
    with pytest.raises(PlanError, match="compiled: must be a list of top-k format keys"):
        _scenario(2, 2, "chunk=256")  # type: ignore[arg-type]


def test_the_record_lists_what_this_host_compiled_for_these_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    f, g = SparseFormat.of(256, 0.01, 2), SparseFormat.of(256, 0.05, 4, group=4)
    assert compiled.compiled() == set()
    compiled.record(f)
    compiled.record(g)
    compiled.record(f)
    assert compiled.compiled() == {compiled.key(f), compiled.key(g)}
    data = json.loads((tmp_path / compiled.RECORD).read_text())
    assert data["stamp"] == compiled.stamp() and len(data["formats"]) == 2
    data["stamp"] = "other kernels"  # kernels edited or numba upgraded: numba recompiles, and so do we count it
    (tmp_path / compiled.RECORD).write_text(json.dumps(data))
    assert compiled.compiled() == set()
    (tmp_path / compiled.RECORD).write_text("{not json")
    assert compiled.compiled() == set()


def test_warm_records_the_format_it_compiled(tmp_path, monkeypatch):
    pytest.importorskip("numba")
    from edit_train.codec import sparse

    monkeypatch.setattr(compiled, "cache_dir", lambda: tmp_path)  # the record here, numba's cache as it is
    f = SparseFormat.of(256, 0.01, 2)  # the default top-k format: other tests compile it too
    sparse.warm(f)
    assert compiled.key(f) in compiled.compiled()


@pytest.mark.slow  # compiles a format from scratch in a child process (~20 CPU-seconds here)
def test_calibration_measures_what_a_new_format_costs_to_compile():
    from edit_train.cli.codec_cost import compile_seconds

    scn = _scenario(2, 2, None)
    codec = topk_codec(scn, TopK(density=0.03, bits=2))
    took = compile_seconds(codec)
    assert (took > 0.0) == compiled.available()  # a measurement, not a speed: no threshold on it
    assert compile_seconds(topk_codec(scn, TopK()).__class__("int8")) == 0.0
