"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss): a router picks
`top_k` of `num_experts` SwiGLU experts per token, and each token's output is their weighted
sum (plus, in GLM-4.5, a shared SwiGLU every token runs; gpt-oss biases its router and
experts and clamps its SwiGLU, `ExpertKernels.glu`).

Routing (`MoEConfig.scoring`): "softmax" takes the softmax's top k; "sigmoid" (GLM-4.5 and
DeepSeek-V3's MoE) chooses on sigmoid scores plus a per-expert correction bias, among the
best groups of experts only, and weighs by the chosen sigmoid scores (`route_sigmoid`).

Dropless: no token is ever dropped, however unevenly the router spreads them, and every
shape depends only on the token bucket, so nothing compiles after warm-up. How the pairs
run through the experts is the `ExpertMixture` of the step (`StepContext.experts`, built for
the mesh and platform by `jaxserve.model.expert_placement`) from `jaxserve.model.expert_mixtures`:
`default_mixture` on CPU and GPU (gathered experts, slots of rows per expert or blocks,
by the bucket and the routing); megablox `gmm` per device on TPU; with expert
parallelism, each device's own experts (`expert_placement.experts_per_device`).

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

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve import fixed_order
from jaxserve.model.config import ModelConfig, MoEConfig
from jaxserve.model.contract import ExpertMixture
from jaxserve.model.expert_mixtures import ExpertKernels, default_mixture, sort_pairs
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


def expert_counts(experts: jax.Array, num_experts: int, real: jax.Array | None = None
                  ) -> jax.Array:
    """How many of the tokens' (token, expert) pairs `experts` `[T, K]` each expert got:
    `[X]` int32, counting only the tokens where `real` `[T]` holds (None: all of them)."""
    if real is not None:
        experts = jnp.where(real[:, None], experts, -1)
    return sort_pairs(experts, num_experts).group_sizes  # (the unused sort compiles away)


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
        tokens of hidden flattened); `mixture`: the step's, else `default_mixture`. Under
        deterministic inference (`fixed_order`), a fixed number of tokens at a time."""
        x = hidden.reshape(-1, hidden.shape[-1])  # [T, E]
        mixed, experts = fixed_order.rowwise(lambda rows: self._mixed(rows, mixture), x)
        return mixed.reshape(hidden.shape), experts

    def _mixed(self, x: jax.Array, mixture: ExpertMixture | None
               ) -> tuple[jax.Array, jax.Array]:
        """x `[T, E]` → (`[T, E]`, experts `[T, K]`)."""
        if self.correction_bias is None:
            logits = x @ self.router[...]  # [T, X]
            if self.router_bias is not None:
                logits = logits + self.router_bias[...]
            weights, experts = route(logits, self.top_k, self.normalize)
        else:  # GLM computes its router in float32
            logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # [T, X]
            weights, experts = route_sigmoid(logits, self.correction_bias[...], self.moe)
        if mixture is None:  # all experts here
            mixed = default_mixture(x, weights, experts, self.kernels())  # [T, E]
        else:
            mixed = mixture(x, weights, experts, self.kernels(),
                            expert_parallel=self.moe.expert_parallel)  # [T, E]
        if self.down_bias is not None:  # each chosen expert's, by its weight, once a token
            chosen = self.down_bias[...][experts]  # [T, K, E]
            mixed = mixed + jnp.sum(chosen * weights[..., None].astype(x.dtype), axis=1)
        if self.shared is not None:
            mixed = mixed + self.shared(x)
        return mixed, experts

    def kernels(self) -> ExpertKernels:
        """The experts' kernels (and scales, when quantized; biases, in gpt-oss) as arrays,
        with the activation."""
        value = lambda param: None if param is None else param[...]  # noqa: E731
        return ExpertKernels(*(value(getattr(self, name)) for name in (
            "gate_proj", "up_proj", "down_proj", "gate_proj_scale", "up_proj_scale",
            "down_proj_scale", "gate_bias", "up_bias")), activation=self.moe.activation,
            swiglu_alpha=self.moe.swiglu_alpha, swiglu_limit=self.moe.swiglu_limit)
