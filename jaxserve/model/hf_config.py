"""Reading a Hugging Face `config.json` into a `ModelConfig` (`load_config`, `config_from_hf`):
the fields every family shares, each family's own rules (`jaxserve.model.families`), the
rope in either layout (transformers 4.x top-level `rope_theta` / `rope_scaling`, 5.x
`rope_parameters`) and a pre-quantized checkpoint's `quantization_config`. Anything this
runtime cannot run faithfully is a `ValueError` naming the setting: a silently wrong model is
worse than none.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from jaxserve.model.config import (ACTIVATIONS, LAYER_TYPES, SUPPORTED_MODEL_TYPES,
                                   SUPPORTED_ROPE_TYPES, GemmaStyle, ModelConfig, MoEConfig,
                                   RopeConfig, WeightQuantization, as_eos_ids)
from jaxserve.model.families import FAMILIES, Family


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Translate a parsed Hugging Face `config.json` into a `ModelConfig`."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    family = FAMILIES[model_type]
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}; supported: {list(ACTIVATIONS)}")
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"]
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"config.json is missing required field(s) {missing}")
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    attention_bias = bool(hf.get("attention_bias", False))
    # Qwen2 always has q/k/v bias and no o bias; Llama's `attention_bias` covers q/k/v/o.
    qkv_bias = True if family.qkv_bias_always else attention_bias
    o_bias = attention_bias if family.o_bias else False
    moe, dense_layers = (None, ()) if family.moe is None else _read_moe(hf, family)
    sliding_window, layer_types = _read_layer_types(hf, family)
    gemma = family.gemma
    rope, local_rope = _read_ropes(hf, family)
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family.qk_norm or bool(hf.get("use_qk_norm")),
        attention_sinks=family.attention_sinks,
        sliding_window=sliding_window,
        layer_types=layer_types,
        local_rope=local_rope,
        hidden_act=ACTIVATIONS[act],
        gemma=GemmaStyle(float(hf.get("query_pre_attn_scalar") or head_dim),
                         # transformers' Gemma 3 keeps this field but never caps its scores
                         hf.get("attn_logit_softcapping") if family.caps_attention_scores
                         else None,
                         hf.get("final_logit_softcapping")) if gemma else None,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=as_eos_ids(hf.get("eos_token_id")),
        checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        quantization=checkpoint_quantization(hf),
        moe=moe,
        dense_layers=dense_layers,
    )


def _read_layer_types(hf: dict[str, Any], family: Family
                      ) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types): `layer_types` as transformers 5 writes it, else the
    family's rule (`Family.sliding_layers`; none slide without one). `()` when the layers are
    alike (no window, or all slide)."""
    window = hf.get("sliding_window")
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None and window is None:  # no family slides without a window
        return None, ()
    if types is None:
        sliding = ([False] * num_layers if family.sliding_layers is None
                   else family.sliding_layers(hf))
        types = ["sliding_attention" if s else "full_attention" for s in sliding]
    types = tuple(types)
    if len(types) != num_layers or set(types) - set(LAYER_TYPES):
        raise ValueError(f"layer_types must name one of {list(LAYER_TYPES)} for each of the "
                         f"{num_layers} layers, got {list(types)}")
    if "sliding_attention" not in types:
        return None, ()
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"sliding_window must be a positive integer for the layers "
                         f"layer_types makes sliding, got {window!r}")
    return window, () if set(types) == {"sliding_attention"} else types


def _read_ropes(hf: dict[str, Any], family: Family) -> tuple[RopeConfig, RopeConfig | None]:
    """(rope, local_rope): Gemma 3's sliding layers have their own rope, in transformers 5
    as `rope_parameters[layer type]`, in 4.x as `rope_local_base_freq`
    (`Family.local_rope_theta`; the global rope's `rope_scaling` applies to the
    full-attention layers only)."""
    params = hf.get("rope_parameters") or {}
    if set(params) & set(LAYER_TYPES):
        missing = sorted(set(LAYER_TYPES) - set(params))
        if missing:
            raise ValueError(f"rope_parameters is per layer type but lacks {missing}")
        return tuple(_read_rope({**hf, "rope_parameters": params[kind]})
                     for kind in ("full_attention", "sliding_attention"))
    if family.local_rope_theta is not None:
        return _read_rope(hf), RopeConfig(theta=family.local_rope_theta(hf))
    return _read_rope(hf), None


def _read_moe(hf: dict[str, Any], family: Family) -> tuple[MoEConfig, tuple[int, ...]]:
    """The experts of a mixture-of-experts family (`Family.moe`), and the layers that keep a
    dense MLP."""
    fields, dense = family.moe(hf)
    return MoEConfig(**fields), dense


