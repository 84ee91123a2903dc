"""Hugging Face (BailingMoe) interop: names, config, exact round trips, checkpoint gathering, the export CLI."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import run_train
from edit_train.model import CausalLM, ModelConfig, load_preset
from edit_train.model.hf import (CONFIG_NAME, TRAINED_HEAD_KEY, WEIGHTS_NAME, from_hf_config, from_hf_state_dict,
                                 hf_param_shapes, normalized_head, param_shapes, to_hf_config, to_hf_state_dict)
from edit_train.model.hf_io import export_hf, load_hf_into
from edit_train.train.checkpoint_reader import gather_checkpoint

BAILING_KEYS = {
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_experts", "num_shared_experts", "num_experts_per_tok",
    "moe_intermediate_size", "intermediate_size", "first_k_dense_replace", "norm_topk_prob", "norm_head",
    "rope_theta", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "initializer_range",
    "hidden_act", "use_bias", "use_qkv_bias", "embedding_dropout", "attention_dropout", "output_dropout",
    "rope_scaling", "use_cache", "use_sliding_window", "max_window_layers", "output_router_logits",
    "pad_token_id", "bos_token_id", "eos_token_id", "torch_dtype", "dtype", "auto_map", "router_dtype",
    TRAINED_HEAD_KEY,
}


def tiny(**overrides) -> ModelConfig:
    cfg = dataclasses.replace(load_preset("tiny"), **{"first_k_dense_replace": 1, **overrides})
    cfg.validate()
    return cfg


@pytest.fixture(autouse=True)
def _one_thread(torch_one_thread):
    """Two shared cores: one torch thread (see conftest)."""


VARIANTS = {"untied": {}, "tied": {"tie_word_embeddings": True}}


def model_of(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():  # RMSNorm weights start at 1: perturb them so a mix-up would show
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def logits_of(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def expected_hf_names(cfg: ModelConfig, served: bool = False) -> set[str]:
    """The BailingMoe layout, written out independently of the code under test; ``served``: an export's (a tied
    head trained with norm_head is stored untied, normalised)."""
    names = {"model.word_embeddings.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings or (served and cfg.norm_head):
        names.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "attention.query_key_value.weight", p + "attention.dense.weight"}
        if i < cfg.first_k_dense_replace:
            names |= {p + f"mlp.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
        else:
            names.add(p + "mlp.gate.weight")
            names |= {p + f"mlp.shared_experts.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
            names |= {p + f"mlp.experts.{e}.{w}.weight" for e in range(cfg.num_experts)
                      for w in ("gate_proj", "up_proj", "down_proj")}
    return names


def assert_same_model(src: CausalLM, dst: CausalLM, ids: torch.Tensor) -> None:
    """``dst`` imported ``src``'s export: every tensor bit-identical except a norm_head head, which comes back
    normalised (the served encoding), so the logits agree to rounding (normalising twice moves ~1e-7)."""
    head = src.config.norm_head
    for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        if head and name in ("lm_head.weight", "word_embeddings.weight") and src.config.tie_word_embeddings:
            assert torch.equal(a, b), name  # tied: the embeddings come back raw (the served head is derived)
        elif head and name == "lm_head.weight":
            assert torch.equal(normalized_head(a), b), name
        else:
            assert torch.equal(a, b), name
    if head:
        torch.testing.assert_close(logits_of(dst, ids), logits_of(src, ids), atol=1e-5, rtol=0)
        assert torch.equal(logits_of(dst, ids).argmax(-1), logits_of(src, ids).argmax(-1))
    else:
        assert torch.equal(logits_of(src, ids), logits_of(dst, ids))


# ------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("variant", VARIANTS)
def test_config_keys_and_round_trip(variant):
    cfg = tiny(**VARIANTS[variant])
    d = to_hf_config(cfg, eos_token_id=256)
    assert set(d) == BAILING_KEYS
    assert d["architectures"] == ["BailingMoeForCausalLM"] and d["model_type"] == "bailing_moe"
    assert d["hidden_act"] == "silu" and d["use_bias"] is False and d["use_qkv_bias"] is False
    assert d["torch_dtype"] == "float32" and d["eos_token_id"] == 256 and d["pad_token_id"] is None
    assert d["tie_word_embeddings"] is False and d["norm_head"] is False  # tiny trains norm_head: served normalised
    assert d[TRAINED_HEAD_KEY] == {"norm_head": True, "tie_word_embeddings": variant == "tied"}
    assert d["router_dtype"] == "fp32" and "rope_scaling" in d and d["rope_scaling"] is None
    assert d["first_k_dense_replace"] == 1 and d["num_experts"] == 8 and d["num_shared_experts"] == 1
    json.dumps(d)  # plain JSON
    back = from_hf_config(json.loads(json.dumps(d)))
    training_only = ("router_aux_loss_coef", "router_z_loss_coef", "routing_warmup_steps", "init_from")
    assert back == dataclasses.replace(cfg, **{f: getattr(ModelConfig(), f) for f in training_only})
    # "none" is 0, never null (the engines compare with > and range()); a dense model has only dense layers
    dense = to_hf_config(tiny(num_experts=0, num_shared_experts=0))
    assert dense["num_experts"] == 0 and dense["num_shared_experts"] == 0 and dense["first_k_dense_replace"] == 4
    assert from_hf_config(dense).num_experts == 0 and from_hf_config(dense).num_shared_experts == 0
    # the older encoding (null for none, as our exports wrote it before) still reads the same
    old = {**dense, "num_experts": None, "num_shared_experts": None, "first_k_dense_replace": 1}
    del old[TRAINED_HEAD_KEY]
    assert from_hf_config(old).num_experts == 0 and from_hf_config(old).num_shared_experts == 0


def test_from_hf_config_rejects_other_models():
    d = to_hf_config(tiny())
    with pytest.raises(ValueError, match=r"some/config\.json.*bailing_moe"):
        from_hf_config({**d, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "some/config.json")
    with pytest.raises(ValueError, match=r"use_qkv_bias"):
        from_hf_config({**d, "use_qkv_bias": True})
    assert from_hf_config({**d, "some_future_key": 1, "head_dim": None}).head_dim == 128 // 4  # unknown ignored
    # a key left out means BailingMoeConfig's default, not ours
    sparse = {k: v for k, v in d.items()
              if k not in ("rms_norm_eps", "norm_head", "first_k_dense_replace", TRAINED_HEAD_KEY)}
    got = from_hf_config(sparse)
    assert (got.rms_norm_eps, got.norm_head, got.first_k_dense_replace) == (1e-5, False, 0)
    with pytest.raises(ValueError, match=r"use_bias=True \(BailingMoe's default"):
        from_hf_config({k: v for k, v in d.items() if k != "use_bias"})
    with pytest.raises(ValueError, match=r"x/config\.json: edit_train_trained_head must be"):
        from_hf_config({**d, TRAINED_HEAD_KEY: {"norm_head": "yes"}}, "x/config.json")
    with pytest.raises(ValueError, match=r"x/config\.json: num_key_value_heads must be an integer"):
        from_hf_config({**d, "num_key_value_heads": "2"}, "x/config.json")


# ------------------------------------------------------------------------------------- state dicts
@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_names_and_exact_round_trip(variant):
    cfg = tiny(**VARIANTS[variant])
    model = model_of(cfg)
    hf = to_hf_state_dict(model.state_dict(), cfg)  # state_dict() lists a tied head twice: dropped
    assert set(hf) == expected_hf_names(cfg)
    i_, h = cfg.moe_intermediate_size, cfg.hidden_size
    experts = model.layers[1].mlp.experts
    for e in (0, cfg.num_experts - 1):
        assert hf[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].shape == (i_, h)  # nn.Linear [out, in]
        assert hf[f"model.layers.1.mlp.experts.{e}.up_proj.weight"].shape == (i_, h)
        assert hf[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].shape == (h, i_)
        assert torch.equal(hf[f"model.layers.1.mlp.experts.{e}.down_proj.weight"], experts.down_proj[e])
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert hf["model.layers.0.attention.query_key_value.weight"].shape == (qkv_rows, h)
    assert hf["model.layers.0.mlp.gate_proj.weight"].shape == (cfg.intermediate_size, h)
    assert hf["model.layers.2.mlp.gate.weight"].shape == (cfg.num_experts, h)
    assert all(t.is_contiguous() for t in hf.values())

    back = from_hf_state_dict(hf, cfg)
    params = dict(model.named_parameters())
    assert set(back) == set(params)
    for name, p in params.items():
        assert back[name].dtype == p.dtype and torch.equal(back[name], p), name


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "norm_head": False},
                                       {"num_experts": 0}, {"num_shared_experts": 0, "first_k_dense_replace": 0},
                                       {"first_k_dense_replace": 4}])
def test_param_shapes_match_the_model(overrides):
    cfg = tiny(**overrides)
    model = CausalLM(cfg)
    assert list(param_shapes(cfg).items()) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    hf = to_hf_state_dict(dict(model.named_parameters()), cfg)
    back = from_hf_state_dict(hf, cfg)
    assert all(torch.equal(back[n], p) for n, p in model.named_parameters())
    out = to_hf_config(cfg)
    assert from_hf_config(out).num_experts == cfg.num_experts


def test_state_dict_key_errors():
    cfg = tiny()
    hf = to_hf_state_dict(dict(model_of(cfg).named_parameters()), cfg)
    missing = dict(hf)
    del missing["model.layers.3.mlp.experts.7.up_proj.weight"]
    with pytest.raises(ValueError, match=r"1 missing.*experts\.7\.up_proj"):
        from_hf_state_dict(missing, cfg)
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.9\.foo"):
        from_hf_state_dict({**hf, "model.layers.9.foo.weight": torch.zeros(1)}, cfg)
    with pytest.raises(ValueError, match=r"missing.*lm_head\.weight"):
        to_hf_state_dict({k: v for k, v in model_of(cfg).named_parameters() if k != "lm_head.weight"}, cfg)


# -------------------------------------------------------------------------------- export / load
@pytest.mark.parametrize("variant", VARIANTS)
def test_export_then_load_gives_identical_logits(tmp_path, variant):
    cfg = tiny(**VARIANTS[variant])
    src = model_of(cfg, seed=1)
    out = export_hf(src, None, tmp_path / "hf", eos_token_id=256)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary directory left behind
    assert {p.name for p in out.iterdir()} == {CONFIG_NAME, WEIGHTS_NAME, "generation_config.json",
                                               "configuration_edit_train.py", "modeling_edit_train.py"}
    with safe_open(str(out / WEIGHTS_NAME), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
        assert set(f.keys()) == expected_hf_names(cfg, served=True)
        assert torch.equal(f.get_tensor("lm_head.weight"), normalized_head(src.lm_head.weight))
    assert json.loads((out / CONFIG_NAME).read_text()) == to_hf_config(cfg, eos_token_id=256)

    dst = model_of(cfg, seed=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    assert not torch.equal(logits_of(src, ids), logits_of(dst, ids))
    load_hf_into(dst, out)
    assert_same_model(src, dst, ids)
    if variant == "tied":
        assert dst.lm_head.weight is dst.word_embeddings.weight

    with pytest.raises(ValueError, match="not empty"):
        export_hf(src, None, out)
    export_hf(src, None, out, dtype="bfloat16", overwrite=True)
    assert json.loads((out / CONFIG_NAME).read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_load_rejects_mismatched_config(tmp_path):
    out = export_hf(model_of(tiny()), None, tmp_path / "hf")
    with pytest.raises(ValueError, match=r"config\.json: hidden_size=128 there but model\.hidden_size=64"):
        load_hf_into(CausalLM(tiny(hidden_size=64)), out)
    with pytest.raises(ValueError, match=r"first_k_dense_replace"):
        load_hf_into(CausalLM(tiny(first_k_dense_replace=2)), out)
    cfg = json.loads((out / CONFIG_NAME).read_text())
    (out / CONFIG_NAME).write_text(json.dumps({**cfg, "model_type": "mixtral"}))
    with pytest.raises(ValueError, match=r"config\.json: not a BailingMoe config"):
        load_hf_into(CausalLM(tiny()), out)
    with pytest.raises(ValueError, match=r"config\.json: not found"):
        load_hf_into(CausalLM(tiny()), tmp_path)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def bailing_reference_logits(hf: dict[str, torch.Tensor], c: dict, ids: torch.Tensor) -> torch.Tensor:
    """A BailingMoe forward written from its published modelling code (per-expert nn.Linear weights,
    fused q/k/v rows, rotate-half RoPE, normalised head), in float64, reading only the exported tensors."""
    w = {k: v.double() for k, v in hf.items()}
    nq, nkv, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    b, t = ids.shape
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    emb = torch.cat([torch.outer(torch.arange(t, dtype=torch.float64), inv)] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def mlp(x, prefix):
        return F.linear(F.silu(F.linear(x, w[prefix + "gate_proj.weight"])) * F.linear(x, w[prefix + "up_proj.weight"]),
                        w[prefix + "down_proj.weight"])

    h = w["model.word_embeddings.weight"][ids]
    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        qkv = F.linear(x, w[p + "attention.query_key_value.weight"]).view(b, t, nq + 2 * nkv, hd)
        q, k, v = (s.transpose(1, 2) for s in qkv.split([nq, nkv, nkv], dim=2))
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(hd) + mask, dim=-1) @ v
        h = h + F.linear(att.transpose(1, 2).reshape(b, t, nq * hd), w[p + "attention.dense.weight"])
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps).reshape(b * t, -1)
        if c["num_experts"] is not None and i >= c["first_k_dense_replace"]:
            scores = torch.softmax(F.linear(x, w[p + "mlp.gate.weight"]), dim=-1)
            tw, ti = torch.topk(scores, c["num_experts_per_tok"], dim=-1)
            if c["norm_topk_prob"]:
                tw = tw / tw.sum(-1, keepdim=True)
            y = torch.stack([sum(tw[n, j] * mlp(x[n], f"{p}mlp.experts.{int(ti[n, j])}.")
                                 for j in range(ti.shape[1])) for n in range(x.shape[0])])
            if c["num_shared_experts"] is not None:
                y = y + mlp(x, p + "mlp.shared_experts.")
        else:
            y = mlp(x, p + "mlp.")
        h = h + y.view(b, t, -1)
    h = _rms(h, w["model.norm.weight"], eps)
    head = w["model.word_embeddings.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    if c["norm_head"]:
        head = head / (head.norm(p=2, dim=0, keepdim=True) + 1e-7)
    return h @ head.T


@pytest.mark.parametrize("variant", VARIANTS)
def test_exported_tensors_match_a_reference_bailing_forward(tmp_path, variant):
    cfg = tiny(**VARIANTS[variant])
    model = model_of(cfg, seed=3)
    out = export_hf(model, None, tmp_path / "hf")
    with safe_open(str(out / WEIGHTS_NAME), framework="pt") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = bailing_reference_logits(hf, json.loads((out / CONFIG_NAME).read_text()), ids)
    torch.testing.assert_close(logits_of(model, ids).double(), ref, atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------------ checkpoint gathering
def write_fake_checkpoint(step_dir: Path, cfg: ModelConfig, replicas: list[dict[str, torch.Tensor]],
                          shard_size: int) -> None:
    """The trainer's layout: rank r = group * S + shard holds torch.chunk(param, S)[shard] as param/<name>."""
    step_dir.mkdir(parents=True)
    run_cfg = {"model": dataclasses.asdict(cfg), "cluster": {"count": len(replicas), "ranks": shard_size}}
    for g, params in enumerate(replicas):
        for s in range(shard_size):
            r = g * shard_size + s
            shard = {}
            for name, p in params.items():
                chunks = list(torch.chunk(p.detach(), shard_size, dim=0))
                chunks += [p[0:0]] * (shard_size - len(chunks))  # FSDP2: trailing ranks may hold nothing
                shard[f"param/{name}"] = chunks[s].contiguous().clone()
            shard["buffer/layers.1.mlp.logit_mean"] = torch.zeros(())
            save_file(shard, str(step_dir / f"rank{r}-model.safetensors"))
            (step_dir / f"rank{r}-state.json").write_text(json.dumps({"step": 5, "config": run_cfg}))


