"""Issue 67, acceptance 5: the Ling 1 presets `tiny` and `small` replay bit-identically against a recording made on
the code before the Ling 2.0 model (fe89eed, tests/model/ling1_replay.json): three AdamW steps from the same seed give
the same losses, to the last bit, and the same weights (SHA-256 of the state_dict). The recording was made on this
project's CPU box with torch 2.13.0; another torch build may round differently (then the test says so and skips)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from edit_train.model.presets import load_preset
from edit_train.model.transformer import CausalLM

RECORDING = json.loads(Path(__file__).with_name("ling1_replay.json").read_text())


def record(preset: str) -> dict[str, object]:
    """What the recording holds for `preset`, computed by today's code."""
    torch.manual_seed(0)
    cfg = load_preset(preset)
    model = CausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
        y = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
        loss = model(x, y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(repr(float(loss.detach())))
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().cpu().numpy().tobytes())
    return {"losses": losses, "weights_sha256": h.hexdigest()}


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_ling1_presets_replay_the_recording_made_before_ling2(preset: str) -> None:
    if torch.__version__ != RECORDING["torch"]:
        pytest.skip(f"recorded with torch {RECORDING['torch']}, this is {torch.__version__}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as recorded
    try:
        now = record(preset)
    finally:
        torch.set_num_threads(threads)
    assert now == {k: RECORDING[preset][k] for k in ("losses", "weights_sha256")}
