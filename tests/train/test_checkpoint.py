"""CheckpointManager, single rank: exact round trip, keep-K, crash safety, corruption, no pickle."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from edit_train.train.checkpoint import MANIFEST, CheckpointError, CheckpointManager


def make_tensors(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "param/w": torch.randn(4, 3, generator=g),
            "param/b": torch.randn(3, generator=g).to(torch.bfloat16),
            "buffer/inv_freq": torch.randn(2, generator=g).to(torch.float16),
            "param/view": torch.randn(6, 4, generator=g)[:, 1],  # non-contiguous view
        },
        "optim": {"w/exp_avg": torch.randn(4, 3, generator=g), "w/step": torch.tensor(7.0, dtype=torch.float64)},
        "rng": {"torch_cpu": torch.get_rng_state()},
        "misc": {"ints": torch.arange(5, dtype=torch.int64), "flags": torch.tensor([True, False])},
    }


def make_state(step: int) -> dict:
    return {"step": step, "tokens": 64 * step, "loader": {"epoch": 1, "pos": [3, 4]}, "wall_s": 1.5,
            "config": {"train": {"steps": 9}}, "wandb_run_id": None, "unicode": "héllo ✓"}


def manifest_of(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def refresh_manifest_entry(ckpt: Path, name: str) -> None:
    """Make the manifest agree with a file we rewrote, so the checksum check passes."""
    m = manifest_of(ckpt)
    f = ckpt / name
    m["files"][name] = {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(m, indent=1, sort_keys=True))


def test_save_latest_load_round_trip(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", keep=2)
    assert mgr.latest_valid() is None and mgr.list_steps() == []
    tensors, state = make_tensors(), make_state(3)
    path = mgr.save(3, tensors, state)
    assert path == tmp_path / "ckpt" / "step_00000003"
    assert not list((tmp_path / "ckpt").glob("*.tmp"))
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted([MANIFEST, "rank0-state.json", *(f"rank0-{p}.safetensors" for p in tensors)])

    m = manifest_of(path)
    assert m["step"] == 3 and m["world_size"] == 1
    assert set(m["files"]) == set(names) - {MANIFEST}
    for name, info in m["files"].items():
        assert info["bytes"] == (path / name).stat().st_size
        assert info["sha256"] == hashlib.sha256((path / name).read_bytes()).hexdigest()

    fresh = CheckpointManager(tmp_path / "ckpt", keep=2)
    assert fresh.latest_valid() == path
    loaded, loaded_state = fresh.load(path)
    assert loaded_state == state
    assert loaded.keys() == tensors.keys()
    for part, tdict in tensors.items():
        assert loaded[part].keys() == tdict.keys(), part
        for key, t in tdict.items():
            got = loaded[part][key]
            assert got.dtype == t.dtype and got.shape == t.shape, (part, key)
            assert torch.equal(got, t), (part, key)


def test_save_does_not_alias_caller_tensors(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    tensors = make_tensors()
    expected = tensors["model"]["param/w"].clone()
    mgr.save(1, tensors, make_state(1))
    tensors["model"]["param/w"].add_(1.0)  # training continues after the save
    loaded, _ = mgr.load(mgr.latest_valid())
    assert torch.equal(loaded["model"]["param/w"], expected)


def test_keep_k_prunes_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", keep=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, make_tensors(step), make_state(step))
    assert mgr.list_steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000003", "step_00000004"]
    assert mgr.latest_valid() == mgr.step_dir(4)
    _, state = mgr.load(mgr.step_dir(3))
    assert state["step"] == 3

    one = CheckpointManager(tmp_path / "ckpt", keep=1)
    one.save(5, make_tensors(5), make_state(5))
    assert one.list_steps() == [5]


def test_crash_mid_save_keeps_previous(tmp_path):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, keep=3)
    good = mgr.save(1, make_tensors(1), make_state(1))
    with pytest.raises(RuntimeError, match="injected crash"):
        mgr.save(2, make_tensors(2), make_state(2), crash_after_files=1)
    assert (root / "step_00000002.tmp").is_dir()  # the crash leaves its partial directory behind ...
    assert not (root / "step_00000002").exists()
    assert mgr.list_steps() == [1]  # ... which is never a candidate
    assert mgr.latest_valid() == good
    _, state = mgr.load(good)
    assert state["step"] == 1

    # a .tmp that even got as far as a complete manifest is still not picked (rename never happened)
    (root / "step_00000002.tmp").rename(root / "step_00000009.tmp")
    shutil.copytree(good, root / "step_00000008.tmp")
    assert mgr.list_steps() == [1] and mgr.latest_valid() == good

    # the next successful save clears the stale partial directories
    mgr.save(3, make_tensors(3), make_state(3))
    assert not list(root.glob("step_*.tmp"))
    assert mgr.list_steps() == [1, 3] and mgr.latest_valid() == mgr.step_dir(3)


def test_corrupt_byte_is_skipped_and_named(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path / "ckpt", keep=3)
    first = mgr.save(1, make_tensors(1), make_state(1))
    second = mgr.save(2, make_tensors(2), make_state(2))
    shard = second / "rank0-model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) - 3] ^= 0xFF  # same size, one byte flipped (inside the tensor data)
    shard.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="edit_train.train.checkpoint"):
        assert mgr.latest_valid() == first
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(shard) in m for m in messages), messages
    with pytest.raises(CheckpointError, match="rank0-model.safetensors"):
        mgr.verify(second)


def test_truncated_or_missing_file_is_skipped(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path / "ckpt", keep=3)
    first = mgr.save(1, make_tensors(1), make_state(1))
    second = mgr.save(2, make_tensors(2), make_state(2))
    third = mgr.save(3, make_tensors(3), make_state(3))
    optim = third / "rank0-optim.safetensors"
    optim.write_bytes(optim.read_bytes()[:-10])
    (second / "rank0-state.json").unlink()
    with caplog.at_level(logging.WARNING, logger="edit_train.train.checkpoint"):
        assert mgr.latest_valid() == first
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert str(optim) in text and "rank0-state.json" in text

    (first / MANIFEST).unlink()  # no manifest: not a checkpoint at all
    assert mgr.list_steps() == [2, 3] and mgr.latest_valid() is None


class _Tripwire:
    """Unpickling this creates a directory: proof that something unpickled the payload."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_pickle_payload_is_refused_not_unpickled(tmp_path, monkeypatch):
    marker = tmp_path / "UNPICKLED"
    mgr = CheckpointManager(tmp_path / "ckpt")
    path = mgr.save(1, make_tensors(), make_state(1))
    name = "rank0-model.safetensors"
    (path / name).write_bytes(pickle.dumps({"a": 1, "payload": _Tripwire(marker)}))
    refresh_manifest_entry(path, name)
    mgr.verify(path)  # checksums agree: only the loader can catch it

    def no_torch_load(*args, **kwargs):
        raise AssertionError("torch.load called on a checkpoint load path")

    monkeypatch.setattr(torch, "load", no_torch_load)
    with pytest.raises(CheckpointError) as exc:
        mgr.load(path)
    assert name in str(exc.value)
    assert not marker.exists()


def test_unexpected_file_type_is_refused(tmp_path):
    marker = tmp_path / "UNPICKLED"
    mgr = CheckpointManager(tmp_path / "ckpt")
    path = mgr.save(1, make_tensors(), make_state(1))
    name = "rank0-extra.pt"
    (path / name).write_bytes(pickle.dumps(_Tripwire(marker)))
    refresh_manifest_entry(path, name)
    assert mgr.latest_valid() == path
    with pytest.raises(CheckpointError, match="rank0-extra.pt"):
        mgr.load(path)
    assert not marker.exists()


def test_world_size_mismatch_is_refused(tmp_path):
    path = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1).save(1, make_tensors(), make_state(1))
    with pytest.raises(CheckpointError, match="cluster.count"):
        CheckpointManager(tmp_path / "ckpt", rank=0, world_size=2).load(path)
