"""Batch-invariant attention on CPU, for deterministic inference
(`enable_deterministic_inference`).

`cpu_step` attends by what each row is: a fresh prompt's token against the step's new keys,
a continued chunk against its cached context a quarter of the page table at a time, a decode
row against its pages in blocks of rows of alike length. The same token thus sums its
softmax and its weighted values in an order that depends on how it arrived (prefill, chunk,
decode, recompute after preemption) and on the shapes of the step it arrived in.

Here every token attends the same way: its query against its sequence's pages (this step's
keys already written there), in blocks of `KV_BLOCK_TOKENS` cached tokens from the first,
merged one after another with the log-sum-exp rescaling of an online softmax. A block is
always the same shape, its slots the same absolute positions, so a token's sums depend only
on its sequence's keys. Blocks past a token's own keys, which a longer neighbour in the tile
makes the loop visit, add exact zeros and leave its bits alone. Tokens go `QUERY_TILE` at a
time (`lax.map`), so a block's products always have the same shape whatever the step's size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.attention.cpu_step import PagePool, StepPlan, _merge, capped
from pallas_kernels import softmax
from pallas_kernels.reference import MASK_VALUE

QUERY_TILE = 8  # query tokens attended together
KV_BLOCK_TOKENS = 128  # cached tokens per block of the softmax (whole pages)


def fixed_order_attention(q, k_pool: PagePool, v_pool: PagePool, page_indices,
                          plan: StepPlan, sinks=None):
    """`ragged_paged_attention` for the step `plan` describes, this step's K/V already in the
    pages; `sinks` `[Hq]` float32 or None. q `[T, Hq, D]` → `[T, Hq, D]` (padding tokens:
    zeros)."""
    tokens, num_heads, head_dim = q.shape
    padded = -(-tokens // QUERY_TILE) * QUERY_TILE
    pad = lambda a: jnp.pad(a, [(0, padded - tokens)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
    tables = page_indices[plan.seq]  # [T, P] each token's page table
    tiles = [pad(a).reshape(-1, QUERY_TILE, *a.shape[1:])
             for a in (q, tables, plan.pos, plan.valid)]

    def one_tile(tile):
        return _attend_tile(*tile, k_pool, v_pool, plan, sinks)

    out = jax.lax.map(one_tile, tiles)  # [T / tile, tile, Hq, D]
    return out.reshape(padded, num_heads, head_dim)[:tokens]


def _attend_tile(q, tables, pos, valid, k_pool: PagePool, v_pool: PagePool, plan: StepPlan,
                 sinks):
    """One tile of queries q `[t, Hq, D]` at positions `pos [t]` (`valid [t]`: not padding)
    against their page tables `tables [t, P]` → `[t, Hq, D]`."""
    tile, num_heads, head_dim = q.shape
    page_size, pages_per_seq = k_pool.page_size, tables.shape[1]
    tokens_per_row = page_size // k_pool.pages.shape[1]  # kv_quant.tokens_per_row
    num_kv_heads = k_pool.pages.shape[2] // (tokens_per_row * head_dim)
    group = num_heads // num_kv_heads
    per_block = max(1, KV_BLOCK_TOKENS // page_size)  # pages a block reads
    queries = q.astype(jnp.float32) * head_dim ** -0.5  # [t, Hq, D]

    def one_block(block, parts):
        column = block * per_block + jnp.arange(per_block)  # [p] page-table columns
        chosen = tables[:, jnp.minimum(column, pages_per_seq - 1)]  # [t, p]
        keys = k_pool.rows(chosen).astype(jnp.float32)  # [t, Hkv, p * page_size, D]
        values = v_pool.rows(chosen).astype(jnp.float32)
        grouped = queries.reshape(tile, keys.shape[1], group, head_dim)  # [t, Hkv, G, D]
        slot = (column[:, None] * page_size + jnp.arange(page_size)).reshape(-1)  # [p * ps]
        visible = valid[:, None] & (slot[None, :] <= pos[:, None])  # [t, p * ps]
        if plan.sliding_window is not None:
            visible &= pos[:, None] - slot[None, :] < plan.sliding_window
        scores = capped(jnp.einsum("thgd,thud->thgu", grouped, keys), plan.soft_cap)
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)  # [t, Hkv, G, U]
        peak = jnp.max(scores, axis=-1)  # [t, Hkv, G]
        weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0)[..., None])
        acc = jnp.einsum("thgu,thud->thgd", weights, values)  # [t, Hkv, G, D]
        return _merge(parts, (peak, weights.sum(-1), acc))  # blocks in order, first first

    empty = (jnp.full((tile, num_kv_heads, group), -jnp.inf),
             jnp.zeros((tile, num_kv_heads, group)),
             jnp.zeros((tile, num_kv_heads, group, head_dim)))
    longest = jnp.max(jnp.where(valid, pos + 1, 0))  # keys of the tile's longest row
    blocks = -(-longest // (per_block * page_size))
    peak, total, acc = jax.lax.fori_loop(0, blocks, one_block, empty)
    grouped_sinks = None if sinks is None else sinks.reshape(num_kv_heads, group)[..., None]
    out = softmax.normalize(acc, jnp.maximum(peak, MASK_VALUE)[..., None], total[..., None],
                            grouped_sinks)  # [t, Hkv, G, D]
    return out.reshape(tile, num_heads, head_dim).astype(q.dtype)
