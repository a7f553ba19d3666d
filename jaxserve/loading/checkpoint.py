"""Orbax checkpoints of a model: convert once from Hugging Face safetensors, then restore
straight into any mesh's sharding.

A checkpoint folder is self-contained:

    CKPT/jaxserve_checkpoint.json   marker: format, version, parameter dtype, quantization
    CKPT/params/                    orbax (tensorstore) arrays, one per model parameter,
                                    keyed "layers.0.attn.q_proj", in the model's own layout
    CKPT/config.json, tokenizer*, generation_config.json, ...   copied from the HF folder

Arrays are saved unsharded-logical (as the model defines them, kv heads not repeated), so a
checkpoint written on one mesh restores onto any other: `restore` asks orbax for each
parameter with its target `NamedSharding`, and every device reads only its own chunk. When
tensor_parallel_size exceeds the kv heads, k/v projections are read whole onto each device
(they are small) and repeated on device into their sharded layout.

Quantized weights (`jaxserve.model.quantization`) take two routes:
- **saved quantized** (`convert(..., quantization="int8")`, or a compressed-tensors folder):
  the int8/fp8 codes and float32 scales are the saved arrays, restored as they are. The
  marker records the scheme; config.json loses its `quantization_config`, which describes
  Hugging Face's tensor layout, not this one. The fast path for restarts.
- **quantized on restore** (an unquantized checkpoint loaded with `quantization=`): each
  weight to quantize is restored alone, in its saved dtype and with its target sharding,
  quantized on the devices and freed, so the devices hold the quantized model plus one float
  weight at most.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import sharding

from jaxserve.loading.hub import resolve_model
from jaxserve.model.config import ModelConfig, WeightQuantization, resolve_dtype, with_quantization
from jaxserve.model.hf_config import load_config
from jaxserve.model import LlamaModel
from jaxserve.model.quantization import CONTRACTED_AXES, quantize, quantizes, scale_path
from jaxserve.loading.weights import (abstract_model, kv_axis, load_weights, param_dtypes,
                                      param_shardings, sharded_config)

MARKER = "jaxserve_checkpoint.json"
FORMAT, VERSION = "jaxserve-orbax", 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")


def is_checkpoint(folder: str | Path) -> bool:
    """Whether `folder` is a checkpoint written by `convert`."""
    return (Path(folder) / MARKER).is_file()


def _key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _read_marker(folder: Path) -> dict:
    marker = json.loads((folder / MARKER).read_text())
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ValueError(f"{folder / MARKER} is not a {FORMAT} v{VERSION} checkpoint: {marker}")
    return marker


def saved_quantization(folder: str | Path) -> WeightQuantization | None:
    """The weight quantization a checkpoint's arrays were saved in (None: float weights)."""
    return _marked_quantization(_read_marker(Path(folder).absolute()))


def _marked_quantization(marker: dict) -> WeightQuantization | None:
    saved = marker.get("quantization")
    return None if saved is None else WeightQuantization(saved["method"],
                                                         tuple(saved.get("skip", ())))


def model_config(model_dir: str | Path) -> ModelConfig:
    """The config of a Hugging Face folder or a `convert` checkpoint (whose weights may be
    saved quantized: the marker says so, not config.json)."""
    cfg = load_config(model_dir)
    if is_checkpoint(model_dir):
        marker = _read_marker(Path(model_dir).absolute())
        if "quantization" not in marker and cfg.quantization is not None:
            raise ValueError(f"{model_dir}: this checkpoint was converted from a quantized "
                             "folder by an older jaxserve, which did not record how its "
                             "arrays are stored; run `jaxserve convert` on that folder again")
        cfg = dataclasses.replace(cfg, quantization=_marked_quantization(marker))
    return cfg


def convert(model_dir: str | Path, out_dir: str | Path, dtype: str | None = None,
            quantization: str | None = None, progress: bool = True) -> Path:
    """Write the Hugging Face model folder `model_dir` as an orbax checkpoint in `out_dir`
    (created; must not exist or be empty). `dtype` "float32" / "bfloat16" (default: the
    checkpoint's own, float16 stored as bfloat16). `quantization` "int8" / "fp8" saves the
    weights quantized (a compressed-tensors folder is saved quantized as it is). Returns the
    output folder.

    Tensors are read (and quantized) one at a time and kept on the host (numpy), never on a
    device.
    """

    src, out = resolve_model(model_dir), Path(out_dir).absolute()
    if not src.is_dir():
        raise ValueError(f"model_dir {str(model_dir)!r} is not a folder")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"out_dir {str(out_dir)!r} exists and is not empty")
    cfg = with_quantization(load_config(src), quantization)
    jdtype = resolve_dtype(dtype or "auto", cfg.checkpoint_dtype)
    name = jnp.dtype(jdtype).name
    dtypes = param_dtypes(cfg, jdtype)  # codes and scales keep their own dtypes
    host = lambda array, path: np.asarray(array, dtype=dtypes[path])  # noqa: E731
    model = load_weights(src, cfg, jdtype, place=host, progress=progress)
    params = {_key(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) \
                and file.name != "model.safetensors.index.json":
            shutil.copy2(file, out / file.name)
    hf_config = json.loads((src / "config.json").read_text())
    hf_config["torch_dtype"] = hf_config["dtype"] = name  # what "auto" should restore
    hf_config.pop("quantization_config", None)  # the marker says how the arrays are stored
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    import orbax.checkpoint as ocp  # here: importing orbax costs every start ~0.3 s

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / "params", params)
        checkpointer.wait_until_finished()
    quant = cfg.quantization
    saved = None if quant is None else {"method": quant.method, "skip": list(quant.skip)}
    (out / MARKER).write_text(json.dumps({"format": FORMAT, "version": VERSION,
                                          "dtype": name, "quantization": saved}))
    return out


