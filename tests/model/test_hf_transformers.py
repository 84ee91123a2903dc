"""Issue 39 (1): an export loads in stock transformers (5.x) with `trust_remote_code=True` — the modeling and config
files it ships, not Ling's — and its logits equal edit-train's own model to 1e-4 (fp32): a 2-cluster run's export
(sharded), and the architecture variants a config can name. transformers is a test-only dependency (the `dev`
extra); without it these tests skip, saying so."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the product works offline; so does loading its export
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")

from edit_train.model import CausalLM, ModelConfig, load_preset  # noqa: E402
from edit_train.model.hf_io import export_hf  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(torch_one_thread):
    """Two shared cores: one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, small_corpus):
    """The session's tiny two-cluster EDiT sweep (tests/report/test_export_report.py::tiny_sweep): made once, shared."""
    from test_export_report import tiny_sweep

    return tiny_sweep(tmp_path_factory, small_corpus)


def hf_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), trust_remote_code=True).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_two_cluster_export_loads_in_transformers(sweep, tmp_path, capsys):
    """`edit-train-export` of a 2-cluster EDiT run, in shards: AutoModelForCausalLM builds the shipped
    BailingMoeForCausalLM and gives the logits of our CausalLM holding the clusters' common anchor."""
    from edit_train.cli.export import main
    from edit_train.train.checkpoint_reader import open_cluster

    out = tmp_path / "hf"
    main([str(sweep / "0"), "--out", str(out), "--max-shard-size", "2MB"])
    line = capsys.readouterr().out
    assert "model-00001-of-00004.safetensors .. model-00004-of-00004.safetensors" in line, line
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()

    model = hf_model(out)
    assert type(model).__name__ == "BailingMoeForCausalLM" and model.dtype == torch.float32
    assert type(model).__module__.endswith("modeling_edit_train")  # the file the export ships
    ck = open_cluster(sweep / "0" / "checkpoints" / "c0" / "step_00000008")
    ours = CausalLM(ck.model_cfg).eval()
    ours.load_state_dict(dict(ck.anchor.items()), strict=True)
    ids = torch.randint(0, ck.model_cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(model, ids), logits(ours, ids), atol=1e-4, rtol=0)

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("héllo").input_ids == list("héllo".encode())  # the byte tokenizer the run trained with


VARIANTS = {
    "tied_plain_head": {"tie_word_embeddings": True, "norm_head": False},
    "dense_only": {"num_experts": 0},
    "no_shared_experts_all_moe": {"num_shared_experts": 0, "first_k_dense_replace": 0},
    "top1_unnormalised": {"num_experts_per_tok": 1, "norm_topk_prob": False, "num_key_value_heads": 4},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_match_our_logits(tmp_path, variant):
    cfg: ModelConfig = dataclasses.replace(load_preset("tiny"),
                                           **{"first_k_dense_replace": 1, "rope_theta": 5e4, **VARIANTS[variant]})
    torch.manual_seed(1)
    ours = CausalLM(cfg).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: perturb them so a mix-up would show
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    export_hf(ours, None, tmp_path / "hf", eos_token_id=256)
    model = hf_model(tmp_path / "hf")
    ids = torch.randint(0, cfg.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(model, ids), logits(ours, ids), atol=1e-4, rtol=0)


def test_generate_with_cache_and_padding(tmp_path):
    """generate() reuses keys/values (transformers' Cache) and respects left padding: the same tokens as
    recomputing everything, and as each prompt alone."""
    cfg = dataclasses.replace(load_preset("tiny"), first_k_dense_replace=1)
    torch.manual_seed(3)
    export_hf(CausalLM(cfg), None, tmp_path / "hf", eos_token_id=256)
    model = hf_model(tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 256}
    cached = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(cached, model.generate(ids, attention_mask=mask, use_cache=False, **kw))
    assert torch.equal(cached[0, -6:], model.generate(ids[:1], **kw)[0, -6:])
    assert torch.equal(cached[1, -6:], model.generate(ids[1:, 4:], **kw)[0, -6:])
