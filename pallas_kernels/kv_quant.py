"""Quantized KV pages: what the kernels read, and how new tokens are written into them.

Pages are `[N, page_size, Hkv * D]` (`page_shape`): token p of page n holds its kv heads one
after the other along the last axis, head h at `[h * D, (h + 1) * D)`. Why heads packed into
one axis: XLA:TPU tiles an array's last two dims by (8, 128) (bf16: (16, 128)), and lays a
`[N, page_size, Hkv, D]` pool out to avoid padding those tiles: pages-minor for head_dim 64
(every kernel call then copied the whole cache into the kernel's row-major layout), heads
and tokens swapped for int8 with 2 kv heads. A row of `Hkv * D` values that is a multiple of
128 is laid out row-major for every dtype, so the kernels read it in place and a head is a
static lane slice; CPU and GPU arrays are row-major either way, and their readers view a
pool as `[N, page_size, Hkv, D]` for free (`page_heads`).

Folded rows, on TPU only (`tokens_per_row`): where a device's row would not be a multiple of
128 lanes (one kv head of 64 per device, e.g. 2 kv heads of 64 at tensor parallel 2, or 3
heads of 64), f tokens share a row: pages are `[N, page_size / f, f * Hkv * D]`, token p of a
page at row `p % (page_size / f)`, part `j = p // (page_size / f)`, head h's values at lanes
`[(h * f + j) * D, (h * f + j + 1) * D)` (head-major, so splitting the row's heads over
devices still splits it into whole heads). The row is lane-dense, so XLA passes the pool to
the kernels as it lies instead of copying it per call, and no lane is padding (RPA v3 pads
head_dim 64 to 128 instead, doubling such a cache); a head's f parts, stacked, are its
`page_size` keys in order. Readers take `page_size` to know f.

A layer's cache is a tuple:
- `(k_pages, v_pages)`, each `[N, page_size, Hkv * D]` (or folded, above), in the compute
  dtype ("auto");
- `(k_pages, v_pages, k_scale, v_scale)` for "fp8": float8_e4m3fn pages and one float32
  scale per kv head, `[Hkv]` (`[num_layers, Hkv]` for stacked layers): pages hold
  `x / scale` clipped to ±448. The scales are 1 (vLLM's default for an uncalibrated fp8
  cache) or calibrated from the first step that writes real tokens (`calibrate`). The
  kernels never see them: attention is linear in both, so the caller scales q by k's scale
  before the kernel and the output by v's after (`head_scaled_attention`);
- `(k_pages, v_pages, k_scales, v_scales)` for "int8": int8 pages and float32 scales, one
  per token and kv head (absmax over D / 127), in a pool beside the pages: `[N, Hkv * S]`,
  row n holding page n's scales head by head (token p of head h at `h * S + p`), each head's
  run S = page_size floats (`scale_stride`). Why this layout: a `[N, page_size, Hkv]` pool
  would pad Hkv to 128 lanes or be laid out pages-minor and copied on every kernel call (as
  above); a row of `Hkv * page_size` floats is dense, one page's scales are one contiguous
  copy, head h's are a static lane slice, and splitting the row's heads over devices (tensor
  parallel) splits it in whole blocks. On TPU a device's row under a multiple of 128 floats
  (one kv head with pages of 64, 2 with pages of 32) was laid out pages-minor and copied per
  call too, so there each head's run is padded to S = the smallest multiple of page_size that
  makes the device's row one (128 for one head with pages of 64: the scales then take 8
  bytes a token instead of 4, next to 128 bytes of int8 K or V at head_dim 128; with pages
  of 16, 32 bytes: use larger pages there). The padding costs memory, counted when the cache
  is sized; the copy it avoids moved the whole scale pool per layer and step.

Every reader (the Pallas kernels, the CPU backend, the reference) reads the stored bytes and
dequantizes as it computes: `codes * scale`. A token's own attention also goes through the
cache, so a step reads back exactly what later steps will (`round_trip`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels import absmax
from pallas_kernels.kv_write import write_kv
from pallas_kernels.limits import KV_CACHE_DTYPE_NAMES, check_kv_cache_dtype

# kv_cache_dtype option → page dtype (None: the compute dtype)
KV_CACHE_DTYPES = dict(zip(KV_CACHE_DTYPE_NAMES, (None, jnp.dtype(jnp.int8),
                                                   jnp.dtype(jnp.float8_e4m3fn))))
QUANTIZED_DTYPES = tuple(d for d in KV_CACHE_DTYPES.values() if d is not None)
FP8_LARGEST = absmax.LARGEST_CODE[KV_CACHE_DTYPES["fp8"]]


def page_dtype(kv_cache_dtype: str, compute_dtype) -> jnp.dtype:
    """The dtype pages are stored in; `ValueError` (naming kv_cache_dtype) for an unknown one."""
    check_kv_cache_dtype(kv_cache_dtype)
    return KV_CACHE_DTYPES[kv_cache_dtype] or jnp.dtype(compute_dtype)


LANES = 128  # a TPU vector register's lanes: the minor tile of every dtype


def _lane_multiple(values: int) -> int:
    """The fewest copies of a row of `values` that fill whole 128-lane rows."""
    return LANES // math.gcd(values, LANES)


def tokens_per_row(page_size: int, num_kv_heads: int, head_dim: int, num_shards: int = 1,
                   platform: str = "tpu") -> int:
    """How many tokens share a row of a page pool (f above): 1 off TPU, and on TPU where a
    device's `Hkv / num_shards * D` values are a multiple of 128 lanes; else the fewest
    tokens whose values together are (2 for one head of 64), if they divide page_size."""
    if platform != "tpu":
        return 1
    fold = _lane_multiple(num_kv_heads // num_shards * head_dim)
    return fold if page_size % fold == 0 else 1


def page_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
               fold: int = 1) -> tuple:
    """A page pool's shape: `[N, page_size / fold, fold * Hkv * D]`, kv heads packed along the
    last axis, `fold` tokens to a row (`tokens_per_row`)."""
    if page_size % fold:
        raise ValueError(f"page_size {page_size} is not a whole number of rows of {fold} "
                         "tokens")
    return num_pages, page_size // fold, fold * num_kv_heads * head_dim


def page_heads(pages, head_dim: int, page_size: int | None = None):
    """Pages `[..., page_size / f, f * Hkv * D]` (page_size None: f = 1) viewed as `[...,
    page_size, Hkv, D]`: for f = 1 a free reshape of a row-major array (CPU, GPU; on TPU a
    relayout of the pool, which the TPU kernels avoid by slicing heads out of the rows they
    copy); folded rows are unfolded, a copy."""
    *lead, rows, width = pages.shape
    fold = 1 if page_size is None else page_size // rows
    if fold == 1:
        return pages.reshape(*lead, rows, width // head_dim, head_dim)
    parts = pages.reshape(*lead, rows, width // (fold * head_dim), fold, head_dim)
    parts = jnp.moveaxis(parts, -2, -4)  # [..., f, rows, Hkv, D]
    return parts.reshape(*lead, fold * rows, width // (fold * head_dim), head_dim)


def fold_heads(pages, fold: int = 1):
    """The inverse of `page_heads`: pages `[..., page_size, Hkv, D]` stored `fold` tokens to
    a row, `[..., page_size / fold, fold * Hkv * D]`."""
    *lead, page_size, num_kv_heads, head_dim = pages.shape
    parts = pages.reshape(*lead, fold, page_size // fold, num_kv_heads, head_dim)
    parts = jnp.moveaxis(parts, -4, -2)  # [..., rows, Hkv, f, D]
    return parts.reshape(*lead, page_size // fold, fold * num_kv_heads * head_dim)


def scale_stride(page_size: int, num_kv_heads: int, num_shards: int = 1,
                 platform: str = "tpu") -> int:
    """Floats each kv head's run takes in a row of the int8 scale pool (S above): page_size,
    except on TPU where a device's `Hkv / num_shards * page_size` floats are not a multiple
    of 128: then the smallest multiple of page_size that makes them one."""
    if platform != "tpu":
        return page_size
    return page_size * _lane_multiple(num_kv_heads // num_shards * page_size)


def scale_pool_shape(num_pages: int, page_size: int, num_kv_heads: int,
                     stride: int | None = None) -> tuple:
    """The int8 scale pool's shape: `[N, Hkv * S]`, head-major rows (above); S = `stride`
    (None: page_size)."""
    return num_pages, num_kv_heads * (stride or page_size)


def scales_by_token(scales, page_size: int, num_kv_heads: int):
    """A scale pool `[N, Hkv * S]` (or rows of one) viewed as `[..., page_size, Hkv]`,
    indexed like the pages (each head's run cut to its page_size scales)."""
    by_head = scales.reshape(*scales.shape[:-1], num_kv_heads, -1)[..., :page_size]
    return jnp.swapaxes(by_head, -1, -2)  # [..., ps, Hkv]


FP8_HEADROOM = 2.0  # calibrated fp8 scales leave this factor above the first tokens' absmax


def calibrate(scale, x, valid):
    """Per-kv-head fp8 scales `[Hkv]`: `scale` where already set (> 0), else calibrated
    from this step's real tokens x `[T, Hkv, D]` (valid `[T]`): absmax over them and D,
    times FP8_HEADROOM, / 448 (1 for a head whose tokens are all zero). A scale stays 0
    (not yet calibrated) through steps with no real token, such as warm-up's."""
    real = jnp.where(valid[:, None, None], jnp.abs(x.astype(jnp.float32)), 0.0)
    largest = jnp.max(real, axis=(0, 2))  # [Hkv]
    fresh = jnp.where(largest > 0, largest * FP8_HEADROOM / FP8_LARGEST, 1.0)
    return jnp.where((scale > 0) | ~jnp.any(valid), scale, fresh)


def head_scaled_attention(attend, q, k, v, k_scale, v_scale):
    """`attend(q, k, v) -> (out, ...)` over pages holding K / k_scale and V / v_scale (per kv
    head, `[Hkv]`; 0, not yet calibrated, counts as 1): q `[T, Hq, D]` is scaled by k's scale
    before (q . K = (q * s) . K/s), the new k/v `[T, Hkv, D]` divided by theirs, and the output
    multiplied by v's scale after (p . V = s * p . V/s)."""
    group = q.shape[1] // k.shape[1]
    k_scale, v_scale = (jnp.where(s > 0, s, 1.0) for s in (k_scale, v_scale))

    def times(x, scale):  # x [T, H, D] by scale [H]
        return (x.astype(jnp.float32) * scale[None, :, None]).astype(x.dtype)

    out, *rest = attend(times(q, jnp.repeat(k_scale, group)), times(k, 1.0 / k_scale),
                        times(v, 1.0 / v_scale))
    return times(out, jnp.repeat(v_scale, group)), *rest


def has_scales(dtype) -> bool:
    """Whether pages of `dtype` carry a scale pool (int8)."""
    return jnp.dtype(dtype) == jnp.int8


def has_head_scales(dtype) -> bool:
    """Whether pages of `dtype` carry a scale per kv head (fp8)."""
    return jnp.dtype(dtype) == KV_CACHE_DTYPES["fp8"]


def quantize_tokens(x, dtype):
    """x `[T, Hkv, D]` → (pages' codes `[T, Hkv, D]` in `dtype`, scales `[T, Hkv]` float32 or
    None when `dtype` has no scales)."""
    dtype = jnp.dtype(dtype)
    if has_scales(dtype):
        return absmax.quantize(x, dtype, (-1,), xp=jnp)  # absmax over D
    if dtype in QUANTIZED_DTYPES:  # fp8: clipped, unscaled
        return jnp.clip(x.astype(jnp.float32), -FP8_LARGEST, FP8_LARGEST).astype(dtype), None
    return x.astype(dtype), None


def dequantize(codes, scales=None, dtype=jnp.float32):
    """Stored values as `dtype`: codes `[..., D]` times scales `[...]` indexed like them
    (None: unscaled; a pool's rows go through `scales_by_token` first)."""
    if scales is None:
        return codes.astype(dtype)
    return (codes.astype(jnp.float32) * scales[..., None]).astype(dtype)


def dequantize_pages(pages, head_dim: int, scales=None, dtype=jnp.float32,
                     page_size: int | None = None):
    """A whole pool's values as `dtype`, `[N, page_size, Hkv, D]`: pages `[N, page_size / f,
    f * Hkv * D]` (page_size None: f = 1) with their scale pool `[N, Hkv * S]` (None:
    unscaled)."""
    pages = page_heads(pages, head_dim, page_size)
    if scales is None:
        return dequantize(pages, None, dtype)
    return dequantize(pages, scales_by_token(scales, pages.shape[1], pages.shape[2]), dtype)


def round_trip(x, dtype, head_scale=None):
    """What reading `x` `[..., Hkv, D]` back from pages of `dtype` gives, in x's dtype; fp8
    pages with a scale per kv head `head_scale` `[Hkv]` hold x / head_scale."""
    if head_scale is None:
        codes, scales = quantize_tokens(x, dtype)
        return dequantize(codes, scales, x.dtype)
    scale = head_scale[:, None]  # [Hkv, 1]
    codes, _ = quantize_tokens(x.astype(jnp.float32) / scale, dtype)
    return (codes.astype(jnp.float32) * scale).astype(x.dtype)


def write(layer_cache: tuple, k_new, v_new, slot_mapping, page_size: int | None = None) -> tuple:
    """Write token t's K/V (`[T, Hkv, D]`) to slot `slot_mapping[t]` of a layer's cache (a
    2- or 4-tuple as above; page_size None: pages of one token a row), quantizing them for
    the pages' dtype; negative slots are not written. Returns the updated tuple."""
    k_pages, v_pages = layer_cache[:2]
    page_size = k_pages.shape[1] if page_size is None else page_size
    k_codes, k_scale = quantize_tokens(k_new, k_pages.dtype)
    v_codes, v_scale = quantize_tokens(v_new, v_pages.dtype)
    k_pages, v_pages = write_kv(k_pages, v_pages, k_codes, v_codes, slot_mapping, page_size)
    if len(layer_cache) == 2:
        return k_pages, v_pages
    k_scales, v_scales = layer_cache[2:]
    num_pages = k_pages.shape[0]
    num_kv_heads = k_new.shape[1]
    stride = k_scales.shape[1] // num_kv_heads  # each head's run in a page's row
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)[:, None]  # [T, 1]
    column = (jnp.arange(num_kv_heads) * stride
              + (slot_mapping % page_size)[:, None])  # [T, Hkv]
    k_scales = k_scales.at[page, column].set(k_scale, mode="drop")
    v_scales = v_scales.at[page, column].set(v_scale, mode="drop")
    return k_pages, v_pages, k_scales, v_scales
