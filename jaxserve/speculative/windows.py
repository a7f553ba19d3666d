"""Where a speculative round's tokens go: each row's cache slots through its page table, and
a few tokens a row laid out as one flat ragged batch (the verification's and an EAGLE head's
catch-up forward)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.attention import PagedBatch


def page_slots(page_indices: jax.Array, at: jax.Array, page_size: int,
               writes: jax.Array) -> jax.Array:
    """The cache slots of positions `at [S, n]` through each row's page table `[S, P]`; -1
    where not `writes [S, n]` or past the table (nothing is written there)."""
    column = at // page_size
    columns = page_indices.shape[1]
    page = jnp.take_along_axis(page_indices, jnp.minimum(column, columns - 1), axis=1)
    return jnp.where(writes & (column < columns), page * page_size + at % page_size, -1)


def _scattered(values: jax.Array, index: jax.Array, keep: jax.Array, size: int,
               fill) -> jax.Array:
    """`values [S, W]` placed at flat `index [S, W]` of a `[size]` array of `fill`, where
    `keep`."""
    flat = jnp.full((size,), fill, values.dtype)
    return flat.at[jnp.where(keep, index, size).reshape(-1)].set(values.reshape(-1),
                                                                mode="drop")


@dataclasses.dataclass
class RaggedWindow:
    """Up to W tokens a row `[S, W]` laid out as a flat ragged batch of `S * W` tokens (each
    row's leading `q_lens` tokens, packed): the attention batch, and where each (row, column)
    sits in the flat batch."""

    batch: PagedBatch
    index: jax.Array  # [S, W] int32 flat token index (past the row's tokens: the next row's)
    used: jax.Array  # [S, W] bool, within the row's q_len

    @classmethod
    def of(cls, q_lens, at, writes, page_indices, num_seqs, page_size: int,
           window_page_indices=None) -> "RaggedWindow":
        """`q_lens [S]` tokens a row at positions `at [S, W]` (leading columns), K/V written
        where `writes [S, W]`; `window_page_indices [S, P]`: the window layers' page tables
        of hybrid KV memory (None: without it)."""
        rows, width = at.shape
        col = jnp.arange(width)
        cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens)])
        index = cu_q_lens[:-1, None] + col[None, :]  # [S, W]
        used = col[None, :] < q_lens[:, None]

        def flat_slots(tables):  # [S * W] each token's slot through `tables`
            if tables is None:
                return None
            slots = page_slots(tables, at, page_size, used & writes)
            return _scattered(slots, index, used, rows * width, -1)

        kv_lens = jnp.where(q_lens > 0, at[:, 0] + q_lens, 0)
        batch = PagedBatch(flat_slots(page_indices), kv_lens, page_indices,
                           cu_q_lens.astype(jnp.int32), num_seqs,
                           window_slot_mapping=flat_slots(window_page_indices),
                           window_page_indices=window_page_indices)
        return cls(batch, index, used)

    def flat(self, values: jax.Array, fill) -> jax.Array:
        """`[S, W, ...]` per-column values as the flat batch's `[S * W, ...]`."""
        rows, width = self.index.shape
        flat = jnp.full((rows * width, *values.shape[2:]), fill, values.dtype)
        where = jnp.where(self.used, self.index, rows * width).reshape(-1)
        return flat.at[where].set(values.reshape(rows * width, *values.shape[2:]),
                                  mode="drop")

    def per_column(self, values: jax.Array) -> jax.Array:
        """The flat batch's `[S * W, ...]` back as `[S, W, ...]` (unused columns: whatever
        token their index holds)."""
        rows, width = self.index.shape
        return values[jnp.minimum(self.index, rows * width - 1)]


