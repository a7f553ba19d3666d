"""CPU attention for the multi-step decode loop: each row's context gathered once and carried.

Inside `Runner`'s decode loop every step attends the same rows to the same cached context
plus the few tokens the loop itself has added. The per-step path (`jnp_attention`) gathers
every row's pages in every step and layer, which on CPU costs more than the attention
arithmetic. Here the gather happens once per loop (`with_context`): each layer's cache gains
the rows' keys and values heads-major, `[S, Hkv, L, D]`, where L covers the whole page table
so that column j holds position j. Each step writes its new K/V both into the pages (they
outlive the loop) and into column `position` of that context, then attends over the context
alone: one softmax over one set of keys.

Only for the CPU ("reference") backend, and only when the gathered context of all layers fits
`MAX_CONTEXT_BYTES`; the Pallas kernels read pages in place and need none of this.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import pallas_kernels
import sharding
from jaxserve.model.jnp_attention import gather_rows, row_attention, visibility_bias

MAX_CONTEXT_BYTES = 1 << 30  # gathered K and V of all layers, per device
# A one-row loop carries its row twice: with a unit row dimension XLA fuses the context write
# into both of its consumers (the q·k dot and the loop carry) and copies the context in every
# step (9.6 against 8 ms a step for the bench model at batch 1).
MIN_CONTEXT_ROWS = 2


def fits(rows: int, pages_per_seq: int, page_size: int, num_kv_heads: int, head_dim: int,
         num_layers: int, itemsize: int) -> bool:
    """Whether a loop over `rows` rows may gather their whole context up front."""
    per_layer = 2 * rows * pages_per_seq * page_size * num_kv_heads * head_dim * itemsize
    return per_layer * num_layers <= MAX_CONTEXT_BYTES


def _gather(k_pages, v_pages, page_indices):
    """Pages `[N, page_size, Hkv, D]`, page_indices `[S, P]` → keys, values `[S, Hkv, L, D]`."""
    return gather_rows(k_pages, page_indices), gather_rows(v_pages, page_indices)


def with_context(caches, page_indices, mesh: Mesh | None) -> list:
    """Per layer `(k_pages, v_pages)` → `(k_pages, v_pages, keys, values)`: the cache the
    loop carries, its context split on heads over a mesh like the pages."""
    if page_indices.shape[0] < MIN_CONTEXT_ROWS:
        page_indices = jnp.repeat(page_indices, MIN_CONTEXT_ROWS, axis=0)
    gather = _gather
    if mesh is not None:
        gather = sharding.shard_over_heads(_gather, mesh, (2, 2, None), (1, 1))
    return [(k_pages, v_pages, *gather(k_pages, v_pages, page_indices))
            for k_pages, v_pages in caches]


def context_bias(position, live, width: int, sliding_window: int | None) -> jax.Array:
    """`[S, L]` float32: 0 where a row sees a context column in this step, else -inf.
    position `[S]`: the token fed this step (written before attending); live `[S]`: real
    rows."""
    slot = jnp.arange(width)  # [L]
    visible = live[:, None] & (slot[None, :] <= position[:, None])
    if sliding_window is not None:
        visible &= position[:, None] - slot[None, :] < sliding_window
    return visibility_bias(visible)


def _write_column(context, new, column):
    """context `[S, Hkv, L, D]` with `new [S, Hkv, D]` written at each row's `column [S]`,
    in place."""
    row = jnp.arange(context.shape[0])
    return context.at[row, :, column].set(new.astype(context.dtype), mode="promise_in_bounds",
                                          unique_indices=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopAttention:
    """The model's `AttentionFn` for one decode-loop step on CPU (one token per row); its
    layer cache is `(k_pages, v_pages, keys, values)` from `with_context`."""

    slot_mapping: jax.Array  # [S] int32 page slots, -1 for finished or padding rows
    column: jax.Array  # [S] int32 context column of the new token: its position
    bias: jax.Array  # [S, L] float32, from `context_bias`
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))

    @staticmethod
    def _local(q, k, v, k_pages, v_pages, keys, values, slot_mapping, column, bias):
        k_pages, v_pages = pallas_kernels.write_kv(k_pages, v_pages, k, v, slot_mapping)
        rows = q.shape[0]
        if keys.shape[0] > rows:  # a one-row loop's context holds its row twice
            q, k, column, bias, v = (jnp.repeat(a, keys.shape[0], axis=0)
                                     for a in (q, k, column, bias, v))
        keys, values = _write_column(keys, k, column), _write_column(values, v, column)
        out = row_attention(q, keys, values, bias)[:rows]
        return out, (k_pages, v_pages, keys, values)

    def __call__(self, layer_index, q, k, v, layer_cache):
        local = self._local
        if self.mesh is not None:
            #            q  k  v  pages context  column, slots, bias (replicated)
            head_dims = (1, 1, 1, 2, 2, 1, 1, None, None, None)
            local = sharding.shard_over_heads(local, self.mesh, head_dims, (1, (2, 2, 1, 1)))
        return local(q, k, v, *layer_cache, self.slot_mapping, self.column,
                     self.bias)  # out [S, Hq, D]