def test_gather_checkpoint_from_two_shards(tmp_path):
    cfg = tiny(vocab_size=321)  # an odd dim 0: shards of 161 and 160 rows
    g0 = dict(model_of(cfg, seed=4).named_parameters())
    g1 = dict(model_of(cfg, seed=5).named_parameters())
    step_dir = tmp_path / "checkpoints" / "step_00000005"
    write_fake_checkpoint(step_dir, cfg, [g0, g1], shard_size=2)
    for group, want in ((0, g0), (1, g1)):
        state, got_cfg = gather_checkpoint(step_dir, group)
        assert got_cfg == cfg
        assert set(state) == set(want)
        for name, p in want.items():
            assert torch.equal(state[name], p), name
    with pytest.raises(ValueError, match="--cluster c2 is out of range"):
        gather_checkpoint(step_dir, 2)
    (step_dir / "rank3-model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"rank3-model\.safetensors: missing"):
        gather_checkpoint(step_dir, 1)


# ----------------------------------------------------------------------------------- CLI, real run
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, small_corpus, torch_one_thread):
    run_dir = tmp_path_factory.mktemp("hf-run")
    run_train([
        "algo=ddp", "cluster=local", "model=tiny", "train.steps=2", "logger=none", "train.progress=false", "train.eval_batches=1",
        "train.eval_every=0", "train.seq_len=32", "train.batch_size=2", f"data.source={small_corpus}",
        f"run.dir={run_dir}",
    ])
    return run_dir


