"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss): a router picks
`top_k` of `num_experts` SwiGLU experts per token, and each token's output is their weighted
sum (plus, in GLM-4.5, a shared SwiGLU every token runs; gpt-oss biases its router and
experts and clamps its SwiGLU, `ExpertKernels.glu`).

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

Quantized models (`ModelConfig.quantization`) store the experts' kernels as int8/fp8 codes
with one float32 scale per expert and output channel (`ExpertKernels`); every mixture widens
the codes it multiplies to the compute dtype and scales each row's result by its expert's
scales. The router stays in the compute dtype, and the experts' activations are not
quantized (`quantize_activations` applies to attention and dense MLPs).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.config import ModelConfig, MoEConfig
from jaxserve.model.quantization import weight_param


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


# mixture(x [T, E], weights [T, K], experts [T, K], kernels: ExpertKernels,
#         expert_parallel) -> [T, E]: each token's experts' SwiGLU outputs, summed with
#         their weights (the backend's: it knows the platform and the mesh)
ExpertMixture = Callable[..., jax.Array]


def scaled(out: jax.Array, scale: jax.Array | None, owner: jax.Array,
           bias: jax.Array | None = None) -> jax.Array:
    """`out` `[N, ..., O]`, computed with the codes of experts `owner` `[N]`, times those
    experts' scales `scale` `[X, O]` (None: `out` as it is), plus their biases `bias`
    `[X, O]` (None: none), in out's dtype."""

    def per_row(table):
        return table[owner].reshape(owner.shape + (1,) * (out.ndim - 2) + table.shape[-1:])

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


def mix_experts(matmul, x, weights, experts, kernels: ExpertKernels, first_expert=0
                ) -> jax.Array:
    """x `[T, E]` through the experts held here (`kernels` of X' experts): experts
    `first_expert .. first_expert + X'` (all of them, or one device's share under expert
    parallelism). Each (token, expert) pair of `experts` `[T, K]` held here adds its SwiGLU
    output times its weight (`weights` `[T, K]`); pairs routed to experts held elsewhere add
    nothing. `matmul` is the grouped matmul (`grouped_mlp`). → `[T, E]`."""
    local = experts - first_expert  # [T, K]
    order, group_sizes, token = grouped_by_expert(local, kernels.num_experts)
    rows = jnp.take(x, token, axis=0)  # [T*K, E], grouped by expert
    row_expert = jnp.clip(local.reshape(-1)[order], 0, kernels.num_experts - 1)  # [T*K]
    out = grouped_mlp(matmul, rows, group_sizes, kernels, row_expert)  # [T*K, E]
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


def _owned_mlp(spec_in: str, spec_out: str, rows, kernels: ExpertKernels, owner
                  ) -> jax.Array:
    """The gated MLP of `rows` `[N, ..., E]`, each leading slice through the experts `owner`
    `[N]`: `spec_in` / `spec_out` the einsums of gate/up and of down over gathered kernels
    `[N, E, I]` / `[N, I, E]`."""

    def product(spec, lhs, kernel, scale, bias=None):
        return scaled(jnp.einsum(spec, lhs, kernel[owner].astype(lhs.dtype)), scale, owner,
                      bias)

    h = kernels.glu(product(spec_in, rows, kernels.gate, kernels.gate_scale, kernels.gate_bias),
                    product(spec_in, rows, kernels.up, kernels.up_scale, kernels.up_bias))
    return product(spec_out, h, kernels.down, kernels.down_scale)  # [N, ..., E]


def gathered_mixture(x, weights, experts, kernels: ExpertKernels) -> jax.Array:
    """The mixture with each (token, expert) pair's weights gathered: `T * K` experts'
    weights read, no sort. `[T, E]`, as `mix_experts` computes it."""
    tokens, k = experts.shape
    chosen = experts.reshape(-1)  # [R] pair order, R = T * K
    rows = jnp.repeat(x, k, axis=0)  # [R, E]
    out = _owned_mlp("re,rei->ri", "ri,rie->re", rows, kernels, chosen)  # [R, E]
    out = out.reshape(tokens, k, -1)  # [T, K, E]
    return jnp.sum(out * weights[..., None].astype(x.dtype), axis=1)


def blocked_mixture(x, weights, experts, kernels: ExpertKernels) -> jax.Array:
    """The mixture as batched matmuls over blocks of rows: the (token, expert) pairs sorted by
    expert, each expert's rows padded to whole blocks of B, and each block multiplied by its
    expert's weights (gathered once a block). With B about R / X (R = T * K pairs, X
    experts), at most 2X blocks: the arithmetic of about 2R rows and the weights of at most
    2X experts, where a dense product runs every row through every expert. `[T, E]`, as
    `mix_experts` computes it."""
    num_experts, hidden = kernels.num_experts, x.shape[-1]
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
    out = _owned_mlp("nbe,nei->nbi", "nbi,nie->nbe", rows, kernels, owner)  # [N, B, E]
    out = out.reshape(-1, hidden)  # [N * B, E]
    per_pair = jnp.zeros((pairs, hidden), out.dtype).at[order].set(out[slot])  # pair order
    per_pair = per_pair.reshape(*experts.shape, hidden)  # [T, K, E]
    return jnp.sum(per_pair * weights[..., None].astype(x.dtype), axis=1)


