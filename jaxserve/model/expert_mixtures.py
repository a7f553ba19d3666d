"""How a mixture-of-experts layer's (token, expert) pairs run through its experts. Each
mixture here takes tokens `x [T, E]`, their router's `weights [T, K]` and
`experts [T, K]`, and the experts' kernels, and returns each token's experts' gated-MLP
outputs summed with their weights, `[T, E]`. None drops a token, whatever the routing,
and every shape depends only on the token bucket (nothing compiles after warm-up).

The pairs are sorted by expert (`sort_pairs`), so each expert's rows are contiguous, and
then one of:
- `mix_experts`: a grouped matmul over the sorted rows (`jax.lax.ragged_dot`'s signature;
  megablox `gmm` on TPU, `pallas_kernels.grouped_matmul`);
- `capacity_mixture`: each expert's rows in a slot of `capacity` rows, and one batched
  matmul per projection against the stacked kernels, read in place;
- `blocked_mixture`: each expert's rows padded to blocks, each block against its expert's
  weights gathered;
- `gathered_mixture` (no sort): every pair against its own expert's weights gathered.

XLA:CPU and XLA:GPU lower `ragged_dot` as a dense product (every row through every
expert) and gather weights element by element, so `default_mixture` picks among the last
three by the bucket's size and the routing it meets (docs/performance.md has the figures).

A mixture runs either on all experts or, under expert parallelism, on one device's share:
`first_expert` is the first expert held here (pairs routed to others add nothing) and
`expert_shards` how many devices share the experts."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve import fixed_order


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertKernels:
    """The experts' gated MLP as stored: kernels `gate`, `up` `[X, E, I]` and `down`
    `[X, I, E]` in the compute dtype, or quantized: int8/fp8 codes with float32 scales
    `gate_scale`, `up_scale` `[X, I]` and `down_scale` `[X, E]`, one per expert and output
    channel (None when not quantized); gpt-oss's `gate_bias`, `up_bias` `[X, I]` (None:
    none; the down projection's bias is added outside the mixtures, once per token); and
    the activation (`MoEConfig.activation`, static). A pytree, so it passes through
    `shard_map` and `platform_dependent` whole."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_scale: jax.Array | None = None
    up_scale: jax.Array | None = None
    down_scale: jax.Array | None = None
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None
    activation: str = dataclasses.field(default="silu", metadata=dict(static=True))
    swiglu_alpha: float = dataclasses.field(default=1.702, metadata=dict(static=True))
    swiglu_limit: float = dataclasses.field(default=7.0, metadata=dict(static=True))

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    def glu(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """The gated activation of the gate and up projections' outputs `[..., I]`."""
        if self.activation == "silu":
            return jax.nn.silu(gate) * up
        limit = self.swiglu_limit
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * self.swiglu_alpha)


# local_mixture(x [T, E], weights [T, K], experts [T, K], kernels: ExpertKernels,
#               first_expert=0, expert_shards=1) -> [T, E]: one device's experts (or all)
LocalMixture = Callable[..., jax.Array]


def scaled(out: jax.Array, scale: jax.Array | None, owner: jax.Array | None,
           bias: jax.Array | None = None) -> jax.Array:
    """`out` `[N, ..., O]`, computed with the codes of experts `owner` `[N]` (None: `out`'s
    leading axis is every expert in order), times those experts' scales `scale` `[X, O]`
    (None: `out` as it is), plus their biases `bias` `[X, O]` (None: none), in out's
    dtype."""

    def per_row(table):
        rows = table if owner is None else table[owner]  # [N, O]
        return rows.reshape(rows.shape[:1] + (1,) * (out.ndim - 2) + table.shape[-1:])

    if scale is not None:
        out = (out.astype(jnp.float32) * per_row(scale)).astype(out.dtype)
    return out if bias is None else out + per_row(bias).astype(out.dtype)


def grouped_mlp(matmul, rows, group_sizes, kernels: ExpertKernels, row_expert
                ) -> jax.Array:
    """The experts' gated MLP with a grouped matmul `matmul(lhs [M, K], rhs [G, K, N],
    group_sizes [G]) -> [M, N]` (`jax.lax.ragged_dot`'s signature) over `rows` `[R, E]`,
    grouped by expert; `row_expert` `[R]` is each row's expert (for scales and biases)."""

    def product(lhs, kernel, scale, bias=None):
        return scaled(matmul(lhs, kernel.astype(lhs.dtype), group_sizes), scale, row_expert,
                      bias)

    h = kernels.glu(product(rows, kernels.gate, kernels.gate_scale, kernels.gate_bias),
                    product(rows, kernels.up, kernels.up_scale, kernels.up_bias))  # [R, I]
    return product(h, kernels.down, kernels.down_scale)  # [R, E]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SortedPairs:
    """The `R = T * K` (token, expert) pairs sorted by expert, for the X' experts held here:
    `order` `[R]` the pair index at each sorted row; `group_sizes` `[X']` int32 rows per
    expert; `token` `[R]` each sorted row's token; `expert` `[R]` its expert (X' for pairs
    held elsewhere, which sort after every group); `rank` `[R]` its place among its expert's
    rows."""

    order: jax.Array
    group_sizes: jax.Array
    token: jax.Array
    expert: jax.Array
    rank: jax.Array

    @property
    def held(self) -> jax.Array:
        """`[R]` whether each sorted row's expert is held here."""
        return self.expert < self.group_sizes.shape[0]


