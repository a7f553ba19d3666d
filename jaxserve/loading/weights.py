"""Load Hugging Face safetensors weights into a `LlamaModel`.

Reads `model.safetensors` or a sharded `model.safetensors.index.json` folder, one tensor at a
time (memory-mapped), converts each from HF's `[out, in]` layout to the model's, casts it to
the target dtype and places it on device(s), so the host holds about one tensor at a time
beyond what the devices hold.

With a mesh (`load_weights(..., mesh=mesh)`) each tensor goes straight to its shards:
`jax.make_array_from_callback` asks for one device's slice at a time, which is cut from the
host tensor and cast, so no device ever holds more than its shard and no full device copy of
the model exists. `shard_model` applies the same rules to a model already on device
(gpt-fast style: the model is built mesh-agnostic, sharding comes after). When
tensor_parallel_size exceeds the kv heads, both repeat k/v heads as
`sharding.kv_head_repeats` describes, and the model's config reports the stored head count.

Tensors are read as views of the memory-mapped files (`mapped_tensors`), not copied out.

Quantized models (`cfg.quantization`): a float tensor of a quantized weight is quantized on
the host as it is read (`jaxserve.model.quantization.quantize_on_host`, from the whole
tensor, so per-channel scales do not depend on the sharding, in slabs of output channels, so
the float32 temporaries stay small) and placed as codes plus scale; a checkpoint that is
already quantized (compressed-tensors: int8/fp8 `*.weight` with `*.weight_scale`) is placed
as it is, its scales reshaped to the kernel's output axes. Activation scales it carries
(`*.input_scale`) are not used: activations are quantized per token when at all. gpt-oss's
MXFP4 experts (`*_blocks` with `*_scales`) are dequantized as they load
(`jaxserve.loading.mxfp4`).

Missing, unexpected or wrongly shaped tensors raise `ValueError` naming the tensor; pickle
checkpoints (`*.bin`, `*.pt`, `*.pth`) are refused: loading them can run arbitrary code.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

import sharding
from jaxserve.loading import mxfp4
from jaxserve.model.config import ModelConfig
from jaxserve.model.families import FAMILIES
from jaxserve.model import LlamaModel
from jaxserve.model.quantization import (CONTRACTED_AXES, STORAGE_DTYPES, quantize_on_host,
                                         quantizes, scale_path)

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
    e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hf = f"model.layers.{i}."
    ours = ("layers", i)

    def heads_in(h):  # [h*D, E] → [E, h, D]
        return lambda w: w.T.reshape(e, h, d)

    entries = {
        **(_moe_entries(cfg, i) if cfg.sparse_layer(i) else _mlp_entries(cfg, i)),
        hf + "self_attn.q_proj.weight": (ours + ("attn", "q_proj"), heads_in(hq), (hq * d, e)),
        hf + "self_attn.k_proj.weight": (ours + ("attn", "k_proj"), heads_in(hkv), (hkv * d, e)),
        hf + "self_attn.v_proj.weight": (ours + ("attn", "v_proj"), heads_in(hkv), (hkv * d, e)),
        hf + "self_attn.o_proj.weight": (ours + ("attn", "o_proj"),
                                         lambda w: w.T.reshape(hq, d, e), (e, hq * d)),
        hf + "input_layernorm.weight": (ours + ("input_norm", "weight"), None, (e,)),
    }
    if cfg.gemma is None:
        entries[hf + "post_attention_layernorm.weight"] = (
            ours + ("post_attention_norm", "weight"), None, (e,))
    else:  # Gemma's post_attention_layernorm norms the attention's output
        for theirs, mine in (("post_attention_layernorm", "attn_output_norm"),
                             ("pre_feedforward_layernorm", "post_attention_norm"),
                             ("post_feedforward_layernorm", "mlp_output_norm")):
            entries[hf + f"{theirs}.weight"] = (ours + (mine, "weight"), None, (e,))
    if cfg.qkv_bias:
        for name, h in (("q", hq), ("k", hkv), ("v", hkv)):
            entries[hf + f"self_attn.{name}_proj.bias"] = (
                ours + ("attn", f"{name}_bias"), lambda w, h=h: w.reshape(h, d), (h * d,))
    if cfg.o_bias:
        entries[hf + "self_attn.o_proj.bias"] = (ours + ("attn", "o_bias"), None, (e,))
    if cfg.attention_sinks:
        entries[hf + "self_attn.sinks"] = (ours + ("attn", "sinks"), None, (hq,))
    if cfg.qk_norm:
        entries[hf + "self_attn.q_norm.weight"] = (ours + ("attn", "q_norm", "weight"), None, (d,))
        entries[hf + "self_attn.k_norm.weight"] = (ours + ("attn", "k_norm", "weight"), None, (d,))
    return entries


def _mlp_entries(cfg: ModelConfig, i: int, part: str = "", width: int | None = None
                 ) -> dict[str, tuple[tuple, Callable, tuple]]:
    """The dense MLP's tensors of layer i (`part`: a MoE's shared experts, `width` wide)."""
    e, m = cfg.hidden_size, width or cfg.intermediate_size
    hf = f"model.layers.{i}.mlp." + (f"{part}." if part else "")
    ours = ("layers", i, "mlp") + (("shared",) if part else ())
    entries = {hf + "gate_proj.weight": (ours + ("gate_proj",), np.transpose, (m, e)),
               hf + "up_proj.weight": (ours + ("up_proj",), np.transpose, (m, e)),
               hf + "down_proj.weight": (ours + ("down_proj",), np.transpose, (e, m))}
    if cfg.mlp_bias:
        for name, size in (("gate", m), ("up", m), ("down", e)):
            entries[hf + f"{name}_proj.bias"] = (ours + (f"{name}_bias",), None, (size,))
    return entries


# Mixture-of-experts checkpoints: (prefix, router, expert gate, up, down) per family.
class ExpertSlot(tuple):
    """The model path of a stacked expert weight and the expert a checkpoint tensor fills:
    `(path, expert, num_experts)`. The loader gathers a weight's experts, then places it."""


