"""Hugging Face ``save_pretrained`` directories, read as they are and written from tinylm models.

Pure state-dict and config mapping: this module never imports ``transformers`` except in
:func:`load_any`, for an architecture tinylm does not map, and only when asked.

What is read: ``config.json`` plus the weights, the first of

- ``model.safetensors``;
- ``model.safetensors.index.json`` and the shards its ``weight_map`` names (each a plain file
  name inside the directory);
- ``pytorch_model.bin`` (or ``pytorch_model.bin.index.json`` and its shards), read with
  ``torch.load(weights_only=True)``: nothing in the file is executed.

Nothing is ever downloaded: a path that is not a local directory (a hub name such as
``"gpt2"``) is refused. Every way a directory can be wrong ends in a one-line
:class:`~tinylm.errors.CheckpointError`; a configuration that has no exact counterpart on the
other side ends in :class:`MappingError`, whose message names the field and why.

Llama (``model_type`` "llama" and "mistral", grouped-query attention and Mistral's sliding window
included: ``num_kv_heads`` and ``sliding_window``) maps exactly onto tinylm's CS336 configuration:
pre-norm RMSNorm, SwiGLU (``gate_proj`` = w1,
``up_proj`` = w3, ``down_proj`` = w2), RoPE, optionally tied embeddings. The two rotate different
pairs of a head's dimensions: Hugging Face rotates (i, i + d_k/2) ("rotate_half"), tinylm rotates
(2k, 2k+1), both by the angle p * theta^(-2k/d_k) for pair k. So q and k rows are permuted within
each head (:func:`rope_permutation`): tinylm's row h d_k + 2k + j is Hugging Face's row
h d_k + k + j d_k/2 (j = 0, 1); k_proj likewise over its H_kv heads. q_i . k_j is a sum over the
same products in another order,
so both models compute the same function; v, the output projection and everything else are copied.
``attention_bias`` and ``mlp_bias`` map onto ``bias`` when they agree.

GPT-2 (``model_type`` "gpt2") maps onto tinylm's GPT-2 family: pre-norm LayerNorm with bias,
a non-gated MLP (``gelu_new`` = tinylm's "gelu_tanh"), learned positions, biases, usually tied
embeddings. Its ``Conv1D`` layers store weights as (in, out) with y = x W + b, so each is
transposed, and ``c_attn`` fuses q, k and v along its output: W = [W_q | W_k | W_v].

Writing (:func:`save_pretrained`) picks the GPT-2 layout for a LayerNorm model and the Llama
layout otherwise, and refuses what neither computes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from .checkpoint import (CheckpointInfo, _bounded_json, _check_file, _torch_load, _is_state_dict, _validate_state,
                         atomic_write)
from .config import ModelConfig
from .errors import CheckpointError, ConfigError, UnsafeCheckpointError
from .memory import check_model_fits
from .model import TransformerLM
from .validate import refuse

__all__ = ["MappingError", "rope_permutation", "config_from_hf", "hf_config", "from_hf_state", "to_hf_state",
           "read_config", "load", "load_any", "save_pretrained", "stored_dtype", "MAPPED_MODEL_TYPES"]

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PYTORCH_BIN, PYTORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, PYTORCH_BIN, PYTORCH_BIN_INDEX)  # read in this order
INSTALL_HF = 'pip install "tinylm[hf]"'


class MappingError(CheckpointError):
    """A configuration with no exact counterpart on the other side (a Hugging Face config that
    tinylm cannot compute exactly, or a tinylm config that no Hugging Face architecture has)."""


# --------------------------------------------------------------------------- RoPE pairing


def rope_permutation(d_model: int, num_heads: int) -> Tensor:
    """Row indices p with ``W_tinylm = W_hf[p]`` for a q or k projection (heads stacked along rows).

    p[h d_k + 2k + j] = h d_k + k + j d_k/2  for head h, pair k < d_k/2, j in {0, 1}:
    tinylm's adjacent pair (2k, 2k+1) is Hugging Face's rotate_half pair (k, k + d_k/2).
    The inverse (tinylm to Hugging Face) is ``argsort(p)``.
    """
    dk = d_model // num_heads
    k = torch.arange(dk // 2)
    within = torch.stack((k, k + dk // 2), dim=-1).flatten()  # (d_k,): 0, d_k/2, 1, d_k/2 + 1, ...
    return (torch.arange(num_heads)[:, None] * dk + within).flatten()  # (d_model,)


# --------------------------------------------------------------------------- families


@dataclass(frozen=True)
class _Family:
    """One Hugging Face architecture that maps exactly onto a tinylm configuration."""

    name: str
    model_types: tuple[str, ...]
    to_config: Callable[[dict[str, Any]], ModelConfig]  # config.json -> ModelConfig (or MappingError)
    to_hf_config: Callable[[ModelConfig], dict[str, Any]]  # ModelConfig -> config.json (or MappingError)
    from_hf: Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]  # HF keys -> tinylm keys
    to_hf: Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]]  # tinylm keys -> HF keys
    derived: re.Pattern  # HF buffers some files carry that the config determines (dropped on read)
    embed_key: str  # the HF key of the token embedding
    tied_key: str  # the HF key of the output matrix (absent, or equal to the embedding, when tied)


def _tie(state: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """A tinylm state dict as ``TransformerLM.state_dict()`` has it: a tied lm_head is the embedding."""
    if c.tie_embeddings:
        state["lm_head.weight"] = state["token_embeddings.weight"]
    return state


def _refuse(field: str, value: Any, why: str) -> NoReturn:
    """Refuse a config.json field that has no exact tinylm counterpart (a MappingError)."""
    refuse(f"{field}={value!r}: {why}", error=MappingError, argument=field)


def _field(cfg: dict[str, Any], name: str, kind: type = int) -> Any:
    value = cfg.get(name)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        refuse(f"{name}={value!r} is not an integer; config.json is damaged, save the model again", error=CheckpointError)
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        refuse(f"{name}={value!r} is not a number; config.json is damaged, save the model again", error=CheckpointError)
    return value


def _model_config(**fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        refuse(f"config.json maps onto an invalid tinylm config: {e}", error=MappingError)


# ---- Llama

_LLAMA_ROPE_KEYS = {"rope_type", "rope_theta"}


def _llama_theta(cfg: dict[str, Any]) -> float:
    """rope theta from ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x); scaling refused."""
    scaling = cfg.get("rope_scaling")
    if scaling is not None and (not isinstance(scaling, dict)
                                or scaling.get("rope_type", scaling.get("type")) != "default"):
        _refuse("rope_scaling", scaling, "tinylm's RoPE is unscaled (angles p * theta^(-2k/d_k))")
    params = cfg.get("rope_parameters")
    if params is None:
        return float(_field(cfg, "rope_theta", float)) if "rope_theta" in cfg else 10000.0
    if not isinstance(params, dict):
        _refuse("rope_parameters", params, "must be a dict; the file is damaged")
    if params.get("rope_type", "default") != "default":
        _refuse("rope_parameters.rope_type", params.get("rope_type"),
                "tinylm's RoPE is unscaled (angles p * theta^(-2k/d_k)), only rope_type 'default' maps")
    extra = sorted(set(params) - _LLAMA_ROPE_KEYS)
    if extra:
        _refuse("rope_parameters", params, f"{', '.join(extra)} change(s) RoPE, which tinylm does not")
    theta = _field(params, "rope_theta", float)
    if "rope_theta" in cfg and cfg["rope_theta"] != theta:
        _refuse("rope_theta", cfg["rope_theta"], f"disagrees with rope_parameters.rope_theta={theta}; "
                "fix config.json")
    return float(theta)


def _llama_config(cfg: dict[str, Any]) -> ModelConfig:
    d, heads = _field(cfg, "hidden_size"), _field(cfg, "num_attention_heads")
    kv = cfg.get("num_key_value_heads")
    if kv is not None:
        kv = _field(cfg, "num_key_value_heads")
        if kv < 1 or heads % kv:
            _refuse("num_key_value_heads", kv, f"does not divide num_attention_heads={heads}; grouped-query "
                    "attention needs whole groups of query heads")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and (d % heads or head_dim != d // heads):
        _refuse("head_dim", head_dim, f"differs from hidden_size/num_attention_heads={d}/{heads}; tinylm's "
                "head width is d_model/num_heads")
    attention_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        flag = "attention_bias" if attention_bias else "mlp_bias"
        _refuse(flag, True, "tinylm's bias switch gives the attention and the MLP projections biases together; "
                "only attention_bias == mlp_bias maps")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        _refuse("hidden_act", act, "tinylm's SwiGLU gates with silu")
    window = cfg.get("sliding_window") if cfg.get("model_type") == "mistral" else None  # Llama has none
    if window is not None:
        window = _field(cfg, "sliding_window")
        if window < 1:
            _refuse("sliding_window", window, "must be a positive number of positions (or null for none)")
        if window >= _field(cfg, "max_position_embeddings"):
            window = None  # never shorter than the context: every earlier position is read, as without one
    return _model_config(
        vocab_size=_field(cfg, "vocab_size"), context_length=_field(cfg, "max_position_embeddings"), d_model=d,
        num_layers=_field(cfg, "num_hidden_layers"), num_heads=heads, d_ff=_field(cfg, "intermediate_size"),
        rope_theta=_llama_theta(cfg), eps=float(_field(cfg, "rms_norm_eps", float)) if "rms_norm_eps" in cfg else 1e-6,
        norm="pre", norm_kind="rms", ffn="swiglu", positions="rope", bias=attention_bias,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_kv_heads=None if kv is None or kv == heads else kv, sliding_window=window)


def _require(c: ModelConfig, arch: str, **wanted: Any) -> None:
    """Each field of ``c`` as ``arch`` has it, else a MappingError naming the first that differs."""
    why = {
        "norm": f"Hugging Face {arch} is pre-norm",
        "ffn": f"Hugging Face {arch}'s MLP is {'SwiGLU (gate, up, down)' if arch == 'Llama' else 'non-gated'}",
        "positions": f"Hugging Face {arch} {'rotates q and k (RoPE)' if arch == 'Llama' else 'adds learned positions'}",
        "bias": f"Hugging Face {arch} has biases on every projection and LayerNorm",
        "qk_norm": f"Hugging Face {arch} normalises neither queries nor keys",
    }
    for name, allowed in wanted.items():
        value = getattr(c, name)
        if value not in allowed:
            _refuse(name, value, f"{why[name]}; this model has no Hugging Face equivalent")
    multipliers = (c.output_multiplier, c.attention_multiplier, c.branch_multiplier)
    if any(v != 1.0 for v in multipliers):  # muP away from its base width (at the base it is the standard model)
        _refuse("parametrization", c.parametrization, f"its logit, attention and branch multipliers "
                f"({', '.join(f'{v:g}' for v in multipliers)}) have no Hugging Face {arch} config field; "
                "this model has no Hugging Face equivalent (export it at its base width, or keep the tinylm checkpoint)")


def _llama_hf_config(c: ModelConfig) -> dict[str, Any]:
    _require(c, "Llama", norm=("pre",), ffn=("swiglu",), positions=("rope",), qk_norm=("none",))
    if c.sliding_window is not None and c.bias:
        _refuse("sliding_window", c.sliding_window, "Hugging Face Mistral (the Llama layout with a window) has no "
                "biases; this model has no Hugging Face equivalent")
    # a window is Mistral's (Llama has none): the same layout and keys, model_type "mistral"
    arch = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} if c.sliding_window is None else \
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": c.sliding_window}
    return {
        **arch,
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.d_ff,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "max_position_embeddings": c.context_length,
        "rms_norm_eps": c.eps, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_embeddings, "attention_bias": c.bias, "mlp_bias": c.bias,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }


# tinylm name in block i -> (HF name in block i, q/k rows permuted for the RoPE pairing); weights and biases
_LLAMA_NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
_LLAMA_LINEARS = {"attn.q_proj": ("self_attn.q_proj", True), "attn.k_proj": ("self_attn.k_proj", True),
                  "attn.v_proj": ("self_attn.v_proj", False), "attn.output_proj": ("self_attn.o_proj", False),
                  "ffn.w1": ("mlp.gate_proj", False), "ffn.w3": ("mlp.up_proj", False),
                  "ffn.w2": ("mlp.down_proj", False)}


def _llama_keys(c: ModelConfig) -> list[tuple[str, str, bool]]:
    """(tinylm key, HF key, permuted) for every tensor; lm_head left out when tied."""
    keys = [("token_embeddings.weight", "model.embed_tokens.weight", False),
            ("ln_final.weight", "model.norm.weight", False)]
    if not c.tie_embeddings:
        keys.append(("lm_head.weight", "lm_head.weight", False))
    for i in range(c.num_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        keys += [(f"{t}{k}.weight", f"{h}{v}.weight", False) for k, v in _LLAMA_NORMS.items()]
        params = ("weight", "bias") if c.bias else ("weight",)
        keys += [(f"{t}{k}.{p}", f"{h}{v}.{p}", perm) for k, (v, perm) in _LLAMA_LINEARS.items() for p in params]
    return keys


def _llama_perms(c: ModelConfig) -> dict[str, Tensor]:
    """The RoPE row permutation of q_proj (H heads) and k_proj (H_kv heads), by projection name."""
    return {"q_proj": rope_permutation(c.d_model, c.num_heads),
            "k_proj": rope_permutation(c.kv_heads * c.head_dim, c.kv_heads)}


def _llama_from_hf(state: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    perms = _llama_perms(c)
    return _tie({k: state[h][perms[k.split(".")[-2]]] if p else state[h] for k, h, p in _llama_keys(c)}, c)


def _llama_to_hf(state: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    inverse = {name: torch.argsort(p) for name, p in _llama_perms(c).items()}
    return {h: state[k][inverse[k.split(".")[-2]]] if p else state[k] for k, h, p in _llama_keys(c)}


_LLAMA = _Family("Llama", ("llama", "mistral"), _llama_config, _llama_hf_config, _llama_from_hf, _llama_to_hf,
                 re.compile(r"(^|\.)rotary_emb\.inv_freq$"), "model.embed_tokens.weight", "lm_head.weight")


# ---- GPT-2

#: HF activation_function -> tinylm ffn (gelu_new and gelu_pytorch_tanh are the same tanh formula)
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                     "silu": "silu", "swish": "silu"}
_GPT2_ACTIVATION_OF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def _gpt2_config(cfg: dict[str, Any]) -> ModelConfig:
    for flag, why in (("scale_attn_by_inverse_layer_idx", "scales layer i's scores by 1/(i+1) as well"),
                      ("add_cross_attention", "adds cross-attention to an encoder")):
        if cfg.get(flag, False):
            _refuse(flag, cfg[flag], f"{why}; tinylm's attention does not")
    if not cfg.get("scale_attn_weights", True):
        _refuse("scale_attn_weights", cfg["scale_attn_weights"], "tinylm scales the scores by 1/sqrt(d_k)")
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        _refuse("activation_function", act, f"tinylm's MLP activations are {', '.join(_GPT2_ACTIVATIONS)}")
    d = _field(cfg, "n_embd")
    inner = cfg.get("n_inner")
    return _model_config(
        vocab_size=_field(cfg, "vocab_size"), context_length=_field(cfg, "n_positions"), d_model=d,
        num_layers=_field(cfg, "n_layer"), num_heads=_field(cfg, "n_head"),
        d_ff=4 * d if inner is None else _field(cfg, "n_inner"),
        eps=float(_field(cfg, "layer_norm_epsilon", float)) if "layer_norm_epsilon" in cfg else 1e-5,
        norm="pre", norm_kind="layer", ffn=_GPT2_ACTIVATIONS[act], positions="learned", bias=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), init="gpt2")


def _gpt2_hf_config(c: ModelConfig) -> dict[str, Any]:
    _require(c, "GPT-2", norm=("pre",), ffn=tuple(_GPT2_ACTIVATION_OF), positions=("learned",), bias=(True,),
             qk_norm=("none",))
    if c.kv_heads != c.num_heads:
        _refuse("num_kv_heads", c.num_kv_heads, "Hugging Face GPT-2 has one key/value head per query head; "
                "this model has no Hugging Face equivalent")
    if c.sliding_window is not None:
        _refuse("sliding_window", c.sliding_window, "Hugging Face GPT-2 attends to every earlier position; "
                "this model has no Hugging Face equivalent")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": c.vocab_size, "n_positions": c.context_length, "n_embd": c.d_model, "n_layer": c.num_layers,
        "n_head": c.num_heads, "n_inner": c.d_ff, "activation_function": _GPT2_ACTIVATION_OF[c.ffn],
        "layer_norm_epsilon": c.eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": c.tie_embeddings, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }


# HF GPT-2's Conv1D stores a weight as (in, out), y = x W + b: tinylm's Linear weight (out, in) is its transpose.
# c_attn fuses q, k and v along its output dimension: W = [W_q | W_k | W_v] (in, 3 d).
_GPT2_NORMS = {"ln1": "ln_1", "ln2": "ln_2"}
_GPT2_LINEARS = {"attn.output_proj": "attn.c_proj", "ffn.w1": "mlp.c_fc", "ffn.w2": "mlp.c_proj"}
_GPT2_TOP = {"token_embeddings.weight": "transformer.wte.weight", "position_embeddings.weight": "transformer.wpe.weight",
             "ln_final.weight": "transformer.ln_f.weight", "ln_final.bias": "transformer.ln_f.bias"}


def _gpt2_from_hf(state: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    out = {k: state[h] for k, h in _GPT2_TOP.items()}
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(c.num_layers):
        t, h = f"layers.{i}.", f"transformer.h.{i}."
        for k, v in _GPT2_NORMS.items():
            out[f"{t}{k}.weight"], out[f"{t}{k}.bias"] = state[f"{h}{v}.weight"], state[f"{h}{v}.bias"]
        qkv_w = state[f"{h}attn.c_attn.weight"].t().chunk(3, dim=0)  # 3 x (d, d), (out, in)
        qkv_b = state[f"{h}attn.c_attn.bias"].chunk(3)  # 3 x (d,)
        for name, w, b in zip(("q_proj", "k_proj", "v_proj"), qkv_w, qkv_b):
            out[f"{t}attn.{name}.weight"], out[f"{t}attn.{name}.bias"] = w, b
        for k, v in _GPT2_LINEARS.items():
            out[f"{t}{k}.weight"], out[f"{t}{k}.bias"] = state[f"{h}{v}.weight"].t(), state[f"{h}{v}.bias"]
    return _tie(out, c)


def _gpt2_to_hf(state: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    out = {h: state[k] for k, h in _GPT2_TOP.items()}
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(c.num_layers):
        t, h = f"layers.{i}.", f"transformer.h.{i}."
        for k, v in _GPT2_NORMS.items():
            out[f"{h}{v}.weight"], out[f"{h}{v}.bias"] = state[f"{t}{k}.weight"], state[f"{t}{k}.bias"]
        names = [f"{t}attn.{n}" for n in ("q_proj", "k_proj", "v_proj")]
        out[f"{h}attn.c_attn.weight"] = torch.cat([state[n + ".weight"] for n in names], dim=0).t()  # (d, 3 d)
        out[f"{h}attn.c_attn.bias"] = torch.cat([state[n + ".bias"] for n in names])
        for k, v in _GPT2_LINEARS.items():
            out[f"{h}{v}.weight"], out[f"{h}{v}.bias"] = state[f"{t}{k}.weight"].t(), state[f"{t}{k}.bias"]
    return out


_GPT2 = _Family("GPT-2", ("gpt2",), _gpt2_config, _gpt2_hf_config, _gpt2_from_hf, _gpt2_to_hf,
                re.compile(r"\.attn\.(masked_)?bias$"), "transformer.wte.weight", "lm_head.weight")

_FAMILIES = (_LLAMA, _GPT2)
MAPPED_MODEL_TYPES = tuple(t for f in _FAMILIES for t in f.model_types)


def _family_of_hf(cfg: dict[str, Any]) -> _Family:
    model_type = cfg.get("model_type")
    for fam in _FAMILIES:
        if model_type in fam.model_types:
            return fam
    _refuse("model_type", model_type, f"tinylm maps only {', '.join(MAPPED_MODEL_TYPES)} exactly; "
            "tinylm.hf.load_any reads other architectures through transformers")


def _family_of(config: ModelConfig) -> _Family:
    """The Hugging Face layout a tinylm config is written in: GPT-2 for LayerNorm models, Llama otherwise."""
    return _GPT2 if config.norm_kind == "layer" else _LLAMA


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """The tinylm ``ModelConfig`` that computes exactly what a Hugging Face config.json describes,
    or a one-line :class:`MappingError` naming the field that has no tinylm counterpart."""
    if not isinstance(cfg, dict):
        refuse(f"config.json holds a {type(cfg).__name__}, not an object; the file is damaged", error=MappingError)
    return _family_of_hf(cfg).to_config(cfg)


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config.json (as a dict) of a tinylm config, or a one-line :class:`MappingError`
    naming the field with no Hugging Face equivalent (post-norm, no norm, a non-gated MLP with
    RMSNorm, NoPE, a LayerNorm model without biases, qk-norm)."""
    return _family_of(config).to_hf_config(config)


