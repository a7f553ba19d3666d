"""CPU attention for the multi-step decode loop: each row's context gathered once and carried.

Inside `Runner`'s decode loop every step attends the same rows to the same cached context
plus the few tokens the loop itself has added. The per-step path (`jnp_attention`) gathers
every row's pages in every step and layer, which on CPU costs more than the attention
arithmetic. Here the rows' keys and values are gathered heads-major (`gather_context`: keys
`[S, Hkv, D, L]`, values `[S, Hkv, L, D]` per layer, L covering the whole page table so that
column j holds position j) and carried through the loop beside the pages. Each step writes
its new K/V both into the pages (they outlive the loop) and into column `position` of that
context, then attends over the context alone: one softmax over one set of keys.

At the loop's end the context holds every row's tokens so far. The runner keeps it
(`HeldContext`), and a next loop over the very same rows starts from it without gathering;
any other step drops it.

Only for the CPU ("reference") backend, and only when the gathered context of all layers fits
`MAX_CONTEXT_BYTES`; the Pallas kernels read pages in place and need none of this.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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
    width = pages_per_seq * page_size
    per_layer = 2 * context_rows(rows) * num_kv_heads * width * head_dim * itemsize
    return per_layer * num_layers <= MAX_CONTEXT_BYTES


def context_rows(rows: int) -> int:
    """Rows of the gathered context of a loop over `rows` rows."""
    return max(rows, MIN_CONTEXT_ROWS)


def context_sharding(mesh: Mesh) -> NamedSharding:
    """The context (keys or values) split on kv heads like the pages."""
    return NamedSharding(mesh, P(None, sharding.LOGICAL_AXIS_RULES["kv_heads"]))


def _gather(k_pages, v_pages, page_indices):
    """Pages `[N, page_size, Hkv, D]`, page_indices `[S, P]` → keys `[S, Hkv, D, L]` (their
    q·k reads faster transposed; the transpose is paid once per gather), values
    `[S, Hkv, L, D]`."""
    return (gather_rows(k_pages, page_indices).transpose(0, 1, 3, 2),
            gather_rows(v_pages, page_indices))


def gather_context(caches, page_indices, mesh: Mesh | None) -> list:
    """Per layer `(k_pages, v_pages)` → `(keys, values)` as `_gather` lays them out, with
    `context_rows(S)` rows (a one-row loop's row twice), split on heads over a mesh like the
    pages."""
    rows = page_indices.shape[0]
    page_indices = jnp.repeat(page_indices, context_rows(rows) // rows, axis=0)
    gather = _gather
    if mesh is not None:
        gather = sharding.shard_over_heads(_gather, mesh, (2, 2, None), (1, 1))
    return [gather(k_pages, v_pages, page_indices) for k_pages, v_pages in caches]


@dataclasses.dataclass
class HeldContext:
    """What a finished decode loop leaves for the next one: its gathered context, now holding
    every row's tokens up to where the row stopped, and what it was gathered for."""

    arrays: list  # per layer (keys, values) on device, from `gather_context`
    page_indices: np.ndarray  # [S, P] the loop's page tables
    positions: np.ndarray  # [S] each row's position when the loop began
    produced: jax.Array  # [S] tokens each row produced in the loop (on device)
    num_seqs: int

    def serves(self, page_indices: np.ndarray, positions: np.ndarray, num_seqs: int,
               page_size: int) -> bool:
        """Whether a new loop (its host inputs) continues exactly these rows: every real row
        in the same place, at the position the last loop left it, with the same pages under
        its context. Rows past `num_seqs` are padding and do not matter."""
        if page_indices.shape != self.page_indices.shape or num_seqs > self.num_seqs:
            return False
        reached = (self.positions + np.asarray(self.produced))[:num_seqs]  # [n]
        if not np.array_equal(positions[:num_seqs], reached):
            return False
        first_slot = np.arange(page_indices.shape[1]) * page_size  # [P]
        under = first_slot[None, :] < reached[:, None]  # [n, P] pages holding context
        return np.array_equal(np.where(under, page_indices[:num_seqs], 0),
                              np.where(under, self.page_indices[:num_seqs], 0))


def context_bias(position, live, width: int, sliding_window: int | None) -> jax.Array:
    """`[S, L]` float32: 0 where a row sees a context column in this step, else -inf.
    position `[S]`: the token fed this step (written before attending); live `[S]`: real
    rows."""
    slot = jnp.arange(width)  # [L]
    visible = live[:, None] & (slot[None, :] <= position[:, None])
    if sliding_window is not None:
        visible &= position[:, None] - slot[None, :] < sliding_window
    return visibility_bias(visible)


def _write_new_tokens(keys, values, k, v, column):
    """keys `[S, Hkv, D, L]`, values `[S, Hkv, L, D]` with each row's new k, v `[S, Hkv, D]`
    written at its `column [S]`, in place."""
    row = jnp.arange(keys.shape[0])
    write = dict(mode="promise_in_bounds", unique_indices=True)
    return (keys.at[row, :, :, column].set(k.astype(keys.dtype), **write),
            values.at[row, :, column].set(v.astype(values.dtype), **write))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopAttention:
    """The model's `AttentionFn` for one decode-loop step on CPU (one token per row); its
    layer cache is `(k_pages, v_pages, keys, values)`, the context from `gather_context`."""

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
        keys, values = _write_new_tokens(keys, values, k, v, column)
        out = row_attention(q, keys, values, bias, keys_transposed=True)[:rows]
        return out, (k_pages, v_pages, keys, values)

    def __call__(self, layer_index, q, k, v, layer_cache):
        local = self._local
        if self.mesh is not None:
            #            q  k  v  pages context  slots, column, bias (replicated)
            head_dims = (1, 1, 1, 2, 2, 1, 1, None, None, None)
            local = sharding.shard_over_heads(local, self.mesh, head_dims, (1, (2, 2, 1, 1)))
        return local(q, k, v, *layer_cache, self.slot_mapping, self.column,
                     self.bias)  # out [S, Hq, D]
