"""Quantized KV pages: what the kernels read, and how new tokens are written into them.

A layer's cache is a tuple:
- `(k_pages, v_pages)`, each `[N, page_size, Hkv, D]`, in the compute dtype ("auto"), or in
  float8_e4m3fn ("fp8"): values clipped to ±448 and stored unscaled (scale 1, vLLM's default
  for an uncalibrated fp8 cache);
- `(k_pages, v_pages, k_scales, v_scales)` for "int8": int8 pages and float32 scales
  `[N, page_size, Hkv]`, one per token and kv head (absmax over D / 127), kept in a pool
  beside the pages and addressed by the same (page, offset).

Every reader (the Pallas kernels, the CPU backend, the reference) reads the stored bytes and
dequantizes as it computes: `codes * scale`. A token's own attention also goes through the
cache, so a step reads back exactly what later steps will (`round_trip`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_write import write_kv

# kv_cache_dtype option → page dtype (None: the compute dtype)
KV_CACHE_DTYPES = {"auto": None, "int8": jnp.dtype(jnp.int8),
                   "fp8": jnp.dtype(jnp.float8_e4m3fn)}
QUANTIZED_DTYPES = tuple(d for d in KV_CACHE_DTYPES.values() if d is not None)
FP8_LARGEST = 448.0


def page_dtype(kv_cache_dtype: str, compute_dtype) -> jnp.dtype:
    """The dtype pages are stored in; `ValueError` (naming kv_cache_dtype) for an unknown one."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or jnp.dtype(compute_dtype)


def has_scales(dtype) -> bool:
    """Whether pages of `dtype` carry a scale pool (int8)."""
    return jnp.dtype(dtype) == jnp.int8


def quantize_tokens(x, dtype):
    """x `[T, Hkv, D]` → (pages' codes `[T, Hkv, D]` in `dtype`, scales `[T, Hkv]` float32 or
    None when `dtype` has no scales)."""
    dtype = jnp.dtype(dtype)
    if has_scales(dtype):
        x32 = x.astype(jnp.float32)
        largest = jnp.max(jnp.abs(x32), axis=-1)  # [T, Hkv]
        scale = jnp.where(largest > 0, largest / 127.0, 1.0)
        codes = jnp.clip(jnp.round(x32 / scale[..., None]), -127, 127).astype(dtype)
        return codes, scale
    if dtype in QUANTIZED_DTYPES:  # fp8: clipped, unscaled
        return jnp.clip(x.astype(jnp.float32), -FP8_LARGEST, FP8_LARGEST).astype(dtype), None
    return x.astype(dtype), None


def dequantize(codes, scales=None, dtype=jnp.float32):
    """Stored values as `dtype`: codes `[..., D]` times scales `[...]` (None: unscaled)."""
    if scales is None:
        return codes.astype(dtype)
    return (codes.astype(jnp.float32) * scales[..., None]).astype(dtype)


def round_trip(x, dtype):
    """What reading `x` `[T, Hkv, D]` back from pages of `dtype` gives, in x's dtype."""
    codes, scales = quantize_tokens(x, dtype)
    return dequantize(codes, scales, x.dtype)


def write(layer_cache: tuple, k_new, v_new, slot_mapping, fp8_as_bytes: bool = False) -> tuple:
    """Write token t's K/V (`[T, Hkv, D]`) to slot `slot_mapping[t]` of a layer's cache (a
    2- or 4-tuple as above), quantizing them for the pages' dtype; negative slots are not
    written. Returns the updated tuple.

    `fp8_as_bytes`: scatter fp8 codes into the pages viewed as int8 (free bitcasts). XLA:CPU
    has no fp8 scatter and widens the whole pool for one (batch-1 decode of the shipped model
    ran at 43 tokens/s instead of about 1,300); on TPU the bitcasts cost a relayout instead,
    so only the CPU backend asks for it."""
    k_pages, v_pages = layer_cache[:2]
    k_codes, k_scale = quantize_tokens(k_new, k_pages.dtype)
    v_codes, v_scale = quantize_tokens(v_new, v_pages.dtype)
    stored = k_pages.dtype
    if fp8_as_bytes and stored == KV_CACHE_DTYPES["fp8"]:
        as_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.int8)  # noqa: E731
        k_pages, v_pages = write_kv(as_bytes(k_pages), as_bytes(v_pages), as_bytes(k_codes),
                                    as_bytes(v_codes), slot_mapping)
        k_pages, v_pages = (jax.lax.bitcast_convert_type(x, stored) for x in (k_pages, v_pages))
    else:
        k_pages, v_pages = write_kv(k_pages, v_pages, k_codes, v_codes, slot_mapping)
    if len(layer_cache) == 2:
        return k_pages, v_pages
    k_scales, v_scales = layer_cache[2:]
    num_pages, page_size = k_scales.shape[:2]
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # [T]
    offset = slot_mapping % page_size  # [T]
    k_scales = k_scales.at[page, offset].set(k_scale, mode="drop")
    v_scales = v_scales.at[page, offset].set(v_scale, mode="drop")
    return k_pages, v_pages, k_scales, v_scales