def test_export_cli_matches_checkpoint(tiny_run, tmp_path, capsys):
    from edit_train.cli.export import main
    from edit_train.train.checkpoint import CheckpointManager
    from edit_train.train.state import load_model_tensors

    out = tmp_path / "hf"
    main([str(tiny_run), str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "step_00000002" in lines[0] and str(out) in lines[0], lines

    mgr = CheckpointManager(tiny_run / "checkpoints")
    tensors, state = mgr.load(mgr.latest_valid())
    cfg = load_preset("tiny")
    direct = CausalLM(cfg)
    load_model_tensors(direct, tensors["model"])
    exported = CausalLM(from_hf_config(json.loads((out / CONFIG_NAME).read_text()), out / CONFIG_NAME))
    load_hf_into(exported, out)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    assert_same_model(direct.eval(), exported.eval(), ids)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256  # byte tokenizer

    # the step directory itself, and --step, name the same checkpoint
    main([str(tiny_run / "checkpoints" / "step_00000002"), str(tmp_path / "hf2"), "--dtype", "bfloat16"])
    main([str(tiny_run), str(tmp_path / "hf3"), "--step", "2"])
    capsys.readouterr()
    with safe_open(str(tmp_path / "hf2" / WEIGHTS_NAME), framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["no_such_dir", "bad_step", "not_empty", "no_checkpoint", "corrupt"])
def test_export_cli_user_errors(tiny_run, tmp_path, capsys, case):
    import shutil

    from edit_train.cli.export import main

    run, out, extra = tiny_run, tmp_path / "out", []
    if case == "no_such_dir":
        run, want = tmp_path / "nope", "no such file or directory"
    elif case == "bad_step":
        extra, want = ["--step", "7"], "--step 7"
    elif case == "not_empty":
        out.mkdir()
        (out / "x").write_text("keep me")
        want = "--overwrite"
    elif case == "no_checkpoint":
        run = tmp_path / "empty_run"
        run.mkdir()
        want = "no complete checkpoint"
    else:
        run = tmp_path / "copy"
        shutil.copytree(tiny_run / "checkpoints", run / "checkpoints")
        step_dir = run / "checkpoints" / "step_00000002"
        with open(step_dir / "rank0-model.safetensors", "r+b") as f:
            f.seek(100)
            f.write(b"\xff\xff")
        run, want = step_dir, "SHA-256"
    with pytest.raises(SystemExit) as exc:
        main([str(run), str(out), *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and want in err[0], err
    if case == "not_empty":
        assert (out / "x").read_text() == "keep me"
    else:
        assert not out.exists()


# ------------------------------------------------------------------------------- sharded, streaming (issue 39)
def test_sharded_export_and_import_round_trip(tmp_path):
    """Shards of at most max_shard_size (a bigger tensor alone), the index transformers writes, and the exact
    inverse on import; a broken index or a missing shard is one line naming the file."""
    from edit_train.model.shards import WEIGHTS_INDEX_NAME, parse_size

    cfg = tiny()
    src = model_of(cfg, seed=6)
    cap = 200_000
    out = export_hf(src, None, tmp_path / "hf", max_shard_size=cap, eos_token_id=256)
    index = json.loads((out / WEIGHTS_INDEX_NAME).read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / WEIGHTS_NAME).exists()
    assert set(index["weight_map"]) == expected_hf_names(cfg, served=True)
    assert set(index["weight_map"].values()) == set(shards)
    sizes = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            sizes[shard] = [f.get_slice(k).get_shape() for k in f.keys()]
            assert f.metadata()["format"] == "pt"
    nbytes = {s: sum(4 * math.prod(shape) for shape in shapes) for s, shapes in sizes.items()}
    assert index["metadata"]["total_size"] == sum(nbytes.values())
    assert all(b <= cap or len(sizes[s]) == 1 for s, b in nbytes.items())  # a bigger tensor gets its own shard

    dst = model_of(cfg, seed=7)
    load_hf_into(dst, out)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    assert_same_model(src, dst, ids)

    (out / shards[1]).unlink()
    with pytest.raises(ValueError, match=rf"{shards[1]}: listed in {WEIGHTS_INDEX_NAME} but missing"):
        load_hf_into(dst, out)
    (out / WEIGHTS_INDEX_NAME).write_text("{")
    with pytest.raises(ValueError, match="unreadable index"):
        load_hf_into(dst, out)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size(1000) == 1000
    with pytest.raises(ValueError, match="shard size '5 parsecs'"):
        parse_size("5 parsecs")


def test_streaming_peak_memory_is_one_shard(tmp_path):
    """The small, fast version of benchmarks/hf_shards.py: a sharded checkpoint written by the test, imported
    into a model and exported again, each with peak RSS above the process's baseline (the model's own share)
    within 1.5 x one shard (+ the normalised copy of the norm_head head on export) — not the model's size (4 shards
    here) — and bit-exact (the head: normalised, the served encoding)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import hf_shards

    cfg = ModelConfig(vocab_size=32000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, num_experts=16, num_shared_experts=1,
                      num_experts_per_tok=2, moe_intermediate_size=512, intermediate_size=1024,
                      first_k_dense_replace=1)
    shard = 20 * 10**6  # the largest tensor (the embedding, 16.4 MB in bf16) fits one shard
    write = hf_shards.phase_write(cfg, tmp_path / "src", shard)
    trip = hf_shards.phase_round_trip(cfg, tmp_path / "src", tmp_path / "dst", shard)
    assert write["files"] >= 5 and trip["model_bytes"] > 3 * shard
    head = 2 * cfg.vocab_size * cfg.hidden_size  # norm_head: the export writes a normalised copy of the head
    for what, extra in (("import", 0), ("export", head)):
        assert trip[what]["peak_above_baseline"] <= 1.5 * shard + extra, (what, trip[what])
    same = hf_shards.phase_compare(tmp_path / "src", tmp_path / "dst")
    assert same["equal"] and same["tensors"] == len(hf_param_shapes(cfg)), same
