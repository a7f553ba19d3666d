"""A step's inputs as one flat int32 buffer: one host→device copy per step instead of one
per field.

A `StepInput` has some twenty small arrays; placing each on the device costs a transfer
(and, in JAX, a dispatch of a few tens of microseconds on the host) per field per step. The
runner instead packs every field but the token history into one `[N]` int32 buffer, copies
that, and the program unpacks it with static slices: float32 and uint32 fields travel as
their bit patterns, bools as 0/1. The layout (which field sits where) depends only on the
bucket shape, so it is fixed per compiled program.

The token history (`[S, max_model_len]`, penalty rows only) stays a separate argument: it is
large and almost always unused, so the runner copies it only for a step with penalty rows
and otherwise passes one all-padding array kept on the device.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree sits in the packed buffer."""

    treedef: jax.tree_util.PyTreeDef
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]  # start of each leaf in the buffer
    size: int  # buffer length

    @classmethod
    def of(cls, tree) -> "Layout":
        """The layout of `tree`, a pytree of arrays or `ShapeDtypeStruct`s (4-byte or bool
        leaves)."""
        leaves, treedef = jax.tree.flatten(tree)
        shapes = tuple(tuple(leaf.shape) for leaf in leaves)
        dtypes = tuple(np.dtype(leaf.dtype) for leaf in leaves)
        for dtype in dtypes:
            if dtype.itemsize != 4 and dtype != np.bool_:
                raise ValueError(f"cannot pack a {dtype} field: 4-byte and bool fields only")
        sizes = [math.prod(shape) for shape in shapes]
        offsets = tuple(int(x) for x in np.cumsum([0] + sizes[:-1]))
        return cls(treedef, shapes, dtypes, offsets, sum(sizes))


def pack(tree, layout: Layout) -> np.ndarray:
    """`tree`'s leaves, flattened and concatenated as int32 `[layout.size]` (host numpy)."""
    leaves = jax.tree.leaves(tree)
    parts = [np.asarray(leaf, dtype).reshape(-1) for leaf, dtype in zip(leaves, layout.dtypes)]
    parts = [p.astype(np.int32) if p.dtype == np.bool_ else p.view(np.int32) for p in parts]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def unpack(buffer: jax.Array, layout: Layout):
    """The pytree packed into `buffer` (`[layout.size]` int32), inside a traced program."""
    leaves = []
    for shape, dtype, offset in zip(layout.shapes, layout.dtypes, layout.offsets):
        part = buffer[offset:offset + math.prod(shape)].reshape(shape)
        if dtype == np.bool_:
            part = part != 0
        elif dtype != np.int32:
            part = jax.lax.bitcast_convert_type(part, dtype)
        leaves.append(part)
    return jax.tree.unflatten(layout.treedef, leaves)


def packed_shape(layout: Layout, sharding) -> jax.ShapeDtypeStruct:
    """The abstract packed buffer (what a program is compiled for)."""
    return jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=sharding)
