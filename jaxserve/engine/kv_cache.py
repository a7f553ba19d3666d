"""The paged KV cache: per layer `(k_pages, v_pages)`, each
`[num_pages, page_size, num_kv_heads * head_dim]` (the kernels' contract, heads packed along
the last axis: `pallas_kernels.kv_quant.page_shape`; on TPU, where a device's heads fill less
than a 128-lane row, f tokens to a row: `[num_pages, page_size / f, f * num_kv_heads *
head_dim]`, `kv_quant.tokens_per_row`), or with stacked
layers one pair per stack holding its layers' pages (`cache_structure`), and its sizing.

Pages are stored in the compute dtype, or quantized (`EngineConfig.kv_cache_dtype`, see
`pallas_kernels.kv_quant`), a layer's cache then being `(k_pages, v_pages, k_scales,
v_scales)`: int8 pages add a scale pool per K and V, `[num_pages, num_kv_heads * S]`
float32 (S = page_size, or on TPU more where a device's row would be narrow:
`kv_quant.scale_stride`); fp8 pages a float32 scale per kv head, `[num_kv_heads]`. `dtype`
below is always the pages' dtype.

With hybrid KV memory (`jaxserve.engine.window_pages`) the window layers' caches have the
window pool's page count instead; the rest of the device's budget goes to the others.

On a mesh the pages and int8 scale pools are split on their kv heads
(`sharding.kv_cache_sharding`, `kv_scale_sharding`), like the k/v projections that fill
them; every device holds all pages of its heads, so the page allocator stays one global
pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import sharding
from jaxserve.config.engine import EngineConfig
from jaxserve.config.window import WindowLayout
from jaxserve.model.config import ModelConfig
from pallas_kernels.kv_quant import (has_head_scales, has_scales, page_shape, scale_pool_shape,
                                     scale_stride, tokens_per_row)

CPU_KV_CACHE_BYTES = 1 << 30  # CPUs report no memory limit: cap the cache at 1 GiB there


def page_bytes(model: ModelConfig, page_size: int, dtype, tensor_parallel_size: int = 1,
               platform: str | None = None, num_layers: int | None = None) -> int:
    """Bytes of one page across `num_layers` layers (default: all), keys and values (and
    their scales, for int8: a float32 per token and head, each head's run padded on TPU as
    `kv_quant.scale_stride` says for `tensor_parallel_size` devices; platform default: JAX's
    default backend)."""
    per_layer = page_size * model.num_kv_heads * model.head_dim * jnp.dtype(dtype).itemsize
    if has_scales(dtype):
        per_layer += 4 * model.num_kv_heads * scale_stride(
            page_size, model.num_kv_heads, tensor_parallel_size,
            platform or jax.default_backend())
    return 2 * (model.num_layers if num_layers is None else num_layers) * per_layer


def choose_num_pages(model: ModelConfig, engine: EngineConfig, dtype,
                     device: jax.Device | None = None, tensor_parallel_size: int = 1,
                     draft: ModelConfig | None = None, reserved_bytes: int = 0,
                     window: WindowLayout | None = None) -> int:
    """`engine.num_pages` if set; else a fraction of the device's free memory (on CPU: enough
    for `max_num_seqs` full-length sequences, at most 1 GiB). `model` is the config as stored
    on the mesh: each device holds 1/tensor_parallel_size of its kv heads. A `draft` model's
    pool has a page for every page of the target's (the same ids): both count.
    `reserved_bytes`: what the engine will place after the cache (LoRA slots), not free.
    `window`: hybrid KV memory's window pool, placed first (`pages_for_memory`)."""
    device = device or jax.devices()[0]
    stats = (device.memory_stats() if hasattr(device, "memory_stats") else None) or {}
    return pages_for_memory(model, engine, dtype, stats.get("bytes_limit"),
                            stats.get("bytes_in_use", 0) + reserved_bytes,
                            tensor_parallel_size, device.platform, draft, window)


