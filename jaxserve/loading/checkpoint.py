"""Orbax checkpoints of a model: convert once from Hugging Face safetensors, then restore
straight into any mesh's sharding.

A checkpoint folder is self-contained:

    CKPT/jaxserve_checkpoint.json   marker: format, version, parameter dtype
    CKPT/params/                    orbax (tensorstore) arrays, one per model parameter,
                                    keyed "layers.0.attn.q_proj", in the model's own layout
    CKPT/config.json, tokenizer*, generation_config.json, ...   copied from the HF folder

Arrays are saved unsharded-logical (as the model defines them, kv heads not repeated), so a
checkpoint written on one mesh restores onto any other: `restore` asks orbax for each
parameter with its target `NamedSharding`, and every device reads only its own chunk. When
tensor_parallel_size exceeds the kv heads, k/v projections are read whole onto each device
(they are small) and repeated on device into their sharded layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import sharding

from jaxserve.model.config import ModelConfig, load_config, resolve_dtype
from jaxserve.model import LlamaModel
from jaxserve.loading.weights import (abstract_model, kv_axis, load_weights, param_shardings,
                                      sharded_config)

MARKER = "jaxserve_checkpoint.json"
FORMAT, VERSION = "jaxserve-orbax", 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")


def is_checkpoint(folder: str | Path) -> bool:
    """Whether `folder` is a checkpoint written by `convert`."""
    return (Path(folder) / MARKER).is_file()


def _key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def convert(model_dir: str | Path, out_dir: str | Path, dtype: str | None = None,
            progress: bool = True) -> Path:
    """Write the Hugging Face model folder `model_dir` as an orbax checkpoint in `out_dir`
    (created; must not exist or be empty). `dtype` "float32" / "bfloat16" (default: the
    checkpoint's own, float16 stored as bfloat16). Returns the output folder.

    Tensors are read one at a time and kept on the host (numpy), never on a device.
    """

    src, out = Path(model_dir), Path(out_dir).absolute()
    if not src.is_dir():
        raise ValueError(f"model_dir {str(model_dir)!r} is not a folder")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"out_dir {str(out_dir)!r} exists and is not empty")
    cfg = load_config(src)
    jdtype = resolve_dtype(dtype or "auto", cfg.checkpoint_dtype)
    name = jnp.dtype(jdtype).name
    host = lambda array, path: np.asarray(array, dtype=jnp.dtype(jdtype))  # noqa: E731
    model = load_weights(src, cfg, jdtype, place=host, progress=progress)
    params = {_key(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) \
                and file.name != "model.safetensors.index.json":
            shutil.copy2(file, out / file.name)
    hf_config = json.loads((src / "config.json").read_text())
    hf_config["torch_dtype"] = hf_config["dtype"] = name  # what "auto" should restore
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    import orbax.checkpoint as ocp  # here: importing orbax costs every start ~0.3 s

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / "params", params)
        checkpointer.wait_until_finished()
    (out / MARKER).write_text(json.dumps({"format": FORMAT, "version": VERSION,
                                          "dtype": name}))
    return out


def restore(ckpt_dir: str | Path, cfg: ModelConfig, dtype, mesh: Mesh) -> LlamaModel:
    """A `LlamaModel` restored from a `convert` checkpoint directly onto `mesh` (as
    `jaxserve.loading.weights.shard_model` would place it), cast to `dtype`."""
    folder = Path(ckpt_dir).absolute()
    marker = json.loads((folder / MARKER).read_text())
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ValueError(f"{folder / MARKER} is not a {FORMAT} v{VERSION} checkpoint: {marker}")
    stored, repeats = sharded_config(cfg, mesh)
    shardings = param_shardings(stored, dtype, mesh)
    _, logical = nnx.split(abstract_model(cfg, dtype))  # shapes as saved
    target = {}
    for path, var in nnx.to_flat_state(logical):
        sh, axis = shardings[path], kv_axis(path)
        if axis is not None and repeats > 1:  # read whole kv heads, repeat on device below
            sh = sharding.named_sharding(var.get_metadata()["logical_axes"],
                                         var.get_value().shape, mesh, replicate=("kv_heads",))
        target[_key(path)] = jax.ShapeDtypeStruct(var.get_value().shape, dtype, sharding=sh)
    import orbax.checkpoint as ocp  # here: importing orbax costs every start ~0.3 s

    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(folder / "params", target)
    model = abstract_model(stored, dtype)
    graphdef, state = nnx.split(model)
    variables = dict(nnx.to_flat_state(state))
    for path, var in variables.items():
        value, axis = arrays.pop(_key(path)), kv_axis(path)
        if axis is not None and repeats > 1:
            value = sharding.repeat_kv_heads(value, repeats, axis, shardings[path])
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(variables))
