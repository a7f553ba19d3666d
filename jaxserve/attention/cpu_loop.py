"""The CPU backend's decode loop: each row's context gathered once per loop and carried.

Every step of the runner's decode loop attends the same rows to the same cached context plus
the few tokens the loop itself adds. The per-step path (`cpu_step`) gathers every row's
pages in every step and layer, which on CPU costs more than the attention arithmetic. Here
the loop starts by gathering the rows' keys and values heads-major (`gather_context`: keys
`[S, Hkv, D, L]`, values `[S, Hkv, L, D]` per layer, L covering the whole page table so that
column j holds position j), carried through the loop beside the pages. Each step writes its
new K/V both into the pages (they outlive the loop) and into column `position` of that
context, then attends over the context alone: one softmax over one set of keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import pallas_kernels
import sharding
from jaxserve.attention.cpu_step import gather_rows, row_attention, visibility_bias

MAX_CONTEXT_BYTES = 1 << 30  # gathered K and V of all layers, per device


def _gather(k_pages, v_pages, page_indices):
    """Pages `[N, page_size, Hkv, D]`, page_indices `[S, P]` → keys `[S, Hkv, D, L]` (their
    q·k reads faster transposed; the transpose is paid once per loop), values
    `[S, Hkv, L, D]`."""
    return (gather_rows(k_pages, page_indices).transpose(0, 1, 3, 2),
            gather_rows(v_pages, page_indices))


def gather_context(caches, page_indices, mesh: Mesh | None) -> list:
    """Per layer `(k_pages, v_pages)` → `(keys, values)` as `_gather` lays them out, split on
    heads over a mesh like the pages."""
    gather = _gather
    if mesh is not None:
        gather = sharding.shard_over_heads(_gather, mesh, (2, 2, None), (1, 1))
    return [gather(k_pages, v_pages, page_indices) for k_pages, v_pages in caches]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopStep:
    """One loop step's metadata: where each row's new token goes and what it sees."""

    column: jax.Array  # [S] int32 context column of the new token: its position
    bias: jax.Array  # [S, L] float32, 0 where the row sees a context column, else -inf

    @classmethod
    def of(cls, kv_lens, width: int, sliding_window: int | None) -> "LoopStep":
        """From the step's kv lengths `[S]` (0: a padding row) and the context width L."""
        position = jnp.maximum(kv_lens - 1, 0)  # [S] the token fed this step
        slot = jnp.arange(width)  # [L]
        visible = (kv_lens[:, None] > 0) & (slot[None, :] <= position[:, None])
        if sliding_window is not None:
            visible &= position[:, None] - slot[None, :] < sliding_window
        return cls(position.astype(jnp.int32), visibility_bias(visible))


def attend(q, k, v, layer_cache, slots, step: LoopStep):
    """q `[S, Hq, D]`, k/v `[S, Hkv, D]`, layer_cache `(k_pages, v_pages, keys, values)` →
    (out `[S, Hq, D]`, the cache with the new K/V in the pages and the context)."""
    k_pages, v_pages, keys, values = layer_cache
    k_pages, v_pages = pallas_kernels.write_kv(k_pages, v_pages, k, v, slots)
    row = jnp.arange(keys.shape[0])
    write = dict(mode="promise_in_bounds", unique_indices=True)
    keys = keys.at[row, :, :, step.column].set(k.astype(keys.dtype), **write)
    values = values.at[row, :, step.column].set(v.astype(values.dtype), **write)
    out = row_attention(q, keys, values, step.bias, keys_transposed=True)
    return out, (k_pages, v_pages, keys, values)
