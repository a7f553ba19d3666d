"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, GLM-4.5): a router picks `top_k` of
`num_experts` SwiGLU experts per token, and each token's output is their weighted sum (plus,
in GLM-4.5, a shared SwiGLU every token runs).

Routing (`MoEConfig.scoring`): "softmax" takes the softmax's top k; "sigmoid" (GLM-4.5 and
DeepSeek-V3's MoE) chooses on sigmoid scores plus a per-expert correction bias, among the
best groups of experts only, and weighs by the chosen sigmoid scores (`route_sigmoid`).

Dropless and grouped: the (token, expert) pairs are sorted by expert, so each expert's rows
are contiguous, and the experts' SwiGLU runs as grouped matmuls over all experts at once
(`[R, in]` rows against `[X, in, out]` weights, `group_sizes[X]` rows per expert). No
capacity factor: no token is ever dropped, however unevenly the router spreads them, and
every shape depends only on the token bucket, so nothing compiles after warm-up.

The dispatch, grouped SwiGLU and weighted sum are an `ExpertMixture` the attention backend
may supply (it knows the platform and the mesh, as for attention): `default_mixture` by
default (gathered experts for small buckets, blocks of rows for larger ones); the Pallas
backend's on TPU is megablox `gmm` per device (`pallas_kernels.grouped_matmul`); with
expert parallelism, each device's own experts (`jaxserve.attention.backend.
experts_per_device`).

Parameters carry logical axes like the dense MLP's ("embed", "mlp"), plus "experts" for the
expert axis: with the default rules experts are tensor-parallel (each device holds a slice
of every expert's "mlp" width) and the router is replicated. With `MoEConfig.
expert_parallel` the expert weights say "expert_shards" and "expert_mlp" instead: whole
experts, split among the devices.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.config import ModelConfig, MoEConfig


def route(router_logits: jax.Array, top_k: int, normalize: bool
          ) -> tuple[jax.Array, jax.Array]:
    """(weights `[T, K]` float32, experts `[T, K]` int32) of each token's `top_k` experts:
    the softmax of the router's logits `[T, X]` (in float32), its `top_k` largest (ties to
    the lower expert id, as `torch.topk` breaks them), renormalized to sum to 1 when
    `normalize`."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [T, X]
    weights, experts = jax.lax.top_k(probs, top_k)  # [T, K] each
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def route_sigmoid(router_logits: jax.Array, correction_bias: jax.Array, moe: MoEConfig
                  ) -> tuple[jax.Array, jax.Array]:
    """(weights `[T, K]` float32, experts `[T, K]` int32) as GLM-4.5's router computes them:
    sigmoid scores `[T, X]`; the choice ranks scores + `correction_bias [X]`, within the
    `top_k_groups` groups (of `num_groups`, contiguous experts) whose two best choices sum
    highest; the weights are the chosen experts' scores, normalized when `normalize_top_k`
    (plus 1e-20), times `routed_scaling_factor`."""
    tokens, num_experts = router_logits.shape
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))  # [T, X]
    choice = scores + correction_bias.astype(jnp.float32)  # [T, X]
    per_group = num_experts // moe.num_groups
    grouped = choice.reshape(tokens, moe.num_groups, per_group)  # [T, G, X/G]
    group_scores = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)  # [T, G]
    _, best = jax.lax.top_k(group_scores, moe.top_k_groups)  # [T, Gk]
    kept = jnp.zeros((tokens, moe.num_groups), bool).at[
        jnp.arange(tokens)[:, None], best].set(True)  # [T, G]
    choice = jnp.where(jnp.repeat(kept, per_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, moe.top_k)  # [T, K]
    weights = jnp.take_along_axis(scores, experts, axis=1)  # [T, K]
    if moe.normalize_top_k:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts.astype(jnp.int32)


# mixture(x [T, E], weights [T, K], experts [T, K], gate [X, E, I], up [X, E, I],
#         down [X, I, E], expert_parallel) -> [T, E]: each token's experts' SwiGLU outputs,
#         summed with their weights (the backend's: it knows the platform and the mesh)
ExpertMixture = Callable[..., jax.Array]


def grouped_swiglu(matmul, rows, group_sizes, gate, up, down) -> jax.Array:
    """The experts' SwiGLU with a grouped matmul `matmul(lhs [M, K], rhs [G, K, N],
    group_sizes [G]) -> [M, N]` (`jax.lax.ragged_dot`'s signature)."""
    h = (jax.nn.silu(matmul(rows, gate, group_sizes))
         * matmul(rows, up, group_sizes))  # [R, I]
    return matmul(h, down, group_sizes)  # [R, E]


def grouped_by_expert(experts: jax.Array, num_experts: int
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sort the `T * K` (token, expert) pairs of `experts` `[T, K]` by expert: (order `[T*K]`,
    the pair index at each sorted row; group_sizes `[X]` int32, rows per expert; token
    `[T*K]`, each sorted row's token). Expert ids outside `[0, num_experts)` sort after
    every group and count in none."""
    flat = experts.reshape(-1)  # [T*K]
    key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # [T*K]
    order = jnp.argsort(key, stable=True)  # [T*K]
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts]  # [X]
    return order, group_sizes.astype(jnp.int32), order // experts.shape[-1]


def mix_experts(matmul, x, weights, experts, gate, up, down, first_expert=0) -> jax.Array:
    """x `[T, E]` through the experts held here, `gate`/`up` `[X', E, I]`, `down`
    `[X', I, E]`: experts `first_expert .. first_expert + X'` (all of them, or one device's
    share under expert parallelism). Each (token, expert) pair of `experts` `[T, K]` held
    here adds its SwiGLU output times its weight (`weights` `[T, K]`); pairs routed to
    experts held elsewhere add nothing. `matmul` is the grouped matmul (`grouped_swiglu`).
    → `[T, E]`."""
    order, group_sizes, token = grouped_by_expert(experts - first_expert, gate.shape[0])
    rows = jnp.take(x, token, axis=0)  # [T*K, E], grouped by expert
    out = grouped_swiglu(matmul, rows, group_sizes, gate, up, down)  # [T*K, E]
    held = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)  # [T*K] rows of some group
    out = jnp.where(held[:, None], out, 0)
    per_pair = jnp.zeros_like(out).at[order].set(out)  # [T*K, E], pair order
    per_pair = per_pair.reshape(*experts.shape, -1)  # [T, K, E]
    return jnp.sum(per_pair * weights[..., None].astype(x.dtype), axis=1)  # [T, E]


def expert_counts(experts: jax.Array, num_experts: int, real: jax.Array | None = None
                  ) -> jax.Array:
    """How many of the tokens' (token, expert) pairs `experts` `[T, K]` each expert got:
    `[X]` int32, counting only the tokens where `real` `[T]` holds (None: all of them)."""
    if real is not None:
        experts = jnp.where(real[:, None], experts, -1)
    return grouped_by_expert(experts, num_experts)[1]  # (the unused sort compiles away)


def gathered_mixture(x, weights, experts, gate, up, down) -> jax.Array:
    """The mixture with each (token, expert) pair's weights gathered: `T * K` experts'
    weights read, no sort. `[T, E]`, as `mix_experts` computes it."""
    tokens, k = experts.shape
    chosen = experts.reshape(-1)  # [R] pair order, R = T * K
    rows = jnp.repeat(x, k, axis=0)  # [R, E]
    h = (jax.nn.silu(jnp.einsum("re,rei->ri", rows, gate[chosen]))
         * jnp.einsum("re,rei->ri", rows, up[chosen]))  # [R, I]
    out = jnp.einsum("ri,rie->re", h, down[chosen]).reshape(tokens, k, -1)  # [T, K, E]
    return jnp.sum(out * weights[..., None].astype(x.dtype), axis=1)


def blocked_mixture(x, weights, experts, gate, up, down) -> jax.Array:
    """The mixture as batched matmuls over blocks of rows: the (token, expert) pairs sorted by
    expert, each expert's rows padded to whole blocks of B, and each block multiplied by its
    expert's weights (gathered once a block). With B about R / X (R = T * K pairs, X
    experts), at most 2X blocks: the arithmetic of about 2R rows and the weights of at most
    2X experts, where a dense product runs every row through every expert. `[T, E]`, as
    `mix_experts` computes it."""
    num_experts, hidden = gate.shape[0], x.shape[-1]
    pairs = experts.size
    block = -(-(-(-pairs // num_experts)) // 8) * 8  # rows a block, a multiple of 8
    num_blocks = -(-pairs // block) + num_experts  # enough however the pairs fall
    order, group_sizes, token = grouped_by_expert(experts, num_experts)
    blocks_of = -(-group_sizes // block)  # [X] blocks each expert's rows fill
    ends = jnp.cumsum(blocks_of)  # [X]
    expert = experts.reshape(-1)[order]  # [R] each sorted row's expert
    rank = jnp.arange(pairs) - (jnp.cumsum(group_sizes) - group_sizes)[expert]  # [R]
    slot = (ends - blocks_of)[expert] * block + rank  # [R] its place among the blocks
    rows = jnp.zeros((num_blocks * block, hidden), x.dtype).at[slot].set(
        jnp.take(x, token, axis=0)).reshape(num_blocks, block, hidden)  # [N, B, E]
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(num_blocks), side="right"),
                        num_experts - 1)  # [N] each block's expert (unused blocks: any)
    h = (jax.nn.silu(jnp.einsum("nbe,nei->nbi", rows, gate[owner]))
         * jnp.einsum("nbe,nei->nbi", rows, up[owner]))  # [N, B, I]
    out = jnp.einsum("nbi,nie->nbe", h, down[owner]).reshape(-1, hidden)  # [N * B, E]
    per_pair = jnp.zeros((pairs, hidden), out.dtype).at[order].set(out[slot])  # pair order
    per_pair = per_pair.reshape(*experts.shape, hidden)  # [T, K, E]
    return jnp.sum(per_pair * weights[..., None].astype(x.dtype), axis=1)


def default_mixture(x, weights, experts, gate, up, down, expert_parallel=False
                    ) -> jax.Array:
    """The default `ExpertMixture` (any platform, any sharding of the "mlp" width: XLA
    partitions it). XLA:CPU and XLA:GPU lower `jax.lax.ragged_dot` as a dense product that
    runs every row through every expert, so this does without it: a bucket with no more
    (token, expert) pairs than experts (a decode step of a few rows) gathers its pairs'
    experts (`gathered_mixture`: the weights of K experts a token); larger ones run blocks
    of rows against their experts (`blocked_mixture`)."""
    if experts.size <= gate.shape[0]:
        return gathered_mixture(x, weights, experts, gate, up, down)
    return blocked_mixture(x, weights, experts, gate, up, down)


class SparseMoE(nnx.Module):
    """Router `[E, X]` and experts' gate/up `[X, E, I]`, down `[X, I, E]`; with sigmoid
    scoring a correction bias `[X]` (float32); with shared experts, `shared` (a dense
    SwiGLU, `shared_mlp` builds it)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, shared_mlp=None):
        moe, e = cfg.moe, cfg.hidden_size
        x, i = moe.num_experts, moe.intermediate_size

        def param(shape, axes, dtype=dtype):
            value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
            return nnx.Param(value.astype(dtype), logical_axes=axes)

        # expert parallelism holds whole experts per device; otherwise a slice of each
        held, width = ("expert_shards", "expert_mlp") if moe.expert_parallel else (
            "experts", "mlp")
        self.router = param((e, x), ("embed", "experts"))
        self.gate_proj = param((x, e, i), (held, "embed", width))
        self.up_proj = param((x, e, i), (held, "embed", width))
        self.down_proj = param((x, i, e), (held, width, "embed"))
        self.top_k, self.normalize = moe.top_k, moe.normalize_top_k
        self.moe = moe
        self.correction_bias = (param((x,), ("experts",), jnp.float32)
                                if moe.scoring == "sigmoid" else None)
        self.shared = (shared_mlp(moe.intermediate_size * moe.shared_experts)
                       if moe.shared_experts else None)

    def __call__(self, hidden: jax.Array, mixture: ExpertMixture | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        """hidden `[..., E]` → (`[..., E]`, each token's chosen experts `[T, K]` int32, T the
        tokens of hidden flattened); `mixture`: the backend's, else `default_mixture`."""
        x = hidden.reshape(-1, hidden.shape[-1])  # [T, E]
        if self.correction_bias is None:
            weights, experts = route(x @ self.router[...], self.top_k, self.normalize)
        else:  # GLM computes its router in float32
            logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # [T, X]
            weights, experts = route_sigmoid(logits, self.correction_bias[...], self.moe)
        mixed = (mixture or default_mixture)(
            x, weights, experts, self.gate_proj[...], self.up_proj[...], self.down_proj[...],
            expert_parallel=self.moe.expert_parallel)  # [T, E]
        if self.shared is not None:
            mixed = mixed + self.shared(x)
        return mixed.reshape(hidden.shape), experts
