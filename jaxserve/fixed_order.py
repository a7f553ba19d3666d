"""Batch-invariant projections for deterministic inference (`enable_deterministic_inference`).

XLA:CPU picks a dot's algorithm by its shape: a one-row product, a few rows and many rows
run different kernels that sum the contracted axis in different orders, so the same token's
projection changes in its last bits with the number of rows in the step (the step programs
are padded to token buckets, the decode loop to sequence buckets). A row's place among the
rows of one shape does not change it. So under this mode every projection runs on tiles of
a fixed number of rows (`ROW_TILE`), one tile after another (`lax.map`): each token's product
is always the same shape's, whatever else the step holds. The rows are padded to whole tiles.
Row reductions (a norm's mean, a log-softmax's sum) are the same: XLA:CPU vectorizes them
across rows or along a row depending on how many rows there are, so they go by tiles too
(`rowwise`). A mixture of experts runs a tile at a time as a whole, its experts gathered
per (token, expert) pair (`jaxserve.model.moe`), not in slots sized by the routing.

The mode is a setting read while a program is traced: the runner traces a program inside
`row_tiles(ROW_TILE)` (`traced_with_row_tiles`); `jaxserve.model.quantization.project`, the
norms and the sampler's log-softmax ask `row_tile()`. Outside it nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable

import jax
import jax.numpy as jnp

ROW_TILE = 8  # rows of every projection under the mode (its cost: docs/performance.md)

_ROW_TILE: contextvars.ContextVar[int | None] = contextvars.ContextVar("row_tile", default=None)


@contextlib.contextmanager
def row_tiles(tile: int | None):
    """Trace projections on tiles of `tile` rows inside this block (None: as they are)."""
    token = _ROW_TILE.set(tile)
    try:
        yield
    finally:
        _ROW_TILE.reset(token)


def row_tile() -> int | None:
    """The rows per tile projections are traced with now, or None (the default mode)."""
    return _ROW_TILE.get()


def traced_with_row_tiles(function: Callable, tile: int = ROW_TILE) -> Callable:
    """`function`, which jax traces with its projections on tiles of `tile` rows."""

    @functools.wraps(function)
    def traced(*args, **kwargs):
        with row_tiles(tile):
            return function(*args, **kwargs)

    return traced


def rowwise(function: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """`function(x)` for a row-wise `function` of x `[..., K]` (its leading axes the rows):
    as it is, or under the mode on tiles of `row_tile()` rows (`by_row_tiles`)."""
    tile = row_tile()
    return function(x) if tile is None else by_row_tiles(function, x, tile)


def by_row_tiles(product: Callable[[jax.Array], jax.Array], x: jax.Array,
                 tile: int) -> jax.Array:
    """`product(x)` for a row-wise `product` (`[M, K] -> [M, ...]`, or a tuple of such),
    computed `tile` rows at a time: x `[..., K]` (its leading axes are the rows) →
    `[..., ...]` (each)."""
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)  # [M, K]
    count = rows.shape[0]
    padded = -(-count // tile) * tile
    tiles = jnp.pad(rows, ((0, padded - count), (0, 0))).reshape(-1, tile, width)
    out = jax.lax.map(product, tiles)  # each leaf [M / tile, tile, ...]

    def untiled(a):
        a = a.reshape(padded, *a.shape[2:])[:count]
        return a.reshape(*lead, *a.shape[1:])

    return jax.tree.map(untiled, out)
