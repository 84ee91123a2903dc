"""Hugging Face interop: our :class:`CausalLM` <-> a BailingMoe (Ling) checkpoint directory.

A BailingMoe directory holds ``config.json`` (``architectures: ["BailingMoeForCausalLM"]``, ``model_type:
"bailing_moe"``) and ``model.safetensors`` (or shards listed in ``model.safetensors.index.json``). Loaders
that read it: vLLM / SGLang with their own model code (the config through the shipped config class:
``--trust-remote-code``), stock ``transformers`` through the modeling code an export ships
(``modeling_edit_train.py`` + ``configuration_edit_train.py``, named in ``config.json``'s ``auto_map``; loaded
with ``trust_remote_code=True``), and Ling's public ``modeling_bailing_moe.py``.

Name mapping (ours -> BailingMoe); every tensor keeps its layout except the routed experts, which we store
stacked (``gate_proj``/``up_proj`` ``[E, I, H]``, ``down_proj`` ``[E, H, I]``) and BailingMoe stores as one
``nn.Linear`` per expert (weight ``[out, in]``: ``[I, H]`` and ``[H, I]``), so expert ``e`` is slice ``e``::

    word_embeddings.weight                        model.word_embeddings.weight
    layers.{i}.input_layernorm.weight             model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.query_key_value.weight   model.layers.{i}.attention.query_key_value.weight (q, k, v rows)
    layers.{i}.attention.dense.weight             model.layers.{i}.attention.dense.weight
    layers.{i}.post_attention_layernorm.weight    model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight     model.layers.{i}.mlp.{gate,up,down}_proj.weight   (dense layers)
    layers.{i}.mlp.gate.weight                    model.layers.{i}.mlp.gate.weight                  (router)
    layers.{i}.mlp.experts.{gate,up,down}_proj[e] model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
    layers.{i}.mlp.shared_experts.{..}_proj.weight model.layers.{i}.mlp.shared_experts.{..}_proj.weight
    norm.weight                                   model.norm.weight
    lm_head.weight                                lm_head.weight (absent when tie_word_embeddings)

**The served encoding** (what :func:`to_hf_config` / :func:`serving_state` write): the one encoding that vLLM,
SGLang, the shipped ``transformers`` code and Ling's public ``modeling_bailing_moe.py`` all read the same way
(``tests/model/test_serving.py`` emulates each of them against our model):

* ``norm_head``: ``lm_head.weight`` is stored already column-normalised (``W / (||W||_col + 1e-7)``, our
  ``NormHead``) and ``config.json`` says ``norm_head: false`` — vLLM never normalises the head, SGLang and the
  reference skip it for tied embeddings, and the reference rewrites the weight in place. Tied embeddings with
  ``norm_head`` are written untied (the normalised head beside the raw embeddings).
* ``num_experts: 0`` (never null) with ``first_k_dense_replace`` = layers for a dense model, and
  ``num_shared_experts: 0`` (never null) for no shared experts: the engines compare them with ``>`` / ``range``.
* ``norm_topk_prob: false`` when ``num_experts_per_tok`` is 1 (the engines renormalise a single weight to 1.0;
  we and the reference keep the router probability), ``router_dtype: "fp32"`` (bf16 engines route in fp32), and
  ``rope_scaling: null`` always present.
* :data:`TRAINED_HEAD_KEY` records the head the model was trained with (``norm_head``, ``tie_word_embeddings``),
  so :func:`from_hf_config` gives back the training architecture. Directories without it (our older exports,
  public Ling checkpoints) are read literally: a raw head with ``norm_head: true``, nulls for "none".

**Ling 2.0** (:func:`is_v2`: any BailingMoeV2 field off its Ling 1 default): ``architectures:
["BailingMoeV2ForCausalLM"]`` (``model_type`` stays ``bailing_moe``, as Ling-V2's checkpoints say) and every V2 key
written (:data:`HF_FIELDS_V2`; no group limit is written as one group, ``n_group: 1``: the engines route sigmoid +
bias grouped only). Beyond the Ling 1 names: ``model.layers.{i}.attention.{query,key}_layernorm.weight`` (QK-norm),
``model.layers.{i}.mlp.gate.expert_bias`` (fp32 in every export), and the MTP layers after the main ones,
``model.layers.{L + j}.{enorm,hnorm,eh_proj,final_layernorm}.weight`` beside a decoder layer's names (SGLang's and
llama.cpp's layout; Ling-V2's reference modeling code instead counts them among ``num_hidden_layers``). A V2 file's
absent keys mean BailingMoeV2Config's defaults (:data:`BAILING_V2_BASE_DEFAULTS`).

This module is the naming and config contract; reading and writing directories (``export_hf``,
``load_hf_into``) is :mod:`edit_train.model.hf_io`, the shard files :mod:`edit_train.model.shards`. Nothing unpickles: tensors are read with
``safetensors`` and metadata with ``json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from edit_train.model.config import ModelConfig
from edit_train.model.shards import WEIGHTS_INDEX_NAME, WEIGHTS_NAME  # noqa: F401 - part of this contract

log = logging.getLogger(__name__)

ARCHITECTURE = "BailingMoeForCausalLM"
#: Ling 2.0's architecture name (its config.json keeps model_type "bailing_moe"); an export of a model that uses any
#: BailingMoeV2 feature (:func:`is_v2`) names it, and vLLM / SGLang / llama.cpp dispatch on it.
ARCHITECTURE_V2 = "BailingMoeV2ForCausalLM"
MODEL_TYPE = "bailing_moe"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
#: config.json key of the head edit-train trained ({"norm_head": bool, "tie_word_embeddings": bool}); the served
#: keys of the same names describe the stored tensors (see the module docstring).
TRAINED_HEAD_KEY = "edit_train_trained_head"
#: The column-norm epsilon of a normalised head (our ``NormHead``, Ling's ``compute_logit``).
NORM_HEAD_EPS = 1e-7
#: The code an export ships for ``transformers`` (``trust_remote_code``): files of this package, copied as they are.
REMOTE_CODE_FILES: tuple[str, ...] = ("configuration_edit_train.py", "modeling_edit_train.py")
AUTO_MAP: dict[str, str] = {"AutoConfig": "configuration_edit_train.BailingMoeConfig",
                            "AutoModel": "modeling_edit_train.BailingMoeModel",
                            "AutoModelForCausalLM": "modeling_edit_train.BailingMoeForCausalLM"}

#: ModelConfig fields that are also BailingMoe config.json keys (same name, same meaning).
HF_FIELDS: tuple[str, ...] = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_experts", "num_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
    "first_k_dense_replace", "norm_topk_prob", "norm_head", "rope_theta", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "initializer_range",
)
#: ModelConfig fields that are BailingMoeV2 config.json keys (same name, same meaning), written for a V2 export.
HF_FIELDS_V2: tuple[str, ...] = (
    "score_function", "moe_router_enable_expert_bias", "n_group", "topk_group", "routed_scaling_factor",
    "use_qk_norm", "partial_rotary_factor", "num_nextn_predict_layers", "mtp_loss_scaling_factor",
)
#: Fields that change the weights' shapes or the forward math: a loaded directory must agree on them.
#: (``max_position_embeddings`` and ``initializer_range`` do neither for our model.)
ARCH_FIELDS: tuple[str, ...] = tuple(f for f in HF_FIELDS + HF_FIELDS_V2
                                     if f not in ("max_position_embeddings", "initializer_range",
                                                  "mtp_loss_scaling_factor"))

#: BailingMoeConfig's constructor defaults (Ling's configuration_bailing_moe.py): what a key left out means.
BAILING_DEFAULTS: dict[str, Any] = {
    "vocab_size": 30592, "hidden_size": 1024, "intermediate_size": None, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 0, "hidden_act": "silu", "use_qkv_bias": False,
    "use_bias": True, "rms_norm_eps": 1e-5, "norm_head": False, "tie_word_embeddings": False,
    "initializer_range": 0.02, "max_position_embeddings": 16384, "rope_theta": 10000.0, "rope_scaling": None,
    "num_experts": 16, "num_shared_experts": 0, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "moe_intermediate_size": None, "first_k_dense_replace": 0, "head_dim": None,
}

#: BailingMoeV2Config's defaults (Ling-V2's configuration_bailing_moe_v2.py) for the V2 keys: what a V2 file that
#: leaves one out means. A Ling 1 file (BailingMoeForCausalLM) leaves them all out and means Ling 1's router.
BAILING_V2_DEFAULTS: dict[str, Any] = {
    "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "use_qk_norm": True, "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 0,
    "mtp_loss_scaling_factor": 0.0,
}
#: BailingMoeV2Config's defaults for the keys Ling 1 shares (they differ: no biases, eps 1e-6, Ling-mini-2.0's sizes).
BAILING_V2_BASE_DEFAULTS: dict[str, Any] = {
    **BAILING_DEFAULTS, "vocab_size": 157184, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 4, "use_bias": False, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768, "rope_theta": 600000.0, "num_experts": 256, "num_shared_experts": 1,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "first_k_dense_replace": 1, "head_dim": 128,
    **BAILING_V2_DEFAULTS,
}
_LING1_V2_FIELDS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                                     if f.name in HF_FIELDS_V2}

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


# ---------------------------------------------------------------------------------------------- config
def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported export dtype {dtype}; use one of {', '.join(_DTYPES)}")


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` (or ``"fp32"``, ``"bf16"``, ``"fp16"``) -> torch dtype."""
    if name is None or isinstance(name, torch.dtype):
        return name
    alias = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    key = alias.get(str(name).lower(), str(name).lower())
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def serving_config(cfg: ModelConfig) -> ModelConfig:
    """The architecture the served files describe: the head already normalised (``norm_head`` off) and, when
    tied embeddings were trained with ``norm_head``, untied (the normalised head stored beside the raw
    embeddings); a dense model says so with ``first_k_dense_replace`` = layers. Same weights otherwise."""
    served = dataclasses.replace(cfg, norm_head=False,
                                 tie_word_embeddings=cfg.tie_word_embeddings and not cfg.norm_head)
    if cfg.num_experts == 0:
        served.first_k_dense_replace = cfg.num_hidden_layers
    return served


