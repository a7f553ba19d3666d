"""Argument checks shared by the kernels and the references.

Every kernel entry point validates statically known shapes and dtypes here, so a
bad call fails at trace time with a ValueError that names the offending argument
instead of failing deep inside a Mosaic or Triton lowering. Pages are in q's dtype or
quantized (`kv_quant`): int8 with float32 scales, or float8_e4m3fn unscaled.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant
from pallas_kernels.limits import SUPPORTED_HEAD_DIMS, SUPPORTED_PAGE_SIZES
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Quantized page dtypes besides q's own (`kv_quant`): int8 pages carry scales, fp8 do not.
QUANTIZED_PAGE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


class Dims(NamedTuple):
    """Static sizes of one attention call."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    pages_per_seq: int

    @property
    def group(self) -> int:
        """Query heads per KV head (1: MHA, num_q_heads: MQA)."""
        return self.num_q_heads // self.num_kv_heads


def _check_int32(name, x, ndim):
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {x.shape}")


def check_options(sm_scale, soft_cap, sliding_window):
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    if sliding_window is not None and (
        int(sliding_window) != sliding_window or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be a positive int, got {sliding_window}")


def check_cache(q, k_pages, v_pages, page_indices, kernel_limits=True, *, k_scales=None,
                v_scales=None, page_size=None, sinks=None) -> Dims:
    """Checks q [*, Hq, D], k_pages/v_pages [N, page_size / f, f * Hkv * D]
    (`kv_quant.page_shape`: head_dim is q's, f = page_size / the pages' rows (page_size None:
    f = 1), Hkv follows from the rows), page_indices [S, P], the scales of int8 pages
    (`check_scales`) and the attention sinks (`check_sinks`).

    kernel_limits=False skips the head_dim / page_size limits of the Pallas kernels (the
    jnp references take any size).
    """
    if q.ndim != 3:
        raise ValueError(f"q must have 3 dimensions, got shape {q.shape}")
    if k_pages.ndim != 3:
        raise ValueError(
            "k_pages must be [num_pages, page_size / f, f * num_kv_heads * head_dim], "
            f"got shape {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported (float32 or bfloat16)")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if x.dtype != q.dtype and jnp.dtype(x.dtype) not in QUANTIZED_PAGE_DTYPES:
            raise ValueError(f"{name} dtype {x.dtype} must match q dtype {q.dtype} or be "
                             "int8 or float8_e4m3fn")
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages dtype {v_pages.dtype} != k_pages dtype {k_pages.dtype}")
    num_pages, rows, width = k_pages.shape
    page_size = rows if page_size is None else page_size
    if page_size < rows or page_size % rows:
        raise ValueError(f"page_size {page_size} is not a whole number of k_pages' {rows} "
                         "rows per page (pages are [N, page_size / f, f * num_kv_heads * "
                         "head_dim], f tokens to a row)")
    fold = page_size // rows
    num_q_heads, head_dim = q.shape[1:]
    if width % (fold * head_dim):
        raise ValueError(f"k_pages rows hold {width} values, not {fold} token(s) of whole "
                         f"heads of q's head_dim {head_dim} (pages are [N, page_size / f, "
                         "f * num_kv_heads * head_dim])")
    num_kv_heads = width // (fold * head_dim)
    check_scales(k_pages, k_scales, v_scales, num_kv_heads, page_size)
    if kernel_limits and head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} not supported (one of {SUPPORTED_HEAD_DIMS})")
    if kernel_limits and page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(
            f"page_size {page_size} not supported (one of {SUPPORTED_PAGE_SIZES})"
        )
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    _check_int32("page_indices", page_indices, 2)
    check_sinks(sinks, num_q_heads)
    return Dims(num_q_heads, num_kv_heads, head_dim, num_pages, page_size, page_indices.shape[1])