def default_mixture(x, weights, experts, kernels: ExpertKernels, expert_parallel=False
                    ) -> jax.Array:
    """The default `ExpertMixture` (any platform, any sharding of the "mlp" width: XLA
    partitions it). XLA:CPU and XLA:GPU lower `jax.lax.ragged_dot` as a dense product that
    runs every row through every expert, so this does without it: a bucket with no more
    (token, expert) pairs than experts (a decode step of a few rows) gathers its pairs'
    experts (`gathered_mixture`: the weights of K experts a token); larger ones run blocks
    of rows against their experts (`blocked_mixture`)."""
    if experts.size <= kernels.num_experts:
        return gathered_mixture(x, weights, experts, kernels)
    return blocked_mixture(x, weights, experts, kernels)


class SparseMoE(nnx.Module):
    """Router `[E, X]` and experts' gate/up `[X, E, I]`, down `[X, I, E]` (quantized: with
    `<name>_scale` `[X, I]` / `[X, E]`); with sigmoid scoring a correction bias `[X]`
    (float32); with shared experts, `shared` (a dense SwiGLU, `shared_mlp` builds it); with
    `MoEConfig.biases` (gpt-oss), `router_bias` `[X]`, `gate_bias`, `up_bias` `[X, I]` and
    `down_bias` `[X, E]`."""

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
        self.gate_proj, self.gate_proj_scale = weight_param(
            cfg, "gate_proj", rngs, (x, e, i), dtype, (held, "embed", width))
        self.up_proj, self.up_proj_scale = weight_param(
            cfg, "up_proj", rngs, (x, e, i), dtype, (held, "embed", width))
        self.down_proj, self.down_proj_scale = weight_param(
            cfg, "down_proj", rngs, (x, i, e), dtype, (held, width, "embed"))
        self.top_k, self.normalize = moe.top_k, moe.normalize_top_k
        self.moe = moe
        self.correction_bias = (param((x,), ("experts",), jnp.float32)
                                if moe.scoring == "sigmoid" else None)
        self.shared = (shared_mlp(moe.intermediate_size * moe.shared_experts)
                       if moe.shared_experts else None)

        def bias(shape, axes):
            return (nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes) if moe.biases
                    else None)

        self.router_bias = bias((x,), ("experts",))
        self.gate_bias = bias((x, i), (held, width))
        self.up_bias = bias((x, i), (held, width))
        self.down_bias = bias((x, e), (held, "embed"))

    def __call__(self, hidden: jax.Array, mixture: ExpertMixture | None = None
                 ) -> tuple[jax.Array, jax.Array]:
        """hidden `[..., E]` → (`[..., E]`, each token's chosen experts `[T, K]` int32, T the
        tokens of hidden flattened); `mixture`: the backend's, else `default_mixture`."""
        x = hidden.reshape(-1, hidden.shape[-1])  # [T, E]
        if self.correction_bias is None:
            logits = x @ self.router[...]  # [T, X]
            if self.router_bias is not None:
                logits = logits + self.router_bias[...]
            weights, experts = route(logits, self.top_k, self.normalize)
        else:  # GLM computes its router in float32
            logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # [T, X]
            weights, experts = route_sigmoid(logits, self.correction_bias[...], self.moe)
        mixed = (mixture or default_mixture)(
            x, weights, experts, self.kernels(), expert_parallel=self.moe.expert_parallel)
        # [T, E]
        if self.down_bias is not None:  # each chosen expert's, by its weight, once a token
            chosen = self.down_bias[...][experts]  # [T, K, E]
            mixed = mixed + jnp.sum(chosen * weights[..., None].astype(x.dtype), axis=1)
        if self.shared is not None:
            mixed = mixed + self.shared(x)
        return mixed.reshape(hidden.shape), experts

    def kernels(self) -> ExpertKernels:
        """The experts' kernels (and scales, when quantized; biases, in gpt-oss) as arrays,
        with the activation."""
        value = lambda param: None if param is None else param[...]  # noqa: E731
        return ExpertKernels(*(value(getattr(self, name)) for name in (
            "gate_proj", "up_proj", "down_proj", "gate_proj_scale", "up_proj_scale",
            "down_proj_scale", "gate_bias", "up_bias")), activation=self.moe.activation,
            swiglu_alpha=self.moe.swiglu_alpha, swiglu_limit=self.moe.swiglu_limit)