def normalized_head(weight: torch.Tensor) -> torch.Tensor:
    """``W / (||W||_col + eps)`` computed in fp32 (at least), in ``weight``'s dtype: what our ``NormHead`` and
    Ling's eval-mode ``compute_logit`` multiply the hidden states with (bit for bit: the same norm, then an
    elementwise division). A low-precision head is divided a block of rows at a time, so an export holds about
    one head beside the model, not an fp32 copy of it (its norms summed block by block: equal to rounding)."""
    w = weight.detach()
    compute = torch.promote_types(w.dtype, torch.float32)
    if w.dtype == compute:
        return w / (torch.linalg.vector_norm(w, ord=2, dim=0, keepdim=True) + NORM_HEAD_EPS)
    rows = 4096
    sumsq = torch.zeros((1, w.shape[1]), dtype=compute, device=w.device)
    for start in range(0, w.shape[0], rows):
        sumsq += w[start:start + rows].to(compute).square().sum(dim=0, keepdim=True)
    denom = sumsq.sqrt() + NORM_HEAD_EPS
    out = torch.empty_like(w, memory_format=torch.contiguous_format)
    for start in range(0, w.shape[0], rows):
        out[start:start + rows] = (w[start:start + rows].to(compute) / denom).to(w.dtype)
    return out


