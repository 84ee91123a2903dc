"""Error-feedback residuals of sparse top-k syncs (issue 24) as rank state: they go into the checkpoint and come
back from it bit-exact; a cluster that re-bases on a peer's anchor (a heal in the local-SGD phase) starts them
empty; a rolled-back sync leaves them as they were before it. Clusters are threads (tests/helpers/toy_federation.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from edit_train.codec.dense import CompressionConfig, ErrorFeedback
from toy_federation import config, run_inproc


def _topk() -> CompressionConfig:
    cfg = CompressionConfig("topk", block_size=16, scale_dtype="bf16", topk_density=0.25, bits=2)
    cfg.validate()
    return cfg


def test_residuals_are_checkpointed_and_cleared_when_a_cluster_re_bases(tmp_path: Path) -> None:
    results = run_inproc(["c0", "c1"], config("at_end", "uniform", syncs=2), compression=_topk())
    a0, a1 = results["c0"].algo, results["c1"].algo
    assert a0 is not None and a1 is not None
    st0, st1 = a0.state, a1.state

    # checkpoint: the residuals are plain fp32 tensors, one per unit and lane, with 3/4 of every chunk owed
    saved = st0.tensors()["residual"]
    units = [u.name for u in a0.replica.units]
    assert sorted(k.split("#")[0] for k in saved) == sorted(units)
    assert all(v.dtype == torch.float32 and int((v != 0).sum()) > v.numel() // 2 for v in saved.values())
    save_file(saved, str(tmp_path / "residual.safetensors"))
    loaded = load_file(str(tmp_path / "residual.safetensors"))
    json_state = st0.json()
    st0.t.feedback.clear()
    st0.load({**st0.tensors(), "residual": loaded}, json_state)
    back = st0.t.feedback.state_dict()
    assert back.keys() == saved.keys() and all(torch.equal(back[k], saved[k]) for k in saved)
    fresh = ErrorFeedback()
    fresh.load_state_dict(loaded)
    assert all(torch.equal(fresh.residual(k), saved[k]) for k in saved)

    # heal: c1 re-bases on c0's anchor; its residuals were owed to its old anchor's syncs, so they go, and c0's
    # are not copied (a peer's residuals are that peer's debt)
    assert st1.t.feedback.keys()
    meta, local = st0.heal_out()
    assert meta["local_phase"] and not [k for k in local if "residual" in k]
    st1.heal_in(meta, {k: t for k, (t, _) in local.items()})
    assert st1.t.feedback.keys() == []
    assert a0.driver is not None and a1.driver is not None
    for u in units:
        assert all(torch.equal(x, y) for x, y in zip(a0.driver.core.outer.anchors[u], a1.driver.core.outer.anchors[u]))