def sort_pairs(experts: jax.Array, num_experts: int, first_expert=0) -> SortedPairs:
    """The pairs of `experts` `[T, K]` sorted by expert, for experts `first_expert ..
    first_expert + num_experts` (ids outside them count in no group)."""
    flat = experts.reshape(-1) - first_expert  # [R]
    key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # [R]
    order = jnp.argsort(key, stable=True)  # [R]
    counts = jnp.bincount(key, length=num_experts + 1).astype(jnp.int32)  # [X' + 1]
    expert = key[order]  # [R]
    rank = jnp.arange(flat.shape[0]) - (jnp.cumsum(counts) - counts)[expert]  # [R]
    return SortedPairs(order, counts[:num_experts], order // experts.shape[-1], expert, rank)


def _combine(per_sorted_row: jax.Array, pairs: SortedPairs, weights: jax.Array) -> jax.Array:
    """Each token's pairs' outputs (`per_sorted_row` `[R, E]`, in sorted order, zero where
    not held) summed with their weights `[T, K]` → `[T, E]`."""
    per_pair = jnp.zeros_like(per_sorted_row).at[pairs.order].set(per_sorted_row)  # [R, E]
    per_pair = per_pair.reshape(*weights.shape, -1)  # [T, K, E]
    return jnp.sum(per_pair * weights[..., None].astype(per_pair.dtype), axis=1)


def _through_slots(x, weights, pairs: SortedPairs, slot, num_slots: int, mlp) -> jax.Array:
    """Each sorted row's token placed at its `slot` `[R]` of `num_slots` rows (slots no pair
    fills stay zero; a slot past them, as rows not held get, goes nowhere and reads back
    zero), `mlp(rows [num_slots, E])` run, and each pair's output read back from its slot
    and combined → `[T, E]`."""
    rows = jnp.zeros((num_slots, x.shape[-1]), x.dtype).at[slot].set(
        jnp.take(x, pairs.token, axis=0), mode="drop")  # [S, E]
    out = mlp(rows)  # [S, E]
    return _combine(out.at[slot].get(mode="fill", fill_value=0), pairs, weights)


def _owned_mlp(spec_in: str, spec_out: str, rows, kernels: ExpertKernels, owner
               ) -> jax.Array:
    """The gated MLP of `rows` `[N, ..., E]`, each leading slice through the experts `owner`
    `[N]` (their weights gathered; None: the leading axis is every expert in order, and the
    kernels are read in place): `spec_in` / `spec_out` the einsums of gate/up and of down
    over kernels `[N, E, I]` / `[N, I, E]`."""

    def product(spec, lhs, kernel, scale, bias=None):
        weight = kernel if owner is None else kernel[owner]
        return scaled(jnp.einsum(spec, lhs, weight.astype(lhs.dtype)), scale, owner, bias)

    h = kernels.glu(product(spec_in, rows, kernels.gate, kernels.gate_scale, kernels.gate_bias),
                    product(spec_in, rows, kernels.up, kernels.up_scale, kernels.up_bias))
    return product(spec_out, h, kernels.down, kernels.down_scale)  # [N, ..., E]


def mix_experts(matmul, x, weights, experts, kernels: ExpertKernels, first_expert=0,
                expert_shards=1) -> jax.Array:
    """The mixture through a grouped matmul `matmul` (`grouped_mlp`) over the sorted rows;
    a grouped matmul sizes nothing by the rows an expert is expected to get, so
    `expert_shards` is not needed. → `[T, E]`."""
    del expert_shards
    pairs = sort_pairs(experts, kernels.num_experts, first_expert)
    rows = jnp.take(x, pairs.token, axis=0)  # [R, E], grouped by expert
    row_expert = jnp.clip(pairs.expert, 0, kernels.num_experts - 1)  # [R]
    out = grouped_mlp(matmul, rows, pairs.group_sizes, kernels, row_expert)  # [R, E]
    return _combine(jnp.where(pairs.held[:, None], out, 0), pairs, weights)


def gathered_mixture(x, weights, experts, kernels: ExpertKernels, first_expert=0
                     ) -> jax.Array:
    """The mixture with each (token, expert) pair's weights gathered: `T * K` experts'
    weights read, no sort. `[T, E]`."""
    tokens, k = experts.shape
    local = experts.reshape(-1) - first_expert  # [R] pair order, R = T * K
    held = (local >= 0) & (local < kernels.num_experts)  # [R]
    rows = jnp.repeat(x, k, axis=0)  # [R, E]
    out = _owned_mlp("re,rei->ri", "ri,rie->re", rows, kernels,
                     jnp.clip(local, 0, kernels.num_experts - 1))  # [R, E]
    out = jnp.where(held[:, None], out, 0).reshape(tokens, k, -1)  # [T, K, E]
    return jnp.sum(out * weights[..., None].astype(x.dtype), axis=1)


def capacity_mixture(x, weights, pairs: SortedPairs, kernels: ExpertKernels, capacity: int
                     ) -> jax.Array:
    """The mixture as one batched matmul per projection: expert j's rows in slots
    `j * capacity ..`, `[X', capacity, E]` against the kernels `[X', E, I]` as stored (no
    weight is copied). Exact only when no expert has more than `capacity` rows (the caller
    checks `pairs.group_sizes`). `[T, E]`."""
    num_experts, hidden = kernels.num_experts, x.shape[-1]

    def mlp(rows):  # [X' * C, E]
        rows = rows.reshape(num_experts, capacity, hidden)  # [X', C, E]
        out = _owned_mlp("xce,xei->xci", "xci,xie->xce", rows, kernels, None)
        return out.reshape(-1, hidden)

    return _through_slots(x, weights, pairs, pairs.expert * capacity + pairs.rank,
                          num_experts * capacity, mlp)


def blocked_mixture(x, weights, pairs: SortedPairs, kernels: ExpertKernels) -> jax.Array:
    """The mixture as batched matmuls over blocks of rows: each expert's rows padded to whole
    blocks of B, and each block multiplied by its expert's weights (gathered once a block).
    With B about R' / X' (R' the most pairs the X' experts here can hold: a token's K
    experts are distinct), at most 2X' blocks hold any routing: the arithmetic of about 2R'
    rows and the weights of at most 2X' experts. `[T, E]`."""
    num_experts, hidden = kernels.num_experts, x.shape[-1]
    tokens, top_k = weights.shape
    most = tokens * min(top_k, num_experts)  # R'
    block = -(-(-(-most // num_experts)) // 8) * 8  # rows a block, a multiple of 8
    num_blocks = -(-most // block) + num_experts  # enough however the pairs fall
    blocks_of = -(-pairs.group_sizes // block)  # [X'] blocks each expert's rows fill
    ends = jnp.cumsum(blocks_of)  # [X']
    first_block = jnp.append(ends - blocks_of, num_blocks)  # [X' + 1]
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(num_blocks), side="right"),
                        num_experts - 1)  # [N] each block's expert (unused blocks: any)

    def mlp(rows):  # [N * B, E]
        rows = rows.reshape(num_blocks, block, hidden)  # [N, B, E]
        return _owned_mlp("nbe,nei->nbi", "nbi,nie->nbe", rows, kernels, owner).reshape(
            -1, hidden)

    return _through_slots(x, weights, pairs, first_block[pairs.expert] * block + pairs.rank,
                          num_blocks * block, mlp)


def default_mixture(x, weights, experts, kernels: ExpertKernels, first_expert=0,
                    expert_shards=1) -> jax.Array:
    """The `LocalMixture` for XLA:CPU and XLA:GPU (any sharding of the "mlp" width: XLA
    partitions it), by the bucket's T tokens and R = T * K pairs over X experts in all (X'
    of them here):
    - R * 4 <= X (a decode step of a row or two): `gathered_mixture`, the weights of K
      experts a token;
    - otherwise `capacity_mixture` with the smallest capacity that holds the busiest
      expert's rows, of: 2m and, while m < 16 (small buckets, whose groups spread widely
      around their mean), 4m, where m = ceil(R / X) is the rows an expert gets on average;
      then T (no expert gets a token twice, so T holds any routing) where X' * T rows are
      no more than 2R; else `blocked_mixture`. `lax.switch` runs only the branch taken.
    Under deterministic inference (`fixed_order`): always `gathered_mixture`, whose products
    have the same shape whatever the routing."""
    if fixed_order.row_tile() is not None:
        return gathered_mixture(x, weights, experts, kernels, first_expert)
    tokens, top_k = experts.shape
    all_experts = kernels.num_experts * expert_shards
    if experts.size * 4 <= all_experts:
        return gathered_mixture(x, weights, experts, kernels, first_expert)
    mean = -(-experts.size // all_experts)
    capacities = sorted({min(c, tokens) for c in [2 * mean] + [4 * mean] * (mean < 16)})
    if capacities[-1] < tokens and kernels.num_experts * tokens <= 2 * experts.size:
        capacities.append(tokens)
    branches = [functools.partial(capacity_mixture, capacity=c) for c in capacities]
    if capacities[-1] < tokens:
        branches.append(blocked_mixture)
    pairs = sort_pairs(experts, kernels.num_experts, first_expert)
    busiest = jnp.max(pairs.group_sizes)
    index = jnp.searchsorted(jnp.asarray(capacities), busiest)  # first capacity >= busiest
    return jax.lax.switch(index, branches, x, weights, pairs, kernels)
