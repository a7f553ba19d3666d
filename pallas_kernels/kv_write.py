"""Writing new tokens' K/V into the paged cache.

This is a plain XLA scatter, deliberately not a Pallas kernel: the write moves
only T * Hkv * D elements, XLA's scatter updates a donated buffer in place on
every backend (TPU, GPU, CPU), fuses with the K/V projection that produces
k_new / v_new, and partitions cleanly under shard_map over kv heads. A Pallas
kernel would need input_output_aliases plus per-backend lowering for no gain.

Indexing by (page, offset) rather than a flat slot avoids reshaping the cache,
which on TPU could force a relayout copy of the whole cache. The pages keep their kv heads
packed along the last axis (`kv_quant.page_shape`); a new token's `[Hkv, D]` becomes one row
of `Hkv * D` values.
"""

import jax.numpy as jnp


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Writes token t's K/V to flat slot slot_mapping[t] = page_id * page_size + offset.

    k_pages, v_pages [N, page_size, Hkv * D]; k_new, v_new [T, Hkv, D] (cast to the
    cache dtype); slot_mapping int32[T]. A negative slot marks a padding token:
    nothing is written (slots >= N * page_size are dropped too). Returns the updated
    (k_pages, v_pages); jit it with the caches donated to update them in place.
    Slots must be distinct among the written tokens.
    """
    if k_pages.ndim != 3 or v_pages.shape != k_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [num_pages, page_size, num_kv_heads * head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}"
        )
    num_pages, page_size, row = k_pages.shape
    if slot_mapping.dtype != jnp.int32 or slot_mapping.ndim != 1:
        raise ValueError(
            f"slot_mapping must be int32[T], got {slot_mapping.dtype}{list(slot_mapping.shape)}"
        )
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.ndim != 3 or x.shape[0] != slot_mapping.shape[0] or x.shape[1] * x.shape[2] != row:
            raise ValueError(f"{name} must be [T={slot_mapping.shape[0]}, num_kv_heads, "
                             f"head_dim] with num_kv_heads * head_dim = {row} (the pages' "
                             f"rows), got {x.shape}")
    tokens = slot_mapping.shape[0]
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # [T]
    offset = slot_mapping % page_size  # [T]
    k_rows = k_new.reshape(tokens, row).astype(k_pages.dtype)  # [T, Hkv * D]
    v_rows = v_new.reshape(tokens, row).astype(v_pages.dtype)  # [T, Hkv * D]
    k_pages = k_pages.at[page, offset].set(k_rows, mode="drop")
    v_pages = v_pages.at[page, offset].set(v_rows, mode="drop")
    return k_pages, v_pages