def restore(ckpt_dir: str | Path, cfg: ModelConfig, dtype, mesh: Mesh) -> LlamaModel:
    """A `LlamaModel` restored from a `convert` checkpoint directly onto `mesh` (as
    `jaxserve.loading.weights.shard_model` would place it), float weights cast to `dtype`.

    A checkpoint saved quantized restores its own scheme (`cfg.quantization` may add
    quantized activations, or name the same method); one saved unquantized is quantized into
    `cfg.quantization`, if any, as its weights are restored."""
    folder = Path(ckpt_dir).absolute()
    marker = _read_marker(folder)
    saved = _marked_quantization(marker)
    if saved is not None:
        if cfg.quantization is not None and cfg.quantization.method != saved.method:
            raise ValueError(f"quantization={cfg.quantization.method!r}: this checkpoint is "
                             f"saved quantized ({saved.method})")
        activations = cfg.quantization is not None and cfg.quantization.activations
        cfg = dataclasses.replace(cfg, quantization=dataclasses.replace(
            saved, activations=activations))
    stored, repeats = sharded_config(cfg, mesh)
    shardings = param_shardings(stored, dtype, mesh)
    dtypes = param_dtypes(stored, dtype)
    _, logical = nnx.split(abstract_model(cfg, dtype))  # shapes as saved, kv not repeated
    logical_vars = dict(nnx.to_flat_state(logical))

    def target(path: tuple, dtype) -> jax.ShapeDtypeStruct:
        var = logical_vars[path]
        sh = shardings[path]
        if kv_axis(path) is not None and repeats > 1:  # whole kv heads, repeated below
            sh = sharding.named_sharding(var.get_metadata()["logical_axes"],
                                         var.get_value().shape, mesh, replicate=("kv_heads",))
        return jax.ShapeDtypeStruct(var.get_value().shape, dtype, sharding=sh)

    quantize_here = [path for path in logical_vars if saved is None and quantizes(cfg, path[-1])]
    scale_paths = {scale_path(path) for path in quantize_here}
    as_saved = {_key(path): target(path, dtypes[path]) for path in logical_vars
                if path not in scale_paths and path not in quantize_here}
    import orbax.checkpoint as ocp  # here: importing orbax costs every start ~0.3 s

    with ocp.PyTreeCheckpointer() as checkpointer:
        on_disk = set(checkpointer.metadata(folder / "params").item_metadata.tree)
        wanted = set(as_saved) | {_key(path) for path in quantize_here}
        if on_disk != wanted:
            raise ValueError(f"{folder}: the checkpoint's arrays are not this model's: missing "
                             f"{sorted(wanted - on_disk)[:5]}, unexpected "
                             f"{sorted(on_disk - wanted)[:5]}")

        def read(targets: dict) -> dict:
            return checkpointer.restore(folder / "params", args=ocp.args.PyTreeRestore(
                item=targets, restore_args=ocp.checkpoint_utils.construct_restore_args(targets),
                partial_restore=True))

        arrays = read(as_saved)
        quantizers = {}  # one program per (weight kind, shardings)
        for path in quantize_here:
            scale_at = scale_path(path)
            weight_target = target(path, jnp.dtype(marker["dtype"]))
            kind = (path[-1], weight_target.sharding, target(scale_at, jnp.float32).sharding)
            if kind not in quantizers:
                quantizers[kind] = jax.jit(functools.partial(
                    quantize, method=cfg.quantization.method,
                    contracted=CONTRACTED_AXES[path[-1]], xp=jnp), out_shardings=kind[1:])
            weight = read({_key(path): weight_target})[_key(path)]
            arrays[_key(path)], arrays[_key(scale_at)] = quantizers[kind](weight)
            weight.delete()
    model = abstract_model(stored, dtype)
    graphdef, state = nnx.split(model)
    variables = dict(nnx.to_flat_state(state))
    for path, var in variables.items():
        value, axis = arrays.pop(_key(path)), kv_axis(path)
        if axis is not None and repeats > 1:
            value = sharding.repeat_kv_heads(value, repeats, axis, shardings[path])
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(variables))