class Interleaved(tuple):
    """The model paths of two weights a checkpoint tensor holds interleaved on its last axis
    (gpt-oss's `gate_up_proj`: gate in the even columns, up in the odd ones)."""


def _gpt_oss_moe_entries(cfg: ModelConfig, i: int) -> dict[str, tuple]:
    """gpt-oss's router (with bias) and stacked experts of layer i, stored `[in, out]` per
    expert as the model keeps them, gate and up interleaved in one tensor."""
    e, x, m = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.intermediate_size
    hf, ours = f"model.layers.{i}.mlp.", ("layers", i, "mlp")
    return {
        hf + "router.weight": (ours + ("router",), np.transpose, (x, e)),
        hf + "router.bias": (ours + ("router_bias",), None, (x,)),
        hf + "experts.gate_up_proj": (Interleaved((ours + ("gate_proj",), ours + ("up_proj",))),
                                      None, (x, e, 2 * m)),
        hf + "experts.gate_up_proj_bias": (Interleaved((ours + ("gate_bias",),
                                                        ours + ("up_bias",))), None, (x, 2 * m)),
        hf + "experts.down_proj": (ours + ("down_proj",), None, (x, m, e)),
        hf + "experts.down_proj_bias": (ours + ("down_bias",), None, (x, e)),
    }


def _moe_entries(cfg: ModelConfig, i: int) -> dict[str, tuple]:
    """The router and every expert's tensors of layer i; an expert's tensor maps to its
    slot of the stacked `[X, ...]` weight (`ExpertSlot`)."""
    family = FAMILIES[cfg.model_type]
    if family.fused_experts:
        return _gpt_oss_moe_entries(cfg, i)
    e, x, m = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.intermediate_size
    prefix, router, gate, up, down = family.expert_names
    hf, ours = f"model.layers.{i}.{prefix}", ("layers", i, "mlp")
    entries: dict[str, tuple] = {hf + f"{router}.weight": (ours + ("router",), np.transpose,
                                                           (x, e))}
    for j in range(x):
        for name, ours_name, shape in ((gate, "gate_proj", (m, e)), (up, "up_proj", (m, e)),
                                       (down, "down_proj", (e, m))):
            entries[hf + f"experts.{j}.{name}.weight"] = (
                ExpertSlot((ours + (ours_name,), j, x)), np.transpose, shape)
    if cfg.moe.scoring == "sigmoid":
        entries[hf + f"{router}.e_score_correction_bias"] = (ours + ("correction_bias",),
                                                            None, (x,))
    if cfg.moe.shared_experts:
        entries.update(_mlp_entries(cfg, i, "shared_experts", m * cfg.moe.shared_experts))
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