def from_hf_state(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """A Hugging Face state dict (or any complete dict of tensors under HF names) under tinylm's
    names, as ``TransformerLM(config).state_dict()`` has them (a tied lm_head is the embedding):
    a Llama's q/k rows permuted by :func:`rope_permutation`, GPT-2's Conv1D weights transposed
    and its fused c_attn split into q, k and v. Keys that are not HF names of ``config``'s model
    (derived buffers) are not read."""
    return _family_of(config).from_hf(state, config)


def to_hf_state(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The inverse of :func:`from_hf_state` (a tied lm_head is left out, as Hugging Face saves it)."""
    return _family_of(config).to_hf(state, config)


# --------------------------------------------------------------------------- reading a directory


def _local_dir(path: str | os.PathLike) -> Path:
    root = Path(path)
    if not root.exists():
        refuse(f"{path}: no such local directory; tinylm reads only local save_pretrained directories "
               "and never downloads (a hub name is not read): fetch the model yourself and pass its "
               "directory", error=CheckpointError)
    if not root.is_dir():
        refuse(f"{path}: not a directory; pass a save_pretrained directory (config.json and weights) "
               "or load a checkpoint file with tinylm.checkpoint.load", error=CheckpointError)
    if not (root / "config.json").is_file():
        refuse(f"{path}: no config.json, so not a save_pretrained directory; pass the directory "
               "that model.save_pretrained(...) wrote", error=CheckpointError)
    return root


def _read_json(path: Path, what: str) -> Any:
    _check_file(path)
    try:
        return _bounded_json(path.read_text(encoding="utf-8"), what, path)
    except (json.JSONDecodeError, UnicodeDecodeError):
        refuse(f"{path}: not valid JSON; the file is damaged, save the model again", error=CheckpointError)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The directory's config.json as a dict (the directory checked first: local, with a config)."""
    root = _local_dir(path)
    cfg = _read_json(root / "config.json", "config.json")
    if not isinstance(cfg, dict):
        refuse(f"{root / 'config.json'}: holds a {type(cfg).__name__}, not an object; the file is "
               "damaged, save the model again", error=CheckpointError)
    return cfg


def _weight_files(root: Path) -> tuple[str, dict[Path, list[str] | None]]:
    """(format, {file: the keys the index assigns it, or None for an unsharded file})."""
    found = next((name for name in WEIGHT_FILES if (root / name).is_file()), None)
    if found is None:
        refuse(f"{root}: no {', '.join(WEIGHT_FILES)}; the weights are missing, save the model "
               "again with save_pretrained", error=CheckpointError)
    fmt = "hf-safetensors" if found.startswith("model.") else "hf-pytorch-bin"
    if not found.endswith(".index.json"):
        return fmt, {root / found: None}
    index = _read_json(root / found, found)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        refuse(f"{root / found}: no weight_map of tensor names to files; the index is damaged", error=CheckpointError)
    shards: dict[Path, list[str]] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name or name.startswith(".") or not name:
            refuse(f"{root / found}: shard {name!r} of {key} is outside the directory; only plain "
                   "file names inside it are read", error=CheckpointError)
        shards.setdefault(root / name, []).append(key)
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        refuse(f"{root}: shard(s) {', '.join(missing[:3])} named by {found} are missing; copy the "
               "whole directory", error=CheckpointError)
    return fmt + "-sharded", shards


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype name)} from a safetensors header, no tensor data read."""
    from safetensors import safe_open

    _check_file(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out = {}
            for k in f.keys():
                s = f.get_slice(k)
                out[k] = (tuple(s.get_shape()), s.get_dtype())
            return out
    except Exception as e:
        refuse(f"{path}: corrupt safetensors file ({str(e).splitlines()[0][:120]}); save the model "
               "again", error=CheckpointError)


def _safetensors_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        refuse(f"{path}: corrupt safetensors file ({str(e).splitlines()[0][:120]}); save the model "
               "again", error=CheckpointError)


def _bin_tensors(path: Path) -> dict[str, Tensor]:
    _check_file(path)
    try:
        obj = _torch_load(path, unsafe=False)
    except UnsafeCheckpointError as e:
        names = str(e).split("(", 1)[1].split(")", 1)[0] if "(" in str(e) else "classes"
        refuse(f"{path}: holds pickled Python objects ({names}), which tinylm never executes; "
               "save the model again with save_pretrained (safetensors)", error=UnsafeCheckpointError)
    if not _is_state_dict(obj):
        refuse(f"{path}: holds a {type(obj).__name__}, not a state dict of tensors; save the model "
               "again with save_pretrained", error=CheckpointError)
    return obj


def _list(keys: list[str]) -> str:
    return f"{len(keys)} key(s): {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"


def _check_keys(root: Path, fam: _Family, config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """The file's keys and shapes against what config.json describes, before tensor data is read."""
    skeleton = TransformerLM(config, device="meta")
    expected = {k: tuple(v.shape) for k, v in fam.to_hf(skeleton.state_dict(), config).items()}
    given = {k: s for k, s in shapes.items() if not fam.derived.search(k)}
    if config.tie_embeddings:
        given.pop(fam.tied_key, None)  # saved by some versions beside a tied embedding; compared on read
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    if missing or unexpected:
        parts = ([f"missing {_list(missing)}"] if missing else []) + ([f"unexpected {_list(unexpected)}"] if unexpected else [])
        refuse(f"{root}: the weights do not match config.json ({'; '.join(parts)}); the directory is "
               "incomplete or config.json belongs to another model", error=CheckpointError)
    wrong = [f"{k} {given[k]} (config.json gives {s})" for k, s in expected.items() if given[k] != s]
    if wrong:
        refuse(f"{root}: shapes disagree with config.json: {'; '.join(wrong[:3])}"
               f"{' ...' if len(wrong) > 3 else ''}; the weights belong to another config", error=CheckpointError)


