"""CPU attention for the multi-step decode loop: gather each row's context once per loop.

Inside `Runner`'s decode loop every step attends the same rows to the same cached context
plus the few tokens the loop itself has added. The per-step path (`jnp_attention`) gathers
every row's pages and reorders them to a heads-major layout in every step and layer, which on
CPU costs more than the attention arithmetic. Here that gather happens once per loop
(`gather_context`, heads-major per layer); each step then reads the gathered context,
plus the loop's own tokens from the few pages they were written to (`LoopStepPlan`).

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
from jaxserve.model.jnp_attention import visibility_bias

MAX_CONTEXT_BYTES = 1 << 30  # gathered K and V of all layers, per device


def fits(rows: int, pages_per_seq: int, page_size: int, num_kv_heads: int, head_dim: int,
         num_layers: int, itemsize: int) -> bool:
    """Whether a loop over `rows` rows may gather their whole context up front."""
    per_layer = 2 * rows * pages_per_seq * page_size * num_kv_heads * head_dim * itemsize
    return per_layer * num_layers <= MAX_CONTEXT_BYTES


def _gather(k_pages, v_pages, page_indices):
    """Pages `[N, page_size, Hkv, D]`, page_indices `[S, P]` → keys `[S, Hkv, D, L]`, values
    `[S, Hkv, L, D]`: the layouts in which XLA's CPU dots for q·k and p·v need no transpose
    (q·k against `[S, Hkv, L, D]` keys measured 14x slower: 19.6 ms against 1.4 ms for
    32 rows of 640 tokens)."""
    rows = page_indices.shape[0]
    num_kv_heads, head_dim = k_pages.shape[2:]
    gathered = lambda pages: pages[page_indices].reshape(  # noqa: E731
        rows, -1, num_kv_heads, head_dim)  # [S, L, Hkv, D]
    return gathered(k_pages).transpose(0, 2, 3, 1), gathered(v_pages).transpose(0, 2, 1, 3)


def gather_context(caches, page_indices, mesh: Mesh | None):
    """Per layer `(keys [S, Hkv, D, L], values [S, Hkv, L, D])`, split on heads over a
    mesh."""
    gather = _gather
    if mesh is not None:
        gather = sharding.shard_over_heads(_gather, mesh, (2, 2, None), (1, 1))
    return [gather(k_pages, v_pages, page_indices) for k_pages, v_pages in caches]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopStepPlan:
    """What each row sees in one loop step, computed once for all layers."""

    context_bias: jax.Array  # [S, L] float32, 0 for visible context slots, else -inf
    tail_pages: jax.Array  # [S, n] int32, the pages holding the loop's own tokens
    tail_bias: jax.Array  # [S, n * page_size] float32, 0 for the loop's visible tokens


def plan_loop_step(start, position, live, page_indices, page_size: int, max_steps: int,
                   sliding_window: int | None) -> LoopStepPlan:
    """start `[S]`: tokens cached before the loop (all in the gathered context); position
    `[S]`: the token fed this step (its K/V written now); live `[S]`: real, unfinished rows."""
    pages_per_seq = page_indices.shape[1]
    slot = jnp.arange(pages_per_seq * page_size)  # [L]
    context = live[:, None] & (slot[None, :] < start[:, None])  # [S, L]
    tail_count = (max_steps - 1) // page_size + 2  # pages the loop's tokens can span
    column = start[:, None] // page_size + jnp.arange(tail_count)[None, :]  # [S, n]
    tail_pages = jnp.take_along_axis(page_indices, jnp.minimum(column, pages_per_seq - 1),
                                     axis=1)
    tail_pos = (column[:, :, None] * page_size
                + jnp.arange(page_size)[None, None, :]).reshape(column.shape[0], -1)  # [S, n*ps]
    tail = (live[:, None] & (tail_pos >= start[:, None])
            & (tail_pos <= position[:, None]))  # [S, n * page_size]
    if sliding_window is not None:
        context &= position[:, None] - slot[None, :] < sliding_window
        tail &= position[:, None] - tail_pos < sliding_window
    return LoopStepPlan(visibility_bias(context), tail_pages.astype(jnp.int32),
                        visibility_bias(tail))


def _attend(q, k_pages, v_pages, context_keys, context_values, plan: LoopStepPlan):
    """q `[S, Hq, D]` → `[S, Hq, D]`: softmax over [gathered context ++ the loop's tokens]."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    qg = q.astype(jnp.float32).reshape(rows, num_kv_heads, -1, head_dim) * head_dim ** -0.5
    tail_keys = k_pages[plan.tail_pages].reshape(rows, -1, num_kv_heads, head_dim)
    tail_values = v_pages[plan.tail_pages].reshape(rows, -1, num_kv_heads, head_dim)
    context_scores = (jnp.einsum("shgd,shdl->shgl", qg, context_keys.astype(jnp.float32))
                      + plan.context_bias[:, None, None, :])  # [S, Hkv, G, L]
    tail_scores = (jnp.einsum("shgd,sthd->shgt", qg, tail_keys.astype(jnp.float32))
                   + plan.tail_bias[:, None, None, :])  # [S, Hkv, G, n * page_size]
    peak = jnp.maximum(context_scores.max(-1, keepdims=True), tail_scores.max(-1, keepdims=True))
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    context_weights, tail_weights = jnp.exp(context_scores - peak), jnp.exp(tail_scores - peak)
    total = context_weights.sum(-1, keepdims=True) + tail_weights.sum(-1, keepdims=True)
    out = (jnp.einsum("shgl,shld->shgd", context_weights, context_values.astype(jnp.float32))
           + jnp.einsum("shgt,sthd->shgd", tail_weights, tail_values.astype(jnp.float32)))
    out = jnp.where(total > 0, out / jnp.maximum(total, 1e-30), 0.0)  # [S, Hkv, G, D]
    return out.reshape(rows, num_heads, head_dim).astype(q.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopAttention:
    """The model's `AttentionFn` for one decode-loop step on CPU (one token per row)."""

    slot_mapping: jax.Array  # [S] int32, -1 for finished or padding rows
    context: list  # per layer (keys, values), from `gather_context`
    plan: LoopStepPlan
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))

    def _local(self, q, k, v, k_pages, v_pages, context_keys, context_values, slot_mapping,
               plan):
        k_pages, v_pages = pallas_kernels.write_kv(k_pages, v_pages, k, v, slot_mapping)
        out = _attend(q, k_pages, v_pages, context_keys, context_values, plan)
        return out, (k_pages, v_pages)

    def __call__(self, layer_index, q, k, v, layer_cache):
        k_pages, v_pages = layer_cache  # [N, page_size, Hkv, D] each
        context_keys, context_values = self.context[layer_index]
        local = self._local
        if self.mesh is not None:
            #            q  k  v  pages  context  slots plan (replicated)
            head_dims = (1, 1, 1, 2, 2, 1, 1, None, None)
            local = sharding.shard_over_heads(local, self.mesh, head_dims, (1, (2, 2)))
        return local(q, k, v, k_pages, v_pages, context_keys, context_values,
                     self.slot_mapping, self.plan)  # out [S, Hq, D]
