"""Writing new tokens' K/V into the paged cache.

This is a plain XLA scatter, deliberately not a Pallas kernel: the write moves
only T * Hkv * D elements, XLA's scatter updates a donated buffer in place on
every backend (TPU, GPU, CPU), fuses with the K/V projection that produces
k_new / v_new, and partitions cleanly under shard_map over kv heads. A Pallas
kernel would need input_output_aliases plus per-backend lowering for no gain.

Indexing by (page, offset) rather than a flat slot avoids reshaping the cache,
which on TPU could force a relayout copy of the whole cache. The pages keep their kv heads
packed along the last axis (`kv_quant.page_shape`); a new token's `[Hkv, D]` becomes one row
of `Hkv * D` values, or, where f tokens share a row (`kv_quant.tokens_per_row`), its part of
each head's f parts: one D-lane window per head at (page, row, lane), a scatter on the
pool as it lies.
"""

import jax
import jax.numpy as jnp


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, page_size=None):
    """Writes token t's K/V to flat slot slot_mapping[t] = page_id * page_size + offset.

    k_pages, v_pages [N, page_size / f, f * Hkv * D] (page_size None: the pages' rows, f =
    1); k_new, v_new [T, Hkv, D] (cast to the cache dtype); slot_mapping int32[T]. A
    negative slot marks a padding token: nothing is written (slots >= N * page_size are
    dropped too). Returns the updated (k_pages, v_pages); jit it with the caches donated to
    update them in place. Slots must be distinct among the written tokens.
    """
    if k_pages.ndim != 3 or v_pages.shape != k_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [num_pages, page_size / f, f * num_kv_heads * "
            "head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}"
        )
    num_pages, rows, width = k_pages.shape
    page_size = rows if page_size is None else page_size
    if page_size % rows:
        raise ValueError(f"page_size {page_size} is not a whole number of the pages' {rows} "
                         "rows")
    if slot_mapping.dtype != jnp.int32 or slot_mapping.ndim != 1:
        raise ValueError(
            f"slot_mapping must be int32[T], got {slot_mapping.dtype}{list(slot_mapping.shape)}"
        )
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.ndim != 3 or x.shape[0] != slot_mapping.shape[0] or x.shape[1] * x.shape[2] * (
                page_size // rows) != width:
            raise ValueError(f"{name} must be [T={slot_mapping.shape[0]}, num_kv_heads, "
                             f"head_dim] filling the pages' rows of {width} values with "
                             f"{page_size // rows} token(s) each, got {x.shape}")
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # [T]
    offset = slot_mapping % page_size  # [T]
    if page_size == rows:
        tokens = slot_mapping.shape[0]
        k_rows = k_new.reshape(tokens, width).astype(k_pages.dtype)  # [T, Hkv * D]
        v_rows = v_new.reshape(tokens, width).astype(v_pages.dtype)  # [T, Hkv * D]
        return (k_pages.at[page, offset].set(k_rows, mode="drop"),
                v_pages.at[page, offset].set(v_rows, mode="drop"))
    return (_write_folded(k_pages, k_new, page, offset, page_size // rows),
            _write_folded(v_pages, v_new, page, offset, page_size // rows))


def _write_folded(pages, new, page, offset, fold):
    """Scatters new [T, Hkv, D] into pages [N, rows, fold * Hkv * D]: token t's head h to row
    offset[t] % rows of page[t], lanes starting at (h * fold + offset[t] // rows) * D."""
    rows = pages.shape[1]
    num_kv_heads, head_dim = new.shape[1:]
    lane = (jnp.arange(num_kv_heads)[None, :] * fold + (offset // rows)[:, None]) * head_dim
    row = jnp.broadcast_to((offset % rows)[:, None], lane.shape)  # [T, Hkv]
    where = jnp.stack([jnp.broadcast_to(page[:, None], lane.shape), row, lane],
                      axis=-1)  # [T, Hkv, 3]: (page, row, first lane)
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(2,), inserted_window_dims=(0, 1),
        scatter_dims_to_operand_dims=(0, 1, 2))
    return jax.lax.scatter(pages, where, new.astype(pages.dtype), numbers,
                           indices_are_sorted=False, unique_indices=False,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
