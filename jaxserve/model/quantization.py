"""Weight quantization: int8 and fp8 kernels with one scale per output channel.

A quantized weight is two parameters: the kernel `w` in int8 or float8_e4m3fn, in the model's
own layout, and `w_scale` in float32 with the kernel's output axes (e.g. q_proj `[E, Hq, D]`
→ scale `[Hq, D]`; the embedding `[V, E]` is scaled per row, `[V]`, which serves both the
lookup and tied logits). Contracted axes count from the end, so a stack of kernels on a
leading axis (a mixture's experts, gate_proj `[X, E, I]` → scale `[X, I]`: one scale per
expert and output channel) shares its name with the single kernel. The real weight is
`w * w_scale`, broadcast over the contracted axes, so with per-output-channel scales a
matmul can use the narrow kernel and scale after:

    x @ (w * s) == (x @ w) * s

- **Weights only** (default): `w` is widened to the compute dtype inside the matmul; XLA fuses
  the convert into the dot's operand on TPU and GPU, so HBM reads the 8-bit bytes.
- **Activations too** (`WeightQuantization.activations`): each token's activations are
  quantized the same way (absmax over the contracted axis), the dot runs int8 x int8 → int32
  (TPU v5e/v6e MXU, GPU IMMA) or fp8 x fp8 → float32 (H100/H200), and both scales apply after.

Scales are symmetric absmax (`pallas_kernels.absmax`, shared with the int8 KV cache): int8
maps the channel's largest |w| to 127 (codes -127..127), fp8 e4m3 to 448 (its largest finite
value). A zero channel gets scale 1.

Why not qwix: its PTQ provider intercepts `dot_general`/`einsum` calls made by Flax modules on
their own parameters. This model reads raw `nnx.Param`s (`self.q_proj[...]`, reshaped for
o_proj) so qwix kept every weight in float32 and quantized it again inside every call
(tried with qwix 0.1.8: same parameter bytes, logits off by up to 0.4%); adopting it would
mean rebuilding the model on `nnx.Linear`/`nnx.Einsum` and loading through qwix's own param
tree, which the sharded one-tensor-at-a-time loader and the plan's abstract model do not go
through.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import fixed_order
from jaxserve.model.config import ModelConfig, WeightQuantization
from pallas_kernels import absmax

STORAGE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
# weight name → its contracted axes, counted from the last, in the model's layout
# (`jaxserve.model.llama`; `jaxserve.model.moe` stacks experts' kernels on a leading axis)
CONTRACTED_AXES = {"q_proj": (-3,), "k_proj": (-3,), "v_proj": (-3,), "o_proj": (-3, -2),
                   "gate_proj": (-2,), "up_proj": (-2,), "down_proj": (-2,), "lm_head": (-2,),
                   "embed": (-1,)}
SCALE_SUFFIX = "_scale"


def quantizes(cfg: ModelConfig, name: str) -> bool:
    """Whether the model of `cfg` stores weight `name` quantized."""
    return (cfg.quantization is not None and name in CONTRACTED_AXES
            and cfg.quantization.covers(name))


def contracted_axes(name: str, ndim: int) -> tuple[int, ...]:
    """Weight `name`'s contracted axes in a kernel of `ndim` axes, counted from the first."""
    return tuple(ndim + axis for axis in CONTRACTED_AXES[name])


def weight_param(cfg: ModelConfig, name: str, rngs: nnx.Rngs, shape, dtype, axes
                 ) -> tuple[nnx.Param, nnx.Param | None]:
    """(kernel, scale) parameters of weight `name` with logical `axes`, randomly initialised:
    scale None unless `cfg` quantizes the weight, in which case the kernel holds the codes
    and the scale has the kernel's output axes."""
    value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
    if not quantizes(cfg, name):
        return nnx.Param(value.astype(dtype), logical_axes=axes), None
    contracted = contracted_axes(name, len(shape))
    codes, scale = quantize(value, cfg.quantization.method, contracted, xp=jnp)
    out_axes = tuple(axis for i, axis in enumerate(axes) if i not in contracted)
    return (nnx.Param(codes, logical_axes=axes), nnx.Param(scale, logical_axes=out_axes))