def load(path: str | os.PathLike) -> tuple[TransformerLM, CheckpointInfo]:
    """A tinylm model (eval mode) computing what the Hugging Face directory's model computes.

    ``path`` must be a local ``save_pretrained`` directory of a mapped architecture
    (:data:`MAPPED_MODEL_TYPES`). Order of checks: the directory, config.json and its mapping
    (:class:`MappingError` for what has no exact counterpart), the model's size against the
    available memory, the weights' keys and shapes (from safetensors headers, before any tensor
    data is read), then the tensors. ``info.format`` is "hf-safetensors", "hf-safetensors-sharded",
    "hf-pytorch-bin" or "hf-pytorch-bin-sharded".
    """
    root = _local_dir(path)
    cfg = read_config(root)
    try:
        fam = _family_of_hf(cfg)
        config = fam.to_config(cfg)
    except MappingError as e:
        refuse(f"{root / 'config.json'}: {e} (to measure it anyway, load it with transformers and pass "
               "the module to diagnostics.diagnose)", error=MappingError)
    except CheckpointError as e:
        refuse(f"{root / 'config.json'}: {e}", error=CheckpointError)
    fmt, files = _weight_files(root)
    if fmt.startswith("hf-safetensors"):
        headers = {}
        for file, assigned in files.items():
            header = _safetensors_header(file)
            if assigned is not None and set(header) != set(assigned):
                refuse(f"{file}: holds other tensors than {root.name}'s index assigns it; the "
                       "directory mixes two saves, save the model again", error=CheckpointError)
            headers.update(header)
        _check_keys(root, fam, config, {k: s for k, (s, _) in headers.items()})
        dtype = _ST_DTYPES.get(headers[fam.embed_key][1], torch.float32)
        check_model_fits(config, dtype, "cpu")
        state: dict[str, Tensor] = {}
        for file in files:
            state.update(_safetensors_tensors(file))
    else:
        check_model_fits(config, torch.float16, "cpu")  # the least it can take (2 bytes a weight), before reading
        state = {}
        for file in files:
            state.update(_bin_tensors(file))
        _check_keys(root, fam, config, {k: tuple(v.shape) for k, v in state.items()})
    if config.tie_embeddings and fam.tied_key in state:
        if not torch.equal(state[fam.tied_key], state[fam.embed_key]):
            refuse(f"{root}: config.json ties the embeddings but {fam.tied_key} differs from "
                   f"{fam.embed_key}; set tie_word_embeddings to false or save the model again", error=CheckpointError)
    ours = fam.from_hf(state, config)
    emb = ours["token_embeddings.weight"]
    model = TransformerLM(config, device="meta", dtype=emb.dtype if emb.is_floating_point() else torch.float32)
    _validate_state(model, ours, str(root))
    model.materialize("cpu")
    model.load_state_dict(ours, strict=True)
    model.eval()
    # the init the weights were drawn from is transformers', not config.init's placeholder scheme
    model.declared_init = {"source": "config.json", "initializer_range": cfg.get("initializer_range"),
                           "scaled_residual": fam is _GPT2}
    info = CheckpointInfo(str(root), fmt, "stored", extra={"model_type": cfg.get("model_type")})
    info.nonfinite = [k for k, v in model.named_parameters() if not torch.isfinite(v).all()]
    return model, info


