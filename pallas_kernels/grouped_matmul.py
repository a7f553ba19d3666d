"""Grouped matmul for mixture-of-experts layers on TPU: JAX's megablox `gmm`, a Pallas
TPU kernel that multiplies each group of consecutive rows by its group's matrix and visits
only the tiles that hold rows.

    grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G] int32) -> [M, N]

Rows `[sum(group_sizes[:g]), sum(group_sizes[:g+1]))` are multiplied by `rhs[g]`; the group
sizes must add up to M (every row in a group). Why not `jax.lax.ragged_dot` on TPU: its
lowering for decode-sized M and many groups took 36 GiB of temporaries in the Qwen3-30B-A3B
plan on v6e-8 (128 experts), where this kernel holds one tile per operand.

Shapes: M is padded to the row tile (128; the padding rows belong to no group and are cut
off); K and N use 128-wide tiles, or one tile of the whole axis when it is not a multiple of
128 (an expert's slice of width 768 / 8 = 96 under tensor parallelism 8). Off TPU the
kernel runs in Pallas interpret mode (tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

ROW_TILE = 128


def _tile(size: int) -> int:
    """A K or N tile: 128, or the whole axis when 128 does not divide it."""
    return 128 if size % 128 == 0 else size


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                   interpret: bool | None = None) -> jax.Array:
    """`lhs` `[M, K]` rows grouped by `group_sizes` `[G]` times `rhs` `[G, K, N]` → `[M, N]`
    in lhs's dtype (accumulated in float32). `interpret`: None runs the compiled kernel
    when lowered for TPU and interprets it elsewhere."""
    m, k = lhs.shape
    n = rhs.shape[-1]
    padded = jnp.pad(lhs, ((0, (-m) % ROW_TILE), (0, 0)))  # [M', K]
    tiling = (ROW_TILE, _tile(k), _tile(n))

    def run(interpret_here: bool):
        def call(lhs, rhs, group_sizes):
            out = gmm(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32,
                      tiling=tiling, interpret=interpret_here)
            return out.astype(lhs.dtype)
        return call

    if interpret is None:
        out = jax.lax.platform_dependent(padded, rhs, group_sizes, tpu=run(False),
                                         default=run(True))
    else:
        out = run(interpret)(padded, rhs, group_sizes)
    return out[:m]  # [M, N]
