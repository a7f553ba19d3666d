"""Save a `LlamaModel` as a Hugging Face model folder (config.json + model.safetensors).

Tensor names and layouts come from `jaxserve.loading.weights.hf_tensor_map`, the loader's own
table, so they live in one place. Each loader transform there is a reshape/transpose of an HF
tensor, i.e. a permutation of its elements: applying it to `arange(size)` shaped like the HF
tensor tells where every HF element lands in the model's array, and scattering the model's
array back through that permutation inverts it, whatever the transform is.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxserve.model.config import ModelConfig
from jaxserve.model import LlamaModel
from jaxserve.loading.weights import hf_tensor_map

SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def to_hf_layout(array: np.ndarray, transform, hf_shape: tuple) -> np.ndarray:
    """Invert the loader's `transform` (HF → model) for one tensor: model layout → HF layout."""
    if transform is None:
        return array.reshape(hf_shape)
    where = np.asarray(transform(np.arange(array.size).reshape(hf_shape)))  # model-shaped
    if where.shape != array.shape:
        raise ValueError(f"array of shape {array.shape} does not match the loader's layout "
                         f"{where.shape} for HF shape {hf_shape}")
    flat = np.empty(array.size, array.dtype)
    flat[where.ravel()] = array.ravel()
    return flat.reshape(hf_shape)


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    """A `config.json` for `LlamaForCausalLM` that `config_from_hf` reads back as `cfg`."""
    if cfg.model_type != "llama" or cfg.qkv_bias != cfg.o_bias or cfg.qk_norm:
        raise ValueError("save_hf_folder writes model_type 'llama' configs only "
                         "(attention_bias covers q, k, v and o together, no q/k norm)")
    rope = {"rope_type": cfg.rope.rope_type, "rope_theta": cfg.rope.theta}
    if cfg.rope.rope_type != "default":
        rope["factor"] = cfg.rope.factor
    if cfg.rope.rope_type == "llama3":
        rope.update(low_freq_factor=cfg.rope.low_freq_factor,
                    high_freq_factor=cfg.rope.high_freq_factor,
                    original_max_position_embeddings=cfg.rope.original_max_position_embeddings)
    eos = list(cfg.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "dtype": dtype,
    }


def save_hf_folder(model: LlamaModel, cfg: ModelConfig, folder: str | Path,
                   dtype: str = "float32") -> None:
    """Write `config.json` and `model.safetensors` (HF names and layouts, `dtype`) to `folder`."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {list(SAVE_DTYPES)}, got {dtype!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    variables = dict(nnx.to_flat_state(nnx.state(model)))
    tensors = {}
    for name, (path, transform, hf_shape) in hf_tensor_map(cfg).items():
        array = np.asarray(variables[path].get_value(), dtype=np.float32)
        tensors[name] = np.ascontiguousarray(
            to_hf_layout(array, transform, hf_shape).astype(SAVE_DTYPES[dtype]))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