def stored_dtype(path: str | os.PathLike) -> torch.dtype | None:
    """The dtype a directory's weights are saved in: config.json's ``dtype`` (``torch_dtype`` in
    older files), else the first tensor's in the safetensors header; None if neither tells."""
    root = _local_dir(path)
    cfg = read_config(root)
    for key in ("dtype", "torch_dtype"):
        name = cfg.get(key)
        if isinstance(name, str) and isinstance(getattr(torch, name.removeprefix("torch."), None), torch.dtype):
            return getattr(torch, name.removeprefix("torch."))
    st = root / SAFETENSORS
    if st.is_file():
        header = _safetensors_header(st)
        kinds = [_ST_DTYPES[kind] for _, kind in header.values() if kind in _ST_DTYPES]
        return kinds[0] if kinds else None
    return None


def load_any(path: str | os.PathLike) -> tuple[nn.Module, CheckpointInfo]:
    """A mapped architecture as a tinylm model (:func:`load`); any other causal LM, and a mapped
    type whose config tinylm cannot compute exactly (``info.extra["unmapped"]`` says why), through
    ``transformers`` (``AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
    trust_remote_code=False)``, imported only here), in its stored dtype (:func:`stored_dtype`),
    in eval mode, ``info.format`` "hf-transformers".

    A config that names custom code (``auto_map``) is refused: tinylm never runs it.
    """
    root = _local_dir(path)
    cfg = read_config(root)
    unmapped = None
    if cfg.get("model_type") in MAPPED_MODEL_TYPES:
        try:
            config_from_hf(cfg)
        except MappingError as e:
            unmapped = str(e)  # a config tinylm cannot compute exactly: transformers reads it as it is
        else:
            return load(root)
    model_type = cfg.get("model_type")
    if "auto_map" in cfg:
        refuse(f"{root}: config.json names custom modelling code (auto_map); tinylm never runs remote "
               "code (trust_remote_code=False): use a model whose architecture transformers ships", error=CheckpointError)
    try:
        import transformers
    except ImportError:
        refuse(f"{root}: model_type {model_type!r} is read through transformers, which is not "
               f"installed; {INSTALL_HF}", error=CheckpointError)
    try:
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # reading a local file: no progress bar on stderr
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(root, local_files_only=True,
                                                                      trust_remote_code=False)
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        if "trust_remote_code" in first or "remote code" in first:
            refuse(f"{root}: needs remote code, which tinylm never runs (trust_remote_code=False); "
                   "use a model whose architecture transformers ships", error=CheckpointError)
        refuse(f"{root}: transformers cannot load it as a causal LM ({type(e).__name__}: {first}); "
               "check the directory", error=CheckpointError)
    stored = stored_dtype(root)
    if stored is not None and stored.is_floating_point:
        model.to(stored)  # as saved, whatever default this transformers version loads in
    model.eval()
    extra = {"model_type": model_type, **({"unmapped": unmapped} if unmapped else {})}
    info = CheckpointInfo(str(root), "hf-transformers", "stored", extra=extra)
    info.nonfinite = [k for k, v in model.named_parameters() if not torch.isfinite(v).all()]
    return model, info


