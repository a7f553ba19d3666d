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

The grouped part is an `ExpertFFN` the attention backend may supply (it knows the platform
and the mesh, as for attention): `ragged_expert_ffn`, XLA's `jax.lax.ragged_dot`, by
default; the Pallas backend's on TPU is megablox `gmm` per device (`pallas_kernels.
grouped_matmul`).

Parameters carry logical axes like the dense MLP's ("embed", "mlp"), plus "experts" for the
expert axis: with the default rules experts are tensor-parallel (each device holds a slice
of every expert's "mlp" width) and the router is replicated.
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


# expert_ffn(rows [R, E], group_sizes [X], gate [X, E, I], up [X, E, I], down [X, I, E])
#   -> [R, E]: each group of rows through its expert's SwiGLU
ExpertFFN = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def grouped_swiglu(matmul, rows, group_sizes, gate, up, down) -> jax.Array:
    """The experts' SwiGLU with a grouped matmul `matmul(lhs [M, K], rhs [G, K, N],
    group_sizes [G]) -> [M, N]` (`jax.lax.ragged_dot`'s signature)."""
    h = (jax.nn.silu(matmul(rows, gate, group_sizes))
         * matmul(rows, up, group_sizes))  # [R, I]
    return matmul(h, down, group_sizes)  # [R, E]


def ragged_expert_ffn(rows, group_sizes, gate, up, down) -> jax.Array:
    """The experts' SwiGLU with `jax.lax.ragged_dot` (any platform, any sharding: XLA
    partitions it)."""
    return grouped_swiglu(jax.lax.ragged_dot, rows, group_sizes, gate, up, down)


def grouped_by_expert(experts: jax.Array, num_experts: int
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sort the `T * K` (token, expert) pairs of `experts` `[T, K]` by expert: (order `[T*K]`,
    the pair index at each sorted row; group_sizes `[X]` int32, rows per expert; token
    `[T*K]`, each sorted row's token)."""
    flat = experts.reshape(-1)  # [T*K]
    order = jnp.argsort(flat, stable=True)  # [T*K]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [X]
    return order, group_sizes, order // experts.shape[-1]


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

        self.router = param((e, x), ("embed", "experts"))
        self.gate_proj = param((x, e, i), ("experts", "embed", "mlp"))
        self.up_proj = param((x, e, i), ("experts", "embed", "mlp"))
        self.down_proj = param((x, i, e), ("experts", "mlp", "embed"))
        self.top_k, self.normalize = moe.top_k, moe.normalize_top_k
        self.moe = moe
        self.correction_bias = (param((x,), ("experts",), jnp.float32)
                                if moe.scoring == "sigmoid" else None)
        self.shared = (shared_mlp(moe.intermediate_size * moe.shared_experts)
                       if moe.shared_experts else None)

    def __call__(self, hidden: jax.Array, expert_ffn: ExpertFFN | None = None) -> jax.Array:
        """hidden `[..., E]` → `[..., E]`; `expert_ffn`: the backend's, else ragged_dot's."""
        x = hidden.reshape(-1, hidden.shape[-1])  # [T, E]
        if self.correction_bias is None:
            weights, experts = route(x @ self.router[...], self.top_k, self.normalize)
        else:  # GLM computes its router in float32
            logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # [T, X]
            weights, experts = route_sigmoid(logits, self.correction_bias[...], self.moe)
        order, group_sizes, token = grouped_by_expert(experts, self.gate_proj.shape[0])
        rows = jnp.take(x, token, axis=0)  # [T*K, E], grouped by expert
        out = (expert_ffn or ragged_expert_ffn)(
            rows, group_sizes, self.gate_proj[...], self.up_proj[...],
            self.down_proj[...])  # [T*K, E]
        per_pair = jnp.zeros_like(out).at[order].set(out)  # [T*K, E], pair order
        per_pair = per_pair.reshape(*experts.shape, -1)  # [T, K, E]
        mixed = jnp.sum(per_pair * weights[..., None].astype(x.dtype), axis=1)  # [T, E]
        if self.shared is not None:
            mixed = mixed + self.shared(x)
        return mixed.reshape(hidden.shape)