# safetensors dtype names → numpy (and ml_dtypes) types
_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
           "F16": np.dtype(np.float16), "BF16": jnp.dtype(jnp.bfloat16),
           "F8_E4M3": jnp.dtype(jnp.float8_e4m3fn), "F8_E5M2": jnp.dtype(jnp.float8_e5m2),
           "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
           "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
           "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}


def safetensors_header(file: Path) -> tuple[int, dict]:
    """(data offset, {name: {"dtype", "shape", "data_offsets"}}) of a safetensors file, whose
    layout is `[8-byte little-endian header length][JSON header][data]`, checked against the
    file's size (`ValueError` naming the file)."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        header_length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 <= header_length <= size - 8:
            raise ValueError(f"{file.name} is not a safetensors file (size {size} bytes)")
        try:
            header = json.loads(handle.read(header_length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{file.name}: safetensors header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file.name}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return 8 + header_length, header


def mapped_tensors(file: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of a safetensors file, in file order, each a read-only
    view of the memory-mapped file: no copy is made until the tensor is converted.

    Read from the format's own header, not with safetensors' numpy reader: that one copies
    every tensor out of the file (a second host copy of the largest tensor while it loads)
    and cannot return float8 (it looks the type up on numpy, which has none; ml_dtypes
    defines them)."""
    offset, header = safetensors_header(file)
    data_bytes = file.stat().st_size - offset
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=offset) if data_bytes else None
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype, shape = _DTYPES.get(entry["dtype"]), tuple(entry["shape"])
        if dtype is None:
            raise ValueError(f"{file.name}: tensor {name!r} has dtype {entry['dtype']}, which "
                             f"jaxserve does not read; known: {sorted(_DTYPES)}")
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= data_bytes or end - begin != dtype.itemsize * int(
                np.prod(shape)):
            raise ValueError(f"{file.name}: tensor {name!r} ({entry['dtype']} {list(shape)}) "
                             f"has data_offsets [{begin}, {end}] that do not fit it or the file")
        if begin == end:
            yield name, np.zeros(shape, dtype)
            continue
        yield name, data[begin:end].view(dtype).reshape(shape)


def _default_placer(dtypes: dict[tuple, np.dtype]) -> Placer:
    # cast on the host (the device never holds a float32 copy of a bfloat16 weight), into a
    # copy: on CPU, device_put may alias a numpy array, and this one is a view of the file
    return lambda array, path: jax.device_put(np.array(array, dtype=dtypes[path], copy=True))


def param_dtypes(cfg: ModelConfig, dtype) -> dict[tuple, np.dtype]:
    """Model path → the dtype each parameter is stored in (the compute dtype, or int8/fp8
    codes and float32 scales for quantized weights)."""
    _, state = nnx.split(abstract_model(cfg, dtype))
    return {path: var.get_value().dtype for path, var in nnx.to_flat_state(state)}


def sharded_config(cfg: ModelConfig, mesh: Mesh) -> tuple[ModelConfig, int]:
    """The config of the model as stored on `mesh` (kv heads repeated when tp > Hkv), and
    the repeat count."""
    repeats = sharding.kv_head_repeats(cfg.num_kv_heads, cfg.num_heads,
                                       sharding.tensor_parallel_size(mesh))
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * repeats), repeats