def checkpoint_quantization(hf: dict[str, Any]) -> WeightQuantization | None:
    """The weight quantization a checkpoint was saved with (`quantization_config`), or None.

    Supported: `compressed-tensors` (what llm-compressor writes for most published FP8/INT8
    models) with one config group targeting `Linear`, 8-bit symmetric weights per channel or
    per tensor, float (fp8 e4m3) or int; its `ignore` list may name `lm_head` and the
    routers of a mixture of experts (which are never quantized here). The embedding is never
    quantized in this format. gpt-oss's MXFP4 experts load dequantized (None here:
    `jaxserve.loading.mxfp4`). Anything else is a `ValueError` naming the field."""
    qc = hf.get("quantization_config")
    fused_experts = FAMILIES.get(hf.get("model_type"), Family()).fused_experts
    if not qc or (qc.get("quant_method") == "mxfp4" and fused_experts):
        return None
    field = "quantization_config"
    if qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{field}.quant_method {qc.get('quant_method')!r} is not supported; "
                         "jaxserve reads 'compressed-tensors' checkpoints (int8/fp8 weights)")
    if qc.get("format") not in ("float-quantized", "int-quantized", "naive-quantized"):
        raise ValueError(f"{field}.format {qc.get('format')!r} is not supported; supported: "
                         "float-quantized, int-quantized, naive-quantized")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{field}.config_groups: exactly one group is supported, got "
                         f"{len(groups)}")
    group_name, group = next(iter(groups.items()))
    where = f"{field}.config_groups.{group_name}"
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{where}.targets must be ['Linear'], got {group.get('targets')!r}")
    weights = group.get("weights") or {}
    checks = {"num_bits": (8,), "type": ("float", "int"), "strategy": ("channel", "tensor"),
              "symmetric": (True,), "dynamic": (False, None)}
    for key, accepted in checks.items():
        if weights.get(key) not in accepted:
            raise ValueError(f"{where}.weights.{key} {weights.get(key)!r} is not supported; "
                             f"supported: {list(accepted)}")
    ignore = list(qc.get("ignore") or [])
    unsupported = [name for name in ignore if name != "lm_head" and not _names_routers(name)]
    if unsupported:
        raise ValueError(f"{field}.ignore may name only 'lm_head' and the routers (every "
                         f"other Linear is quantized here); got {unsupported}")
    skip = ("embed", "lm_head") if "lm_head" in ignore else ("embed",)
    return WeightQuantization("fp8" if weights["type"] == "float" else "int8", skip)


_ROUTERS = ("model.layers.0.mlp.gate", "model.layers.0.block_sparse_moe.gate")
_NOT_ROUTERS = ("model.layers.0.mlp.gate_proj", "model.layers.0.self_attn.q_proj",
                "model.layers.0.mlp.experts.0.gate_proj")


def _names_routers(entry: str) -> bool:
    """Whether a compressed-tensors `ignore` entry (a module name, or "re:" and a pattern)
    names mixture-of-experts routers and no other Linear."""
    if not entry.startswith("re:"):
        return re.fullmatch(r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.gate", entry) is not None
    pattern = entry[3:]
    try:
        return (any(re.fullmatch(pattern, name) for name in _ROUTERS)
                and not any(re.fullmatch(pattern, name) for name in _NOT_ROUTERS))
    except re.error:
        return False


def _read_rope(hf: dict[str, Any]) -> RopeConfig:
    """Rope settings from either layout: 5.x `rope_parameters` or 4.x top-level fields."""
    params = dict(hf.get("rope_parameters") or {})
    legacy_scaling = hf.get("rope_scaling") or {}
    if not params:
        params = dict(legacy_scaling)
        if "rope_theta" in hf:
            params["rope_theta"] = hf["rope_theta"]
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    partial = float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor")
                    or 1.0)
    if partial != 1.0:
        if rope_type != "default":
            raise ValueError(f"partial_rotary_factor {partial} with rope_type {rope_type!r} "
                             "is not supported")
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if params.get("factor") is None:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs a 'factor'")
    if rope_type == "yarn":
        return _read_yarn(params, theta, int(hf.get("max_position_embeddings", 2048)))
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    missing = [k for k in ("low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings") if k not in params]
    if missing:
        raise ValueError(f"rope_scaling of type 'llama3' is missing {missing}")
    return RopeConfig(
        theta=theta, rope_type="llama3", factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor` (0.1 · mscale · ln(factor) + 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _read_yarn(params: dict[str, Any], theta: float, max_positions: int) -> RopeConfig:
    """YaRN as transformers reads it: the original length defaults to the model's,
    `attention_factor` to the mscale of `factor` (or the ratio of `mscale`'s to
    `mscale_all_dim`'s when both are given); `truncate` defaults to true."""
    original = int(params.get("original_max_position_embeddings") or max_positions)
    factor = float(params["factor"])
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    return RopeConfig(theta=theta, rope_type="yarn", factor=factor,
                      original_max_position_embeddings=original,
                      beta_fast=float(params.get("beta_fast") or 32),
                      beta_slow=float(params.get("beta_slow") or 1),
                      truncate=bool(params.get("truncate", True)),
                      attention_factor=float(attention))


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `<model_dir>/config.json`; errors name the folder and the bad field."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model folder {str(model_dir)!r} has no config.json")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"config.json in {str(model_dir)!r} is not valid JSON: {err}") from err
    return config_from_hf(hf)
