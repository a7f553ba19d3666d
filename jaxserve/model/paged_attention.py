"""Paged-KV attention for the serving engine: write the step's K/V into the donated page
cache, then attend with `ragged_paged_attention` (the Pallas kernels), or on CPU with the jnp
path of `jnp_attention` (its per-step `StepPlan` built once by `for_step`).

The call signature is the model's `AttentionFn`; tokens are a flat ragged batch `[T]`.
With a `mesh`, the cache write and the kernel run inside `jax.shard_map` over the "model"
axis: each device sees only its heads (q, k, v and the cache split on heads, step metadata
replicated), so a kernel never sees the mesh and attention needs no collective.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import pallas_kernels
import sharding
from jaxserve.model import jnp_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedAttention:
    """Step metadata the kernels need; the per-layer cache is `(k_pages, v_pages)`."""

    slot_mapping: jax.Array  # [T] int32, -1 for padding tokens
    kv_lens: jax.Array  # [S] int32
    page_indices: jax.Array  # [S, P] int32
    cu_q_lens: jax.Array  # [S + 1] int32
    num_seqs: jax.Array  # [1] int32
    cpu_plan: jnp_attention.StepPlan | None = None  # the jnp path's per-step masks
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    backend: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Stacked layers: the cache is one pool of every layer's pages, layer l's at
    # [l * pages_per_layer, (l + 1) * pages_per_layer); None: the cache is the layer's own.
    pages_per_layer: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def for_step(cls, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                 page_size: int, sliding_window: int | None, backend: str | None,
                 mesh: Mesh | None, pages_per_layer: int | None = None) -> "PagedAttention":
        """Inside a traced step: the metadata, plus the jnp path's `StepPlan` (built once
        here rather than in every layer) when `backend` is "reference"."""
        plan = None
        if backend == "reference":
            if pages_per_layer is not None:
                raise ValueError("the CPU attention path takes per-layer caches, not stacked "
                                 "layers (scan_layers)")
            plan = jnp_attention.plan_step(slot_mapping.shape[0], kv_lens, page_indices,
                                           cu_q_lens, num_seqs, page_size, sliding_window)
        return cls(slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, plan,
                   sliding_window, backend, mesh, pages_per_layer)

    def _local(self, q, k, v, k_pages, v_pages, slot_mapping, kv_lens, page_indices,
               cu_q_lens, num_seqs, plan):
        """Attention on the heads at hand: q [T, Hq, D], k/v [T, Hkv, D], pages
        [N, page_size, Hkv, D] → out [T, Hq, D] and the updated pages."""
        k_pages, v_pages = pallas_kernels.write_kv(k_pages, v_pages, k, v, slot_mapping)
        if plan is not None:  # the jnp path for CPU
            out = jnp_attention.ragged_attention(q, k, v, k_pages, v_pages, page_indices, plan)
        else:
            out = pallas_kernels.ragged_paged_attention(
                q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                sliding_window=self.sliding_window, backend=self.backend)
        return out, (k_pages, v_pages)

    def _layer_pages(self, layer_index, page_size: int):
        """Slots and page tables addressing this layer's pages of the cache."""
        if self.pages_per_layer is None:
            return self.slot_mapping, self.page_indices
        first_page = layer_index * self.pages_per_layer
        slots = jnp.where(self.slot_mapping < 0, -1,
                          self.slot_mapping + first_page * page_size)  # [T]
        return slots, self.page_indices + first_page  # [S, P]

    def __call__(self, layer_index, q, k, v, layer_cache):
        k_pages, v_pages = layer_cache  # [N, page_size, Hkv, D] each (N of all layers: stacked)
        slot_mapping, page_indices = self._layer_pages(layer_index, k_pages.shape[1])
        local = self._local
        if self.mesh is not None:
            #                  q  k  v  k_pages v_pages  metadata and plan (replicated)
            head_dims = (1, 1, 1, 2, 2, None, None, None, None, None, None)
            local = sharding.shard_over_heads(local, self.mesh, head_dims, (1, (2, 2)))
        return local(q, k, v, k_pages, v_pages, slot_mapping, self.kv_lens, page_indices,
                     self.cu_q_lens, self.num_seqs, self.cpu_plan)  # out [T, Hq, D]