# --------------------------------------------------------------------------- writing a directory


def save_pretrained(model: TransformerLM, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write ``model`` as a Hugging Face directory (config.json and model.safetensors) that
    ``transformers`` loads as the same function (GPT-2 layout for a LayerNorm model, Llama
    layout for the CS336 configuration).

    A configuration with no Hugging Face equivalent is refused (:class:`MappingError`) before
    anything is written. A directory that exists and is not empty is refused unless ``force``;
    with ``force`` only config.json and model.safetensors are replaced (each atomically) and other
    files are left as they are. Training settings with no counterpart (``dropout``, the ``init``
    scheme's name) are not carried. Returns the directory.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        refuse("save_pretrained() needs a tinylm TransformerLM (a model with a ModelConfig in .config)", error=ConfigError)
    fam = _family_of(config)
    cfg = fam.to_hf_config(config)
    root = Path(path)
    if root.exists() and not root.is_dir():
        refuse(f"{path}: exists and is a file; give a directory for config.json and model.safetensors", error=CheckpointError)
    if root.is_dir() and any(root.iterdir()) and not force:
        refuse(f"{path}: exists and is not empty; choose an empty or new directory, or pass force=True "
               "to replace its config.json and model.safetensors", error=CheckpointError)
    state = fam.to_hf(model.state_dict(), config)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    cfg["dtype"] = str(model.token_embeddings.weight.dtype).removeprefix("torch.")
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / SAFETENSORS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))

    def write_config(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")

    atomic_write(root / "config.json", write_config)
    return root