def full_page_bytes(model: ModelConfig, engine: EngineConfig, dtype,
                    tensor_parallel_size: int = 1, platform: str | None = None,
                    draft: ModelConfig | None = None,
                    window: WindowLayout | None = None) -> int:
    """Bytes per device of one page of the full-context pool: every layer's but the
    `window` pool's, and the `draft` model's (whose pool has the same page ids)."""
    full_layers = model.num_layers - (0 if window is None else len(window.layers))
    total = page_bytes(model, engine.page_size, dtype, tensor_parallel_size, platform,
                       full_layers)
    if draft is not None:
        total += page_bytes(draft, engine.page_size, dtype, tensor_parallel_size, platform)
    return total // tensor_parallel_size


def window_pool_bytes(model: ModelConfig, engine: EngineConfig, dtype,
                      window: WindowLayout | None, tensor_parallel_size: int = 1,
                      platform: str | None = None) -> int:
    """Bytes per device of hybrid KV memory's window pool (0 without one)."""
    if window is None:
        return 0
    return window.num_pages * page_bytes(model, engine.page_size, dtype, tensor_parallel_size,
                                         platform, len(window.layers)) // tensor_parallel_size


def pages_for_memory(model: ModelConfig, engine: EngineConfig, dtype, bytes_limit: int | None,
                     bytes_in_use: int, tensor_parallel_size: int = 1,
                     platform: str | None = None, draft: ModelConfig | None = None,
                     window: WindowLayout | None = None,
                     available_bytes: int | None = None) -> int:
    """The page count `choose_num_pages` picks for a device that can allocate `bytes_limit`
    bytes of which `bytes_in_use` are taken (the weights); `None`: a CPU, which reports no
    limit. `jaxserve plan` calls this with the numbers of a device that is not attached.
    With a `window` pool, the pages are the other layers' (and the draft's): the window
    pool's bytes come out of the budget first. Should no layer need full-context pages, the
    pool's ids cost nothing and there are enough for every sequence at full length.
    `available_bytes`: the cache's bytes when already decided (`memory_budget`, with
    `gpu_memory_utilization`), instead of `kv_cache_memory_fraction` of the free bytes."""
    if engine.num_pages is not None:
        return engine.num_pages
    one_page = full_page_bytes(model, engine, dtype, tensor_parallel_size, platform, draft,
                               window)
    window_bytes = window_pool_bytes(model, engine, dtype, window, tensor_parallel_size,
                                     platform)
    if available_bytes is not None:
        available = available_bytes
    elif bytes_limit is not None:
        available = int((bytes_limit - bytes_in_use) * engine.kv_cache_memory_fraction)
    else:
        available = CPU_KV_CACHE_BYTES
    if window is not None and 0 < available < window_bytes:
        raise ValueError(
            f"hybrid KV memory's window pool ({window.num_pages} pages, the windows of "
            f"max_num_seqs={engine.max_num_seqs} sequences) takes {window_bytes / 2**30:.2f} "
            "GiB, more than the KV cache's share of memory; lower max_num_seqs or raise "
            "kv_cache_memory_fraction")
    budget = max(available - window_bytes, 0)  # for the full-context pool
    wanted = 1 + engine.max_num_seqs * engine.pages_per_seq
    if available <= 0:
        pages = 0
    elif one_page == 0:
        pages = wanted
    elif bytes_limit is not None:
        pages = budget // one_page
    else:
        pages = min(wanted, budget // one_page)
    if pages < 1 + engine.pages_per_seq:
        raise ValueError(
            f"the KV cache fits only {pages} pages of {engine.page_size} tokens, fewer than one "
            f"sequence of max_model_len={engine.max_model_len} needs; lower max_model_len or "
            "raise kv_cache_memory_fraction / num_pages")
    return int(pages)


def cache_structure(model: ModelConfig, num_pages: int, page_size: int, dtype,
                    scan_layers: bool, mesh: Mesh | None = None, platform: str | None = None,
                    window: WindowLayout | None = None):
    """The cache's arrays as `jax.ShapeDtypeStruct`s: per layer `(k_pages, v_pages)` each
    `[num_pages, page_size / f, f * Hkv * D]` (f tokens a row, `kv_quant.tokens_per_row`);
    with `scan_layers` `(stacks, tail)`: per stack of `G = model.scan_groups` layers
    (`jaxserve.model.llama.LlamaModel`) one `(k_pages, v_pages)` pair of `[G * num_pages,
    ...]`, group g's pages at `[g * num_pages, (g + 1) * num_pages)` (the kernels see one
    big page pool; the attention offsets each layer's page ids), and per layer after the
    last whole period a cache as unstacked. int8 pages add their scale pools
    `[pages, Hkv * S]` (`kv_quant.scale_stride`), split on kv heads like the pages on `mesh`
    (None: no shardings); fp8 pages
    their scales per kv head `[Hkv]` (`[G, Hkv]` stacked), on every device.
    `platform` (default: JAX's default backend) and the mesh's tensor parallelism decide how
    many tokens share a page row (`kv_quant.tokens_per_row`: more than 1 only on TPU).
    `window`: hybrid KV memory, whose window layers (and stacks of them) have
    `window.num_pages` pages a layer."""
    platform = platform or jax.default_backend()
    tp = 1 if mesh is None else sharding.tensor_parallel_size(mesh)
    fold = tokens_per_row(page_size, model.num_kv_heads, model.head_dim, tp, platform)

    def struct(shape, dtype, place):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=None if mesh is None else place(mesh))

    def layer_cache(pages: int, layers: int | None = None):
        """The cache of a stack of `layers` layers (None: one alone), `pages` pages each."""
        stacked = () if layers is None else (layers,)
        pages *= layers or 1
        shape = page_shape(pages, page_size, model.num_kv_heads, model.head_dim, fold)
        page = struct(shape, jnp.dtype(dtype), sharding.kv_cache_sharding)
        if has_scales(dtype):
            stride = scale_stride(page_size, model.num_kv_heads, tp, platform)
            scales = struct(scale_pool_shape(pages, page_size, model.num_kv_heads, stride),
                            jnp.float32, sharding.kv_scale_sharding)
            return (page, page, scales, scales)
        if has_head_scales(dtype):
            heads = stacked + (model.num_kv_heads,)
            scales = struct(heads, jnp.float32, sharding.replicated)
            return (page, page, scales, scales)
        return (page, page)

    windowed = () if window is None else window.layers

    def pages_of(layer: int) -> int:
        return window.num_pages if layer in windowed else num_pages

    if not scan_layers:
        return [layer_cache(pages_of(layer)) for layer in range(model.num_layers)]
    period, groups = model.scan_period, model.scan_groups
    stacks = [layer_cache(pages_of(position), groups) for position in range(period)]
    return stacks, [layer_cache(pages_of(layer))
                    for layer in range(period * groups, model.num_layers)]


def allocate_kv_cache(model: ModelConfig, num_pages: int, page_size: int, dtype,
                      mesh: Mesh | None = None, scan_layers: bool = False,
                      calculate_kv_scales: bool = False, platform: str | None = None,
                      window: WindowLayout | None = None):
    """Caches laid out and placed as `cache_structure` says (no mesh: on the default device):
    zeroed pages and scale pools; fp8 scales per kv head 1, or 0 (calibrated by the first step
    that writes real tokens, `kv_quant.calibrate`) with `calculate_kv_scales`."""
    structure = cache_structure(model, num_pages, page_size, dtype, scan_layers, mesh,
                                platform, window)
    head_scale = 0.0 if calculate_kv_scales else 1.0

    def filled(leaf):
        value = head_scale if has_head_scales(dtype) and leaf.dtype == jnp.float32 else 0
        return jax.jit(lambda: jnp.full(leaf.shape, value, leaf.dtype),
                       out_shardings=leaf.sharding)()

    return jax.tree.map(filled, structure)
