"""Run a per-device function (an attention kernel) on each device's heads via `jax.shard_map`.

A Pallas kernel cannot be partitioned by XLA, so it must see plain per-device arrays: each
device gets its own slice of the head axis (q heads, kv heads, cache kv heads) and the full
step metadata, runs the kernel locally, and the outputs are reassembled on the same axis.
Attention is independent per head, so no collective is needed. `check_vma=False` because a
`pallas_call` inside carries no varying-manual-axes annotations.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P


def _spec(head_dim: int | None, ndim: int) -> P:
    return P(*("model" if i == head_dim else None for i in range(ndim)))


def _arg_specs(arg, head_dims):
    """Specs for one argument: one head dim for all its leaves, or a pytree of them."""
    if head_dims is None or isinstance(head_dims, int):
        return jax.tree.map(lambda a: _spec(head_dims, a.ndim), arg)
    return jax.tree.map(lambda a, d: _spec(d, a.ndim), arg, head_dims)


def shard_over_heads(fn: Callable, mesh: Mesh, arg_head_dims: tuple[int | None, ...],
                     out_head_dims) -> Callable:
    """Wrap `fn(*args)` so it runs per device on the "model" axis.

    `arg_head_dims[i]` is the head dimension of positional argument i (None: replicated,
    e.g. page tables): an int for all its leaves, or its pytree of ints (a cache of pages
    and scale pools).
    `out_head_dims` is `fn`'s output pytree with each array replaced by its head dimension
    (an int: outputs are always split on heads).
    """

    def wrapped(*args):
        in_specs = tuple(_arg_specs(arg, d) for arg, d in zip(args, arg_head_dims))
        out_shapes = jax.eval_shape(fn, *args)  # local shapes == global ones but heads
        out_specs = jax.tree.map(lambda s, d: _spec(d, len(s.shape)), out_shapes,
                                 out_head_dims)
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(*args)

    return wrapped
