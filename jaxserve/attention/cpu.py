"""The CPU backend: attention in plain jnp shaped for XLA:CPU (heads-major dots; decode rows
in blocks of alike length, each gathering only the pages it needs), because Pallas interpret
mode is far too slow to serve from. A step's metadata is `cpu_step.plan_step` (which token
is what, the masks), built once per step and shared by every layer; the decode loop runs it
once per loop step. Everything CPU-specific in jaxserve lives in this backend, including
one process setting for XLA:CPU's memory (`reuse_freed_memory`, applied when the backend is
built). With `fixed_order` (deterministic inference) every token attends through
`cpu_fixed_order` instead.

Measured on the 60M bench model (2 cores, float32, one prompt of 128 tokens then 128 new;
32 such at once): gathering each decode loop's context once and carrying it through the loop
(a former `cpu_loop` path) ran at 48.7 / 245 tokens/s, this per-step path at 82.8 / 394, so
the carried context was removed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxserve.attention import cpu_step
from jaxserve.attention.backend import AttentionBackend, PagedBatch
from jaxserve.attention.cpu_fixed_order import fixed_order_attention
from pallas_kernels import kv_quant
from pallas_kernels.kv_write import write_kv


@dataclasses.dataclass(frozen=True)
class CpuBackend(AttentionBackend):
    name: ClassVar[str] = "cpu"

    def __post_init__(self):
        reuse_freed_memory()

    def step_metadata(self, batch: PagedBatch) -> tuple[cpu_step.StepPlan, ...]:
        """One plan per window the layers use (Gemma's sliding and global layers: two)."""
        return tuple(cpu_step.plan_step(batch.slot_mapping.shape[0], batch.kv_lens,
                                        batch.page_indices, batch.cu_q_lens, batch.num_seqs,
                                        self.page_size, window, self.soft_cap)
                     for window in self.distinct_windows)

    def attend(self, q, k, v, layer_cache, slots, page_indices, batch, metadata, sinks,
               window):
        layer_cache = _write(layer_cache, k, v, slots, self.page_size)
        k_pages, v_pages, *scales = layer_cache
        k_pool, v_pool = (cpu_step.PagePool(pages, scales[i] if scales else None,
                                            head_dim=q.shape[-1], page_size=self.page_size)
                          for i, pages in enumerate((k_pages, v_pages)))
        if k_pages.dtype != k.dtype:  # quantized pages: the step's own keys as they are stored
            k, v = kv_quant.round_trip(k, k_pages.dtype), kv_quant.round_trip(v, v_pages.dtype)
        plan = metadata[self.distinct_windows.index(window)]
        if self.fixed_order:
            out = fixed_order_attention(q, k_pool, v_pool, page_indices, plan, sinks)
            return out, layer_cache
        out = cpu_step.ragged_attention(q, k, v, k_pool, v_pool, page_indices, plan, sinks)
        return out, layer_cache


def _write(layer_cache, k, v, slots, page_size):
    """`kv_quant.write`, except that fp8 codes are scattered as bytes (free bitcasts): XLA:CPU
    has no fp8 scatter and widens the whole pool for one (batch-1 decode of the shipped model
    ran at 43 tokens/s instead of about 1,300)."""
    fp8 = kv_quant.KV_CACHE_DTYPES["fp8"]
    if layer_cache[0].dtype != fp8:
        return kv_quant.write(layer_cache, k, v, slots, page_size)
    as_bytes = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int8)
    k_codes, v_codes = (kv_quant.quantize_tokens(x, fp8)[0] for x in (k, v))
    pages = write_kv(*map(as_bytes, (*layer_cache, k_codes, v_codes)), slots, page_size)
    return tuple(jax.lax.bitcast_convert_type(x, fp8) for x in pages)


@functools.cache
def reuse_freed_memory() -> bool:
    """Let glibc's malloc reuse freed blocks of up to 1 GiB instead of unmapping them.

    XLA:CPU allocates a program's temporaries on every call (42 MB for a 32-row decode step
    of the 60M bench model) and frees them after. Above glibc's mmap threshold (32 MB at
    most by default) each call maps fresh pages and faults every one in on first touch.
    Measured there (2 cores, 16 rows, one decode step per call): 62 ms a call before, 47
    after; an 8-step loop 55 → 51 ms a step. It also keeps the process's count of memory
    mappings down. Freed memory stays with the process (up to 1 GiB at the heap's top).
    Returns whether malloc took the settings (False without glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)
                and libc.mallopt(m_trim_threshold, 1 << 30))