def abstract_model(cfg: ModelConfig, dtype, scan_layers: bool = False) -> LlamaModel:
    """The model's structure, shapes and `logical_axes`, with no memory allocated: a fresh
    copy (callers fill it in) of one traced per (cfg, dtype, scan_layers). Tracing the
    model's construction takes seconds for an 8B model (about 12 s on 2 CPU cores), and
    loading asks for its shapes, dtypes and shardings several times."""
    graphdef, state = _abstract_split(cfg, jnp.dtype(dtype), scan_layers)
    return nnx.merge(graphdef, state, copy=True)


@functools.lru_cache(maxsize=8)
def _abstract_split(cfg: ModelConfig, dtype, scan_layers: bool):
    return nnx.split(nnx.eval_shape(lambda: LlamaModel(cfg, dtype, rngs=nnx.Rngs(0),
                                                       scan_layers=scan_layers)))


def abstract_sharded_model(cfg: ModelConfig, dtype, mesh: Mesh,
                           scan_layers: bool = False) -> LlamaModel:
    """The model as the engine would hold it on `mesh`, every parameter a
    `jax.ShapeDtypeStruct` carrying its sharding (no memory anywhere): what `jaxserve plan`
    compiles against. `cfg` is the checkpoint's own config."""
    stored, _ = sharded_config(cfg, mesh)
    shardings = param_shardings(stored, dtype, mesh, scan_layers)
    graphdef, state = nnx.split(abstract_model(stored, dtype, scan_layers))
    variables = dict(nnx.to_flat_state(state))
    for path, var in variables.items():
        value = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=shardings[path]))
    return nnx.merge(graphdef, nnx.from_flat_state(variables))


def param_shardings(cfg: ModelConfig, dtype, mesh: Mesh,
                    scan_layers: bool = False) -> dict[tuple, NamedSharding]:
    """Model path → NamedSharding of every parameter of a model with config `cfg` (as
    stored on the mesh, see `sharded_config`)."""
    _, state = nnx.split(abstract_model(cfg, dtype, scan_layers))
    return {path: sharding.named_sharding(var.get_metadata()["logical_axes"],
                                          var.get_value().shape, mesh)
            for path, var in nnx.to_flat_state(state)}


def stack_layers(model: LlamaModel) -> LlamaModel:
    """`model` (list layout, on device) in the stacked layout of `scan_layers=True`.

    Each stacked parameter is allocated once with the layer's sharding plus a replicated
    "layers" axis and filled in place one layer at a time; each per-layer array is deleted as
    soon as it is copied, so `model` is consumed and the transient cost is one stacked
    parameter, not a second copy of the model."""
    if model.scan_layers:
        return model
    cfg, dtype = model.config, model.compute_dtype
    graphdef, state = nnx.split(abstract_model(cfg, dtype, scan_layers=True))
    stacked = dict(nnx.to_flat_state(state))
    per_layer = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}
    write = jax.jit(lambda stack, layer, i: jax.lax.dynamic_update_index_in_dim(
        stack, layer, i, 0), donate_argnums=0)
    period, groups = cfg.scan_period, cfg.scan_groups
    for path, var in stacked.items():
        if path[0] == "tail":  # layer groups * period + t, as it is
            var.set_value(per_layer.pop(("layers", groups * period + path[1], *path[2:])))
            continue
        if path[0] != "layers":
            var.set_value(per_layer.pop(path))
            continue
        position, rest = path[1], path[2:]  # stack `position`: layers position + g * period
        first = per_layer[("layers", position, *rest)]
        shape, var_dtype = var.get_value().shape, var.get_value().dtype
        stacked_sharding = sharding.named_sharding(var.get_metadata()["logical_axes"], shape,
                                                   first.sharding.mesh)
        buffer = jax.jit(lambda shape=shape, var_dtype=var_dtype: jnp.zeros(shape, var_dtype),
                         out_shardings=stacked_sharding)()
        for group in range(groups):
            layer = per_layer.pop(("layers", group * period + position, *rest))
            buffer = write(buffer, layer, jnp.int32(group))
            layer.delete()
        var.set_value(buffer)
    return nnx.merge(graphdef, nnx.from_flat_state(stacked))