def check_scales(k_pages, k_scales, v_scales, num_kv_heads, page_size):
    """int8 pages need both scale pools, float32 [N, Hkv * S] with S a multiple of page_size
    (`kv_quant.scale_stride`); pages of any other dtype take none (a scale given for them
    would be silently ignored)."""
    given = [name for name, x in (("k_scales", k_scales), ("v_scales", v_scales))
             if x is not None]
    if k_pages.dtype != jnp.int8:
        if given:
            raise ValueError(f"{' and '.join(given)} given for {k_pages.dtype} pages: only "
                             "int8 pages carry scales")
        return
    if len(given) < 2:
        raise ValueError("int8 pages need k_scales and v_scales (float32 "
                         "[num_pages, num_kv_heads * S], S >= page_size)")
    row = k_scales.shape[-1] if k_scales.ndim == 2 else 0
    stride = row // num_kv_heads if row % num_kv_heads == 0 else 0
    want = kv_quant.scale_pool_shape(k_pages.shape[0], page_size, num_kv_heads,
                                     stride if stride and stride % page_size == 0 else None)
    for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
        if x.dtype != jnp.float32 or x.shape != want:
            raise ValueError(f"{name} must be float32{list(want)} like the pages (or with "
                             f"each kv head's run a larger multiple of page_size {page_size}),"
                             f" got {x.dtype}{list(x.shape)}")


def check_sinks(sinks, num_q_heads):
    """Attention sinks (None: none) are one float per query head, [Hq]: a sink per kv head or
    per token would broadcast into the wrong heads."""
    if sinks is None:
        return
    if sinks.shape != (num_q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must be a float array [num_q_heads] = [{num_q_heads}], got "
                         f"{sinks.dtype}{list(sinks.shape)}")


def check_table_covers(kv_lens, dims: Dims):
    """kv_lens past what the page tables cover (P * page_size) are a ValueError when known at
    trace time (a concrete array); traced ones are clamped by the caller."""
    if isinstance(kv_lens, jax.core.Tracer):
        return
    covered = dims.pages_per_seq * dims.page_size
    longest = int(np.max(np.asarray(kv_lens), initial=0))
    if longest > covered:
        raise ValueError(f"kv_lens holds {longest}, more than page_indices covers "
                         f"({dims.pages_per_seq} pages of {dims.page_size} = {covered} keys)")


def check_decode(q, k_pages, v_pages, kv_lens, page_indices, kernel_limits=True, *,
                 k_scales=None, v_scales=None, page_size=None, sinks=None) -> Dims:
    dims = check_cache(q, k_pages, v_pages, page_indices, kernel_limits, k_scales=k_scales,
                       v_scales=v_scales, page_size=page_size, sinks=sinks)
    _check_int32("kv_lens", kv_lens, 1)
    batch = q.shape[0]
    if kv_lens.shape[0] != batch:
        raise ValueError(f"kv_lens has {kv_lens.shape[0]} entries, q has batch {batch}")
    if page_indices.shape[0] != batch:
        raise ValueError(f"page_indices has {page_indices.shape[0]} rows, q has batch {batch}")
    return dims


def check_ragged(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                 kernel_limits=True, *, k_scales=None, v_scales=None,
                 page_size=None, sinks=None) -> Dims:
    dims = check_cache(q, k_pages, v_pages, page_indices, kernel_limits, k_scales=k_scales,
                       v_scales=v_scales, page_size=page_size, sinks=sinks)
    _check_int32("kv_lens", kv_lens, 1)
    _check_int32("cu_q_lens", cu_q_lens, 1)
    _check_int32("num_seqs", num_seqs, 1)
    max_seqs = kv_lens.shape[0]
    if page_indices.shape[0] != max_seqs:
        raise ValueError(
            f"page_indices has {page_indices.shape[0]} rows, kv_lens has {max_seqs} entries"
        )
    if cu_q_lens.shape[0] != max_seqs + 1:
        raise ValueError(
            f"cu_q_lens must have len(kv_lens) + 1 = {max_seqs + 1} entries, "
            f"got {cu_q_lens.shape[0]}"
        )
    if num_seqs.shape[0] != 1:
        raise ValueError(f"num_seqs must have shape (1,), got {num_seqs.shape}")
    return dims
