"""Load Hugging Face safetensors weights into a `LlamaModel`.

Reads `model.safetensors` or a sharded `model.safetensors.index.json` folder, one tensor at a
time (memory-mapped), converts each from HF's `[out, in]` layout to the model's, casts it to
the target dtype and places it on device, so peak host memory stays near one copy of the
weights. Missing, unexpected or wrongly shaped tensors raise `ValueError` naming the tensor;
pickle checkpoints (`*.bin`, `*.pt`, `*.pth`) are refused: loading them can run arbitrary code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig
from jaxserve.model import LlamaModel

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# place(array, model_path) -> jax.Array: puts a converted host tensor on device(s).
Placer = Callable[[np.ndarray, tuple], jax.Array]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model folder, in index order; refuses pickle-only folders."""
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"model.safetensors.index.json lists missing file(s) {missing}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"model folder {str(model_dir)!r} holds only pickle weights {pickles}; jaxserve "
            "loads safetensors only (pickle can execute code). Convert with "
            "transformers: model.save_pretrained(dir, safe_serialization=True)")
    raise ValueError(f"model folder {str(model_dir)!r} has no *.safetensors weights")


def _layer_entries(cfg: ModelConfig, i: int) -> dict[str, tuple[tuple, Callable, tuple]]:
    """HF tensor name → (model path, HF→model transform, expected HF shape) for layer i."""
    e, hq, hkv, d, m = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size)
    hf = f"model.layers.{i}."
    ours = ("layers", i)

    def heads_in(h):  # [h*D, E] → [E, h, D]
        return lambda w: w.T.reshape(e, h, d)

    entries = {
        hf + "self_attn.q_proj.weight": (ours + ("attn", "q_proj"), heads_in(hq), (hq * d, e)),
        hf + "self_attn.k_proj.weight": (ours + ("attn", "k_proj"), heads_in(hkv), (hkv * d, e)),
        hf + "self_attn.v_proj.weight": (ours + ("attn", "v_proj"), heads_in(hkv), (hkv * d, e)),
        hf + "self_attn.o_proj.weight": (ours + ("attn", "o_proj"),
                                         lambda w: w.T.reshape(hq, d, e), (e, hq * d)),
        hf + "mlp.gate_proj.weight": (ours + ("mlp", "gate_proj"), np.transpose, (m, e)),
        hf + "mlp.up_proj.weight": (ours + ("mlp", "up_proj"), np.transpose, (m, e)),
        hf + "mlp.down_proj.weight": (ours + ("mlp", "down_proj"), np.transpose, (e, m)),
        hf + "input_layernorm.weight": (ours + ("input_norm", "weight"), None, (e,)),
        hf + "post_attention_layernorm.weight": (ours + ("post_attention_norm", "weight"),
                                                 None, (e,)),
    }
    if cfg.qkv_bias:
        for name, h in (("q", hq), ("k", hkv), ("v", hkv)):
            entries[hf + f"self_attn.{name}_proj.bias"] = (
                ours + ("attn", f"{name}_bias"), lambda w, h=h: w.reshape(h, d), (h * d,))
    if cfg.o_bias:
        entries[hf + "self_attn.o_proj.bias"] = (ours + ("attn", "o_bias"), None, (e,))
    if cfg.mlp_bias:
        for name, size in (("gate", m), ("up", m), ("down", e)):
            entries[hf + f"mlp.{name}_proj.bias"] = (ours + ("mlp", f"{name}_bias"), None, (size,))
    if cfg.qk_norm:
        entries[hf + "self_attn.q_norm.weight"] = (ours + ("attn", "q_norm", "weight"), None, (d,))
        entries[hf + "self_attn.k_norm.weight"] = (ours + ("attn", "k_norm", "weight"), None, (d,))
    return entries


def hf_tensor_map(cfg: ModelConfig) -> dict[str, tuple[tuple, Callable | None, tuple]]:
    """Every HF tensor name the model needs → (model path, transform, expected HF shape)."""
    v, e = cfg.vocab_size, cfg.hidden_size
    entries = {
        "model.embed_tokens.weight": (("embed",), None, (v, e)),
        "model.norm.weight": (("final_norm", "weight"), None, (e,)),
    }
    if not cfg.tie_word_embeddings:
        entries["lm_head.weight"] = (("lm_head",), np.transpose, (v, e))
    for i in range(cfg.num_layers):
        entries.update(_layer_entries(cfg, i))
    return entries


def _default_placer(dtype) -> Placer:
    return lambda array, path: jax.device_put(jnp.asarray(array, dtype=dtype))


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype=jnp.float32,
                 place: Placer | None = None, progress: bool = True) -> LlamaModel:
    """Build a `LlamaModel` whose parameters come from the folder's safetensors files.

    `place` decides where each converted tensor goes (default: the default device, cast to
    `dtype`); the sharded loader passes one that puts each device only its shard.
    """
    place = place or _default_placer(dtype)
    model = nnx.eval_shape(lambda: LlamaModel(cfg, dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    variables = dict(nnx.to_flat_state(state))
    expected = hf_tensor_map(cfg)
    files = safetensors_files(model_dir)
    seen: set[str] = set()
    with tqdm(total=len(expected), desc="Loading weights", unit="tensor",
              disable=not progress) as bar:
        for file in files:
            with safe_open(str(file), framework="numpy") as reader:
                for name in reader.keys():
                    if name not in expected:
                        if name == "lm_head.weight" and cfg.tie_word_embeddings:
                            continue  # some exporters keep the tied copy; the embedding is used
                        raise ValueError(f"unexpected tensor {name!r} in {file.name}")
                    path, transform, hf_shape = expected[name]
                    array = reader.get_tensor(name)
                    if tuple(array.shape) != hf_shape:
                        raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)}, "
                                         f"expected {hf_shape} from config.json")
                    if transform is not None:
                        array = transform(array)
                    variables[path].set_value(place(array, path))
                    seen.add(name)
                    bar.update(1)
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        raise ValueError(f"model folder {str(model_dir)!r} is missing tensor(s) {shown}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return nnx.merge(graphdef, nnx.from_flat_state(variables))
