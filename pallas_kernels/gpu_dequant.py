"""Quantized K/V tiles in the GPU (Triton) kernels: what a kernel loads and how it widens it.

int8 pages are loaded as stored and dequantized as `kv_quant.dequantize` defines it (codes
times scales in float32, rounded to q's dtype). float8_e4m3fn pages reach the kernels as
their bytes (uint8, an XLA bitcast of the pool: no copy) and are decoded with integer ops:
Triton converts fp8 e4m3 natively only on sm89+ (an A100 build aborts in LLVM), and its
masked loads cannot take a zero `other` of an fp8 type. The decode is exact (every e4m3
value is a float32, and a bfloat16), so the dots see the reference's values on every GPU.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant

FP8 = jnp.dtype(jnp.float8_e4m3fn)


def as_loaded(pages, head_dim, page_size=None):
    """pages [N, page_size, Hkv * D] as the kernels load them: viewed as [N, page_size, Hkv,
    D] (`kv_quant.page_heads`: a GPU array is row-major, so no copy; TPU's folded rows are
    unfolded, a copy), fp8 as uint8 bytes (a bitcast), other dtypes unchanged."""
    pages = kv_quant.page_heads(pages, head_dim, page_size)
    if pages.dtype == FP8:
        return jax.lax.bitcast_convert_type(pages, jnp.uint8)
    return pages


def fp8_bytes_to_f32(x):
    """float8_e4m3fn bytes (uint8) -> float32 values, exactly: sign bit, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent 0 is subnormal, 0x7f / 0xff NaN, no infinities."""
    bits = x.astype(jnp.int32)
    mag = bits & 0x7F  # [..] exponent and mantissa
    # Exponent e >= 1: the f32 with exponent field e + 120 (127 - 7) and the 3 mantissa
    # bits on top of its own, i.e. (1 + m / 8) * 2^(e - 7).
    normal = jax.lax.bitcast_convert_type((mag << 20) + (120 << 23), jnp.float32)
    value = jnp.where(mag < 8, mag.astype(jnp.float32) * 2.0**-9, normal)  # e 0: m * 2^-9
    value = jnp.where(mag == 0x7F, jnp.nan, value)
    return jnp.where(bits >= 0x80, -value, value)


def dequantize(tile, scale, dtype):
    """A loaded tile [KB, D] (q's dtype, int8 codes with scale [KB] float32, or fp8 bytes as
    uint8) as dtype values, rounded as the reference rounds."""
    if tile.dtype == jnp.uint8:
        return fp8_bytes_to_f32(tile).astype(dtype)
    return kv_quant.dequantize(tile, scale, dtype)
