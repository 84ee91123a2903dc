"""tiny_v2 in the training loop: the expert bias moves once per optimizer step, `mtp_loss` is logged, and a
resumed run is bit-identical to an uninterrupted one, the expert biases included (they are checkpointed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_events, run_train, tiny_overrides

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def ckpt(run_dir: Path, step: int, part: str) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:08d}" / f"rank0-{part}.safetensors"))


def test_tiny_v2_resume_is_bit_identical_with_its_expert_bias(tmp_path, small_corpus):
    common = ("model=tiny_v2", "train.log_every=1", "train.eval_every=3")
    full = tmp_path / "full"
    run_train(tiny_overrides(full, small_corpus, *common, "train.steps=6"))
    seg = tmp_path / "seg"
    run_train(tiny_overrides(seg, small_corpus, *common, "train.steps=3", "checkpoint.every=3"))
    run_train(tiny_overrides(seg, small_corpus, *common, "train.steps=6", "checkpoint.every=3", "resume=auto"))
    a, b = ckpt(full, 6, "model"), ckpt(seg, 6, "model")
    biases = [k for k in a if k.endswith("mlp.gate.expert_bias")]
    assert len(biases) == 4  # 3 MoE layers + the MTP layer
    assert all(float(a[k].abs().sum()) > 0 and abs(float(a[k].sum())) < 1e-5 for k in biases)  # moved, mean zero
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"{len(diff)} tensors differ after resume, e.g. {diff[:5]}"
    moe = [e for e in read_events(full / "metrics.jsonl") if e["event"] == "moe"]
    assert moe and all(e["aux_loss"] == 0.0 and e["mtp_loss"] > 0 for e in moe)
    # six optimizer steps of rate 1e-3, each entry moving by at most 2e-3 (sign step minus the update's mean)
    assert all(float(a[k].abs().max()) <= 6 * 2e-3 + 1e-7 for k in biases)


@pytest.mark.parametrize("mode", ["full", "moe"])
def test_activation_checkpointing_gives_the_same_gradients_with_mtp(mode):
    """The MTP layer is a decoder layer for `train.activation_checkpointing` too: recomputed, same gradients."""
    from edit_train.model import CausalLM, load_preset
    from edit_train.train.parallel import apply_activation_checkpointing

    cfg = load_preset("tiny_v2")
    torch.manual_seed(0)
    plain = CausalLM(cfg)
    ckpt_model = CausalLM(cfg)
    ckpt_model.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(ckpt_model, mode) == (5 if mode == "full" else 4)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (plain, ckpt_model):
        m(x, x).loss.backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt_model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=lambda s, n=n: f"{n}: {s}")
    assert [int(b.step_tokens.sum()) for b in plain.moe_blocks()] == \
        [int(b.step_tokens.sum()) for b in ckpt_model.moe_blocks()]  # counted once, not again by the recompute
