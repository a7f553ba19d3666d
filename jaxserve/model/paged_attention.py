"""Paged-KV attention for the serving engine: write the step's K/V into the donated page
cache, then attend with `ragged_paged_attention` (the Pallas kernel, or its jnp reference).

The call signature is the model's `AttentionFn`; tokens are a flat ragged batch `[T]`.
"""

from __future__ import annotations

import dataclasses

import jax

import pallas_kernels


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedAttention:
    """Step metadata the kernels need; the per-layer cache is `(k_pages, v_pages)`."""

    slot_mapping: jax.Array  # [T] int32, -1 for padding tokens
    kv_lens: jax.Array  # [S] int32
    page_indices: jax.Array  # [S, P] int32
    cu_q_lens: jax.Array  # [S + 1] int32
    num_seqs: jax.Array  # [1] int32
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    backend: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __call__(self, layer_index, q, k, v, layer_cache):
        k_pages, v_pages = layer_cache  # [N, page_size, Hkv, D] each
        k_pages, v_pages = pallas_kernels.write_kv(k_pages, v_pages, k, v, self.slot_mapping)
        out = pallas_kernels.ragged_paged_attention(
            q, k_pages, v_pages, self.kv_lens, self.page_indices, self.cu_q_lens,
            self.num_seqs, sliding_window=self.sliding_window, backend=self.backend)
        return out, (k_pages, v_pages)  # out [T, Hq, D]