def serving_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Mapping[str, torch.Tensor]:
    """Our parameters in the served encoding (:func:`serving_config`'s names): with ``norm_head`` the head is
    normalised (from the embeddings when tied). Lazy: each tensor is read from ``state`` when asked for."""
    if not cfg.norm_head:
        return state
    return _ServedState(state, cfg)


class _ServedState(Mapping[str, torch.Tensor]):
    def __init__(self, state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
        self._state, self._head_src = state, "word_embeddings.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self._names = [n for n in state.keys() if n != "lm_head.weight"] + ["lm_head.weight"]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight":
            return normalized_head(self._state[self._head_src])
        if name not in self._names:
            raise KeyError(name)
        return self._state[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def file_layout(cfg: ModelConfig, raw: Mapping[str, Any]) -> ModelConfig:
    """The architecture a directory's tensors are stored in, for the trained ``cfg`` read from its ``config.json``
    dict ``raw``: the served one when ``raw`` carries :data:`TRAINED_HEAD_KEY` (our exports), else ``cfg`` itself
    (older exports, public Ling checkpoints: a raw head with ``norm_head``)."""
    return serving_config(cfg) if TRAINED_HEAD_KEY in raw else cfg


def is_v2(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` uses any BailingMoeV2 (Ling 2.0) feature: its export is a ``BailingMoeV2ForCausalLM``."""
    return any(getattr(cfg, f) != v for f, v in _LING1_V2_FIELDS.items() if f != "mtp_loss_scaling_factor")


def to_hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32, *, eos_token_id: int | None = None,
                 bos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """The BailingMoe ``config.json`` of a model config in the served encoding (module docstring), with the
    ``auto_map`` that points ``transformers`` at the shipped :data:`REMOTE_CODE_FILES` and the trained head under
    :data:`TRAINED_HEAD_KEY`. Every BailingMoe key whose default would change the model (biases, dropouts, eps,
    pad id) is written explicitly.
    """
    cfg.validate()
    for name, tid in (("eos_token_id", eos_token_id), ("bos_token_id", bos_token_id),
                      ("pad_token_id", pad_token_id)):
        if tid is not None and not 0 <= tid < cfg.vocab_size:
            raise ValueError(f"{name}={tid} is outside the vocabulary (vocab_size={cfg.vocab_size})")
    served = serving_config(cfg)
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "auto_map": dict(AUTO_MAP),  # transformers has no bailing_moe: trust_remote_code loads the shipped files
        **{f: getattr(served, f) for f in HF_FIELDS},
        "hidden_act": "silu",
        "use_bias": False,
        "use_qkv_bias": False,
        "embedding_dropout": 0.0,
        "attention_dropout": 0.0,
        "output_dropout": 0.0,
        "rope_scaling": None,  # SGLang reads config.rope_scaling with no default: always present
        "router_dtype": "fp32",  # vLLM / SGLang build the router in fp32 (as we train it) instead of the model dtype
        "use_cache": True,
        "use_sliding_window": False,
        "max_window_layers": cfg.num_hidden_layers,
        "output_router_logits": False,
        # explicit null: BailingMoe's default pad id (126081) would not even fit a small vocabulary, and a pad
        # id that equals eos would freeze the eos embedding row (nn.Embedding padding_idx) when fine-tuning
        "pad_token_id": pad_token_id,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype_name(dtype),  # what transformers 4.x and serving engines read
        "dtype": dtype_name(dtype),  # transformers 5.x's name for it
        TRAINED_HEAD_KEY: {"norm_head": cfg.norm_head, "tie_word_embeddings": cfg.tie_word_embeddings},
    }
    if cfg.num_experts_per_tok == 1:  # one expert: the weight is the router probability (engines would make it 1)
        d["norm_topk_prob"] = False
    if is_v2(cfg):
        # every V2 key written (BailingMoeV2Config's defaults differ from Ling 1's: sigmoid, bias, 8 groups, 2.5);
        # no groups is n_group 0 / topk_group 0 (SGLang: off when both are 0; vLLM's grouped top-k likewise),
        # the shared experts' width is left to moe_intermediate_size * num_shared_experts (every reader's fallback)
        d["architectures"] = [ARCHITECTURE_V2]
        d["auto_map"] = {**AUTO_MAP, "AutoModelForCausalLM": "modeling_edit_train.BailingMoeV2ForCausalLM"}
        d.update({f: getattr(served, f) for f in HF_FIELDS_V2})
        if cfg.n_group == 0:  # no group limit is one group holding every expert: SGLang and vLLM (the revisions
            d["n_group"] = d["topk_group"] = 1  # tests/model/test_ling2_serving.py reads) route sigmoid + bias only grouped
        d["moe_router_enable_expert_bias"] = bool(cfg.moe_router_enable_expert_bias and cfg.num_experts > 0)
        d["use_rmsnorm"] = True  # vLLM's QK-norm is an nn.LayerNorm (weight and bias) unless this says RMSNorm
    return d


def _typed(source: str, field: str, v: Any, want: type) -> Any:
    """A config.json value as the dataclass field's type (`want`), or one line naming the field."""
    if want is bool and not isinstance(v, bool):
        raise ValueError(f"{source}: {field} must be true or false, got {v!r}")
    if want is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ValueError(f"{source}: {field} must be an integer, got {v!r}")
    if want is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{source}: {field} must be a number, got {v!r}")
        return float(v)
    return v


def from_hf_config(d: Mapping[str, Any], source: str | os.PathLike[str] = CONFIG_NAME) -> ModelConfig:
    """A :class:`ModelConfig` from a BailingMoe ``config.json`` dict. Unknown keys are ignored, a key left out
    takes BailingMoeConfig's default (not ours), training-only fields keep our defaults; features our model
    lacks (biases, qk-norm, rope scaling, another activation) are refused. ``source`` names the file in
    error messages."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
    archs = d.get("architectures")
    v2 = archs is not None and ARCHITECTURE_V2 in archs
    if d.get("model_type") not in (MODEL_TYPE, "bailing_moe_v2") or (
            archs is not None and ARCHITECTURE not in archs and not v2):
        raise ValueError(f"{source}: not a BailingMoe config (model_type={d.get('model_type')!r}, "
                         f"architectures={archs!r}); expected model_type={MODEL_TYPE!r} and {ARCHITECTURE} "
                         f"or {ARCHITECTURE_V2}")

    base = BAILING_V2_BASE_DEFAULTS if v2 else BAILING_DEFAULTS

    def get(key: str) -> Any:  # a key the file leaves out means BailingMoe's (V2's) default, not ours
        return d[key] if key in d else base.get(key)

    unsupported: dict[str, tuple[Any, ...]] = {"hidden_act": ("silu",), "use_bias": (False,),
                                               "use_qkv_bias": (False, None), "rope_scaling": (None,)}
    if not v2:
        unsupported["use_qk_norm"] = (False, None)
    else:
        unsupported["score_function"] = ("sigmoid", "softmax")
    for key, ok in unsupported.items():
        if get(key) not in ok:
            absent = "" if key in d else " (BailingMoe's default when the key is absent)"
            raise ValueError(f"{source}: {key}={get(key)!r}{absent} is not supported by edit-train's model "
                             f"(supported: {' or '.join(repr(v) for v in ok if v is not None)})")
    defaults = ModelConfig()
    kw: dict[str, Any] = {f: get(f) for f in HF_FIELDS}
    for f, v in list(kw.items()):  # JSON values -> the dataclass field's type
        if v is not None:
            kw[f] = _typed(source, f, v, type(getattr(defaults, f)))
    for f in ("num_experts", "num_shared_experts"):  # null: no MoE block / no shared experts
        kw[f] = 0 if kw[f] is None else kw[f]
    if kw["head_dim"] is None and kw["hidden_size"] and kw["num_attention_heads"]:
        kw["head_dim"] = int(kw["hidden_size"]) // int(kw["num_attention_heads"])  # BailingMoe's fallback
    has_moe = bool(kw["num_experts"]) and (kw["first_k_dense_replace"] or 0) < (kw["num_hidden_layers"] or 0)
    has_dense = not kw["num_experts"] or bool(kw["first_k_dense_replace"])
    for f, needed in (("moe_intermediate_size", has_moe), ("intermediate_size", has_dense)):
        if kw[f] is None:
            if needed:
                raise ValueError(f"{source}: {f} is missing or null but this model has "
                                 f"{'MoE' if f.startswith('moe') else 'dense'} layers")
            kw[f] = getattr(defaults, f)  # unused by this architecture
    if v2:  # the V2 keys; one left out means BailingMoeV2Config's default
        for f in HF_FIELDS_V2:
            v = d[f] if f in d else BAILING_V2_DEFAULTS[f]
            kw[f] = _typed(source, f, v, type(_LING1_V2_FIELDS[f]))
        if kw["n_group"] in (None, 1) and kw["topk_group"] in (None, 1):  # one group: no limit
            kw["n_group"] = kw["topk_group"] = 0
        shared = d.get("moe_shared_expert_intermediate_size")
        if shared is not None and kw["num_shared_experts"] and shared != kw["moe_intermediate_size"]:
            raise ValueError(f"{source}: moe_shared_expert_intermediate_size={shared!r} differs from "
                             f"moe_intermediate_size={kw['moe_intermediate_size']!r}: not supported by edit-train's "
                             f"model")
        if kw["score_function"] == "softmax" and kw["moe_router_enable_expert_bias"]:
            kw["moe_router_enable_expert_bias"] = False  # the engines pair a bias with sigmoid only (SGLang asserts it)
    nulls = [f for f, v in kw.items() if v is None]
    if nulls:
        raise ValueError(f"{source}: {nulls[0]} is null; it needs a value")
    trained = d.get(TRAINED_HEAD_KEY)
    if trained is not None:  # our served encoding: the head the model was trained with
        if not (isinstance(trained, Mapping) and all(isinstance(trained.get(k), bool)
                                                     for k in ("norm_head", "tie_word_embeddings"))):
            raise ValueError(f"{source}: {TRAINED_HEAD_KEY} must be {{\"norm_head\": true|false, "
                             f"\"tie_word_embeddings\": true|false}}, got {trained!r}")
        kw["norm_head"], kw["tie_word_embeddings"] = trained["norm_head"], trained["tie_word_embeddings"]
    cfg = dataclasses.replace(defaults, **kw)
    try:
        cfg.validate()
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return cfg


def read_hf_config(directory: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, Any]]:
    """``(ModelConfig, raw dict)`` of ``directory/config.json``; ValueError naming the file if unusable."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{path}: not found; expected a Hugging Face BailingMoe directory "
                         f"(config.json + {WEIGHTS_NAME}), e.g. one written by edit-train-export")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable JSON ({exc})") from None
    return from_hf_config(raw, path), raw


def relevant_arch_fields(cfg: ModelConfig) -> list[str]:
    """The :data:`ARCH_FIELDS` that matter for this config (MoE fields only if it has MoE layers, the dense
    MLP width only if it has dense layers)."""
    has_moe = cfg.num_experts > 0 and cfg.first_k_dense_replace < cfg.num_hidden_layers
    has_dense = cfg.num_experts == 0 or cfg.first_k_dense_replace > 0
    moe_only = {"num_experts_per_tok", "moe_intermediate_size", "num_shared_experts", "norm_topk_prob",
                "score_function", "moe_router_enable_expert_bias", "n_group", "topk_group", "routed_scaling_factor"}
    out = []
    for f in ARCH_FIELDS:
        if f in moe_only and not has_moe:
            continue
        if f == "intermediate_size" and not has_dense:
            continue
        if f == "first_k_dense_replace" and cfg.num_experts == 0:
            continue
        if f == "norm_topk_prob" and cfg.num_experts_per_tok == 1:  # one expert: nothing to renormalise
            continue
        out.append(f)
    return out


def check_same_architecture(ours: ModelConfig, theirs: ModelConfig, source: str | os.PathLike[str]) -> None:
    """ValueError naming the first architecture field on which ``theirs`` (read from ``source``) differs."""
    fields = relevant_arch_fields(ours)
    if (ours.num_experts > 0) != (theirs.num_experts > 0):
        fields = ["num_experts", *fields]
    for f in fields:
        a, b = getattr(ours, f), getattr(theirs, f)
        if a != b:
            raise ValueError(f"{source}: {f}={b!r} there but model.{f}={a!r} in this model; set model.{f}={b!r} "
                             f"(or pick the matching model preset) to load these weights")


# ----------------------------------------------------------------------------------------- state dicts
def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names (in ``named_parameters`` order, a tied head once) and full shapes.

    Written out from ``transformer.py`` / ``moe.py`` rather than read off a meta-device model: the first
    ``normal_`` on a meta tensor imports torch's reference decompositions (seconds). ``tests/model/test_hf.py``
    pins this against ``CausalLM(cfg).named_parameters()``.
    """
    h, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {"word_embeddings.weight": (v, h)}
    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):  # the MTP layers follow the main ones
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "attention.query_key_value.weight"] = ((nq + 2 * nkv) * hd, h)
        if cfg.use_qk_norm:
            shapes[p + "attention.query_layernorm.weight"] = (hd,)
            shapes[p + "attention.key_layernorm.weight"] = (hd,)
        shapes[p + "attention.dense.weight"] = (h, nq * hd)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.num_experts > 0 and i >= cfg.first_k_dense_replace:
            e, m = cfg.num_experts, cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.experts.gate_proj"] = (e, m, h)
            shapes[p + "mlp.experts.up_proj"] = (e, m, h)
            shapes[p + "mlp.experts.down_proj"] = (e, h, m)
            mlps = [("mlp.shared_experts.", cfg.num_shared_experts * m)] if cfg.num_shared_experts > 0 else []
        else:
            mlps = [("mlp.", cfg.intermediate_size)]
        for prefix, width in mlps:
            shapes[p + prefix + "gate_proj.weight"] = (width, h)
            shapes[p + prefix + "up_proj.weight"] = (width, h)
            shapes[p + prefix + "down_proj.weight"] = (h, width)
        if i >= cfg.num_hidden_layers:  # an MTP layer's own modules (MTPLayer)
            shapes[p + "enorm.weight"] = (h,)
            shapes[p + "hnorm.weight"] = (h,)
            shapes[p + "eh_proj.weight"] = (h, 2 * h)
            shapes[p + "final_layernorm.weight"] = (h,)
    shapes["norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def buffer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The persistent buffers a checkpoint directory holds beside the parameters: each MoE layer's
    ``mlp.gate.expert_bias`` (fp32 ``[E]``) when ``moe_router_enable_expert_bias``."""
    if not (cfg.moe_router_enable_expert_bias and cfg.num_experts > 0):
        return {}
    layers = range(cfg.first_k_dense_replace, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    return {f"layers.{i}.mlp.gate.expert_bias": (cfg.num_experts,) for i in layers}


def state_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Everything an export holds, in our names: :func:`param_shapes` then :func:`buffer_shapes`."""
    return {**param_shapes(cfg), **buffer_shapes(cfg)}


def _hf_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """BailingMoe name(s) and shape(s) of one of our parameters."""
    m = _EXPERT_RE.match(name)
    if m:
        i, proj = m.groups()
        return [(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight", tuple(shape[1:])) for e in range(shape[0])]
    if name == "lm_head.weight":
        return [(name, shape)]
    return [(f"model.{name}", shape)]


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The BailingMoe tensor names and shapes an export of ``cfg`` holds."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in state_shapes(cfg).items():
        out.update(_hf_names(name, shape))
    return out


def _check_keys(got: Mapping[str, torch.Tensor], want: Mapping[str, tuple[int, ...]], what: str,
                allowed_extra: frozenset[str] | set[str] = frozenset()) -> None:
    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want and k not in allowed_extra]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:4])})")
        raise ValueError(f"{what}: {'; '.join(parts)} — written for a different model config?")
    for k, shape in want.items():
        if tuple(got[k].shape) != tuple(shape):
            raise ValueError(f"{what}: {k} has shape {tuple(got[k].shape)}, the model config needs {tuple(shape)}")


def iter_hf_tensors(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Our ``(name, full tensor)`` pairs -> BailingMoe ``(name, tensor)`` pairs, one parameter at a time (a
    stacked expert tensor becomes one tensor per expert). Contiguous tensors that own their memory (expert
    slices are cloned: safetensors refuses tensors that share storage), cast to ``dtype`` when given; a tensor
    already contiguous in ``dtype`` is passed through without a copy. Names are not checked here."""
    items = state.items() if isinstance(state, Mapping) else state
    for name, t in items:
        t = t.detach()
        if dtype is not None:
            t = t.to(dtype)
        m = _EXPERT_RE.match(name)
        if m:
            i, proj = m.groups()
            for e in range(t.shape[0]):
                yield f"model.layers.{i}.mlp.experts.{e}.{proj}.weight", t[e].clone(memory_format=torch.contiguous_format)
        else:
            (hf_name, _), = _hf_names(name, tuple(t.shape))
            yield hf_name, t.contiguous()


def to_hf_state_dict(state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Our full (unsharded) parameters -> BailingMoe names. ``state`` holds ``named_parameters`` names
    (``model.state_dict()`` works too: a tied ``lm_head.weight`` is dropped). Contiguous, owning tensors
    (expert slices are cloned), optionally cast to ``dtype``."""
    want = state_shapes(cfg)
    extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    _check_keys(state, want, "model state", extra)
    return dict(iter_hf_tensors(((name, state[name]) for name in want), dtype))


def hf_targets(cfg: ModelConfig) -> dict[str, tuple[str, int | None]]:
    """{BailingMoe name: (our parameter name, expert index or None)}: where each tensor of a BailingMoe
    directory goes in our model (expert ``e``'s weight is slice ``e`` of the stacked parameter)."""
    out: dict[str, tuple[str, int | None]] = {}
    for name, shape in state_shapes(cfg).items():
        m = _EXPERT_RE.match(name)
        for e, (hf_name, _) in enumerate(_hf_names(name, shape)):
            out[hf_name] = (name, e if m else None)
    return out


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], cfg: ModelConfig,
                       source: str | os.PathLike[str] = "state dict") -> dict[str, torch.Tensor]:
    """The exact inverse of :func:`to_hf_state_dict`: BailingMoe names -> our parameter names (experts
    stacked). With ``tie_word_embeddings`` a stray ``lm_head.weight`` is accepted and ignored."""
    want = hf_param_shapes(cfg)
    extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    _check_keys(hf, want, str(source), extra)
    out: dict[str, torch.Tensor] = {}
    for name, shape in state_shapes(cfg).items():
        m = _EXPERT_RE.match(name)
        if m:
            i, proj = m.groups()
            out[name] = torch.stack([hf[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] for e in range(shape[0])])
        else:
            (hf_name, _), = _hf_names(name, shape)
            out[name] = hf[hf_name]
    return out