def kv_axis(path: tuple) -> int | None:
    """The kv-heads axis of a parameter (k/v projections and biases), else None."""
    name = path[-1]
    if name in ("k_proj", "v_proj"):
        return 1  # [E, Hkv, D]
    if name in ("k_bias", "v_bias", "k_proj_scale", "v_proj_scale"):
        return 0  # [Hkv, D]
    return None


def sharded_placer(cfg: ModelConfig, dtype, mesh: Mesh) -> Placer:
    """A `Placer` that builds each parameter shard by shard on `mesh` (kv heads repeated as
    `sharded_config` says); `cfg` is the checkpoint's own config."""
    stored, repeats = sharded_config(cfg, mesh)
    shardings = param_shardings(stored, dtype, mesh)
    dtypes = param_dtypes(stored, dtype)

    def place(array: np.ndarray, path: tuple) -> jax.Array:
        axis = kv_axis(path)
        shape = list(array.shape)
        if axis is not None:
            shape[axis] *= repeats
        return sharding.shard_loader(
            lambda index: sharding.repeated_kv_slice(array, index, axis, repeats).astype(
                dtypes[path]),
            tuple(shape), shardings[path])

    return place


def shard_model(model: LlamaModel, mesh: Mesh) -> LlamaModel:
    """`model` with every parameter placed on `mesh` by the partition rules (a no-op for a
    model already loaded onto that mesh); kv heads are repeated if tp needs it."""
    stored, repeats = sharded_config(model.config, mesh)
    dtype = model.compute_dtype
    shardings = param_shardings(stored, dtype, mesh)
    graphdef, state = nnx.split(model)
    variables = dict(nnx.to_flat_state(state))
    for path, var in variables.items():
        value, axis = var.get_value(), kv_axis(path)
        if axis is not None:
            value = sharding.repeat_kv_heads(value, repeats, axis, shardings[path])
        else:
            value = jax.device_put(value, shardings[path])
        variables[path] = var.replace(value)  # new Variable
    sharded = nnx.merge(graphdef, nnx.from_flat_state(variables))
    sharded.config = stored
    return sharded


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype=jnp.float32,
                 place: Placer | None = None, progress: bool = True,
                 mesh: Mesh | None = None) -> LlamaModel:
    """Build a `LlamaModel` whose parameters come from the folder's safetensors files.

    `place` decides where each converted tensor goes (default: the default device, in the
    parameter's dtype); with `mesh`, each device receives only its shard (`sharded_placer`)
    and the model's config is the one stored on the mesh (`sharded_config`).
    """
    model_cfg = cfg
    if mesh is not None:
        place = sharded_placer(cfg, dtype, mesh)
        model_cfg, _ = sharded_config(cfg, mesh)
    place = place or _default_placer(param_dtypes(model_cfg, dtype))
    model = abstract_model(model_cfg, dtype)
    graphdef, state = nnx.split(model)
    variables = dict(nnx.to_flat_state(state))
    expected = hf_tensor_map(cfg)
    scales = _scale_entries(cfg, expected) if cfg.quantization else {}
    scale_names: dict[tuple, list[str]] = {}  # model path of a scale → its HF names
    for name, (path, _) in scales.items():
        scale_names.setdefault(path[0] if isinstance(path, ExpertSlot) else path,
                               []).append(name)
    files = safetensors_files(model_dir)
    seen: set[str] = set()
    experts = _ExpertStacks()
    packed = mxfp4.PackedPairs()  # gpt-oss's MXFP4 experts, dequantized as they load

    def store(path: tuple, array: np.ndarray) -> None:
        """Place one model weight (quantized first if the model stores it so)."""
        if quantizes(cfg, path[-1]) and array.dtype not in STORAGE_DTYPES.values():
            array, scale = quantize_on_host(array, cfg.quantization.method,
                                            CONTRACTED_AXES[path[-1]])
            variables[scale_path(path)].set_value(place(scale, scale_path(path)))
            seen.update(scale_names.get(scale_path(path), ()))
        variables[path].set_value(place(array, path))

    with tqdm(total=len(expected), desc="Loading weights", unit="tensor",
              disable=not progress) as bar:
        for file in files:
            for name, array in mapped_tensors(file):
                if name in scales or (name.endswith(".input_scale") and scales):
                    if name in scales:
                        path, transform = scales[name]
                        array = transform(array)
                        if isinstance(path, ExpertSlot):
                            path, array = experts.add(path, array)
                        if array is not None:
                            variables[path].set_value(place(array, path))
                        seen.add(name)
                    continue
                if mxfp4.PackedPairs.base_name(name) in expected:
                    array = packed.add(name, array)
                    if array is None:
                        continue
                    name = mxfp4.PackedPairs.base_name(name)
                if name not in expected:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # some exporters keep the tied copy; the embedding is used
                    raise ValueError(f"unexpected tensor {name!r} in {file.name}")
                path, transform, hf_shape = expected[name]
                if tuple(array.shape) != hf_shape:
                    raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)}, "
                                     f"expected {hf_shape} from config.json")
                if transform is not None:
                    array = transform(array)
                if isinstance(path, ExpertSlot):
                    path, array = experts.add(path, array)
                    seen.add(name)
                    bar.update(1)
                    if array is None:
                        continue
                if isinstance(path, Interleaved):
                    for part, half in zip(path, (array[..., 0::2], array[..., 1::2])):
                        store(part, np.ascontiguousarray(half))
                else:
                    store(path, array)
                if name not in seen:
                    seen.add(name)
                    bar.update(1)
    missing = sorted(set(expected) - seen) + sorted(set(scales) - seen)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        raise ValueError(f"model folder {str(model_dir)!r} is missing tensor(s) {shown}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return nnx.merge(graphdef, nnx.from_flat_state(variables))


class _ExpertStacks:
    """Gathers each stacked expert weight on the host until all its experts have loaded."""

    def __init__(self):
        self.stacks: dict[tuple, np.ndarray] = {}
        self.filled: dict[tuple, int] = {}

    def add(self, slot: ExpertSlot, array: np.ndarray) -> tuple[tuple, np.ndarray | None]:
        """(model path, the whole `[X, ...]` weight once its last expert arrived, else None)."""
        path, expert, count = slot
        if path not in self.stacks:
            self.stacks[path] = np.empty((count, *array.shape), array.dtype)
            self.filled[path] = 0
        self.stacks[path][expert] = array
        self.filled[path] += 1
        if self.filled[path] < count:
            return path, None
        return path, self.stacks.pop(path)


def _scale_entries(cfg: ModelConfig, expected: dict) -> dict[str, tuple[tuple, Callable]]:
    """HF scale name (`<weight>_scale`) → (model path, HF→model transform) for every
    weight the model stores quantized. The checkpoint either holds them (pre-quantized: one
    value per output channel, `[out, 1]`, or per tensor, `[1]` / `[]`) or they are made from
    the float weight as it loads. An expert's scale maps to its slot of the stacked scale
    (`ExpertSlot`)."""
    _, state = nnx.split(abstract_model(cfg, jnp.float32))
    shapes = {path: var.get_value().shape for path, var in nnx.to_flat_state(state)}
    entries = {}
    for name, (path, _, _) in expected.items():
        if isinstance(path, Interleaved):  # only ever quantized as it loads
            continue
        slot = path if isinstance(path, ExpertSlot) else None  # one expert's of a stack
        if slot is not None:
            path = slot[0]
        if not quantizes(cfg, path[-1]):
            continue
        model_shape = shapes[scale_path(path)][1 if slot else 0:]
        out_channels = int(np.prod(model_shape))

        def to_model(scale, name=name, model_shape=model_shape, out_channels=out_channels):
            flat = np.asarray(scale, np.float32).reshape(-1)
            if flat.size not in (1, out_channels):
                raise ValueError(f"tensor {name + '_scale'!r} has {flat.size} values; expected "
                                 f"1 (per tensor) or {out_channels} (per output channel)")
            return np.broadcast_to(flat, (out_channels,)).reshape(model_shape)

        target = scale_path(path) if slot is None else ExpertSlot(
            (scale_path(path), slot[1], slot[2]))
        entries[name + "_scale"] = (target, to_model)
    return entries