def scale_path(path: tuple) -> tuple:
    """The model path of the scale of the weight at `path` (`<name>_scale` beside it)."""
    return path[:-1] + (path[-1] + SCALE_SUFFIX,)


def scale_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of weight `name`'s scale: its shape without the contracted axes."""
    contracted = contracted_axes(name, len(shape))
    return tuple(size for axis, size in enumerate(shape) if axis not in contracted)


def quantize(value, method: str, contracted: tuple[int, ...], xp: Any = np):
    """(codes, scale) of `value`: codes in the method's storage dtype with `value`'s shape,
    float32 scale with the contracted axes removed. `xp`: numpy (the loader, on the host) or
    jax.numpy (in a program)."""
    return absmax.quantize(value, STORAGE_DTYPES[method], contracted, xp)


def quantize_on_host(value: np.ndarray, method: str, contracted: tuple[int, ...],
                     chunk_bytes: int = 16 << 20) -> tuple[np.ndarray, np.ndarray]:
    """`quantize(value, ...)` with numpy, a slab of output channels at a time: the same codes
    and scales (each scale covers one output channel), but the float32 temporaries are one
    slab of about `chunk_bytes`, not several copies of the whole tensor. What the loader
    uses, so quantizing a weight as it loads costs little more host memory than its codes."""
    contracted = tuple(axis % value.ndim for axis in contracted)
    axis = next(a for a in range(value.ndim) if a not in contracted)  # first output axis
    count = value.shape[axis]
    per_channel = 4 * value.size // max(1, count)  # float32 bytes of one slice along `axis`
    step = max(1, chunk_bytes // max(1, per_channel))
    codes = np.empty(value.shape, STORAGE_DTYPES[method])
    scale = np.empty([size for a, size in enumerate(value.shape) if a not in contracted],
                     np.float32)
    for start in range(0, count, step):
        rows = (slice(None),) * axis + (slice(start, start + step),)
        codes[rows], scale[start:start + step] = quantize(value[rows], method, contracted)
    return codes, scale


def dequantize(codes, scale, contracted: tuple[int, ...]) -> np.ndarray:
    """The float32 weight that `codes` and `scale` stand for (host; tests and tools)."""
    return np.asarray(codes, np.float32) * np.expand_dims(np.asarray(scale, np.float32),
                                                          contracted)


def project(spec: str, x: jax.Array, kernel: jax.Array, scale: jax.Array | None,
            quant: WeightQuantization | None) -> jax.Array:
    """`jnp.einsum(spec, x, weight)` for a kernel stored plainly (`scale` None) or quantized.
    The kernel's output axes must be the result's last axes (as every projection here has),
    so the scale broadcasts onto them; x's contracted axis is its last. Traced under
    deterministic inference (`fixed_order.row_tile`), a fixed number of rows at a time."""
    return fixed_order.rowwise(lambda rows: _project(spec, rows, kernel, scale, quant), x)


def _project(spec: str, x: jax.Array, kernel: jax.Array, scale: jax.Array | None,
             quant: WeightQuantization | None) -> jax.Array:
    if scale is None:
        return jnp.einsum(spec, x, kernel)
    if not quant.activations:
        out = jnp.einsum(spec, x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)
        return (out * scale).astype(x.dtype)
    x_codes, x_scale = quantize(x, quant.method, (x.ndim - 1,), xp=jnp)  # [..., E], [...]
    accumulate = jnp.int32 if quant.method == "int8" else jnp.float32
    out = jnp.einsum(spec, x_codes, kernel, preferred_element_type=accumulate)
    x_scale = x_scale.reshape(x_scale.shape + (1,) * (out.ndim - x_scale.ndim))
    return (out.astype(jnp.float32) * x_scale * scale).astype(x.dtype)


def embedding_rows(table: jax.Array, scale: jax.Array | None, token_ids: jax.Array,
                   dtype) -> jax.Array:
    """Rows `token_ids` of the embedding `[V, E]` (scaled per row when quantized)."""
    rows = jnp.take(table, token_ids, axis=0)  # [..., E]
    if scale is None:
        return rows
    return (rows.astype(jnp.float32) * jnp.take(scale, token_ids)[..., None]).astype(dtype)
