"""Symmetric absmax quantization to int8 or float8_e4m3fn, one float32 scale per slice.

Shared by the model's weights (`jaxserve.model.quantization`: one scale per output channel,
the largest |w| over the contracted axes) and the int8 KV cache (`kv_quant`: one scale per
token and kv head, over head_dim). The slice's largest magnitude maps to the dtype's largest
code (127 for int8, 448 for e4m3); an all-zero slice gets scale 1.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

LARGEST_CODE = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def quantize(value, dtype, axes: tuple[int, ...], xp: Any = np):
    """(codes, scale): codes in `dtype` with `value`'s shape, and the float32 scale with
    `axes` (the slice the scale covers) removed; `value ≈ codes * scale`. `xp`: numpy (on the
    host, e.g. the weight loader) or jax.numpy (in a program)."""
    dtype = jnp.dtype(dtype)
    largest_code = LARGEST_CODE[dtype]
    value = value.astype(xp.float32)
    largest = xp.max(xp.abs(value), axis=axes, keepdims=True)
    scale = xp.where(largest > 0, largest / largest_code, 1.0).astype(xp.float32)
    scaled = value / scale
    if dtype == jnp.int8:
        scaled = xp.round(scaled)
    codes = xp.clip(scaled, -largest_code, largest_code).astype(dtype)
    return codes, xp.squeeze(scale, axis=axes)
