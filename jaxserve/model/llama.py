"""Llama-family decoder in Flax NNX (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2 and 3, and
with `jaxserve.model.moe` in place of the MLP, Qwen3-MoE, Mixtral and GLM-4.5).

Gemma (`cfg.gemma`) changes the norms ((1 + w), in float32), adds a norm on the attention's
and the MLP's outputs, scales the embeddings and the queries, and may cap the final logits;
the attention scores' cap and each layer's window belong to the attention backend, which
reads them from the config. Layers whose rope differs (Gemma 3's sliding layers) each get
their own rope.

The model knows nothing of KV-cache layout or devices. A forward takes a `StepContext`
(`jaxserve.model.contract`) and returns a `ModelOutput`. Attention is delegated to the
context's `attention` callable, `attention(layer_index, q, k, v, layer_cache) -> (out,
layer_cache)`, so the same weights serve the dense reference path and the paged engine (with
`scan_layers`, `layer_index` is a `StackedLayer` and `layer_cache` the cache of its whole
stack); mixture-of-experts layers run the context's `experts`. A model with attention sinks
(gpt-oss: a learned logit per query head that joins every softmax's denominator) also passes
`sinks=` `[Hq]` float32.
Token arrays may have any leading shape (`[B, T]` for the dense path, `[T]` for a flat
ragged batch).

Every parameter carries `logical_axes` metadata ("vocab", "embed", "heads", "kv_heads",
"head_dim", "mlp", "norm"); only `sharding/` maps those names to mesh axes. Kernels are stored
`[in, out]` (heads split out as their own axis), i.e. transposed from Hugging Face's
`[out, in]`; `jaxserve.loading.weights` does the conversion.

With `cfg.quantization` the kernels (and embedding / lm head unless skipped) are stored in
int8 or fp8 beside a float32 `<name>_scale` parameter with the kernel's output axes
(`jaxserve.model.quantization`); every projection goes through `quantization.project`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve import fixed_order
from jaxserve.model.config import ModelConfig
from jaxserve.model.contract import AttentionFn, ExpertMixture, ModelOutput, StepContext
from jaxserve.model.lora import LoRABatch, add_delta
from jaxserve.model.moe import SparseMoE, expert_counts
from jaxserve.model.quantization import embedding_rows, project, weight_param
from jaxserve.model.rope import apply_rope, inverse_frequencies, rope_scale

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedLayer:
    """The layer a scanned model runs (`scan_layers`): the layers are stacked by their
    position in the period their kinds repeat with (`ModelConfig.scan_period`), so layer
    `group * period + position` is entry `group` (traced) of stack `position` (static,
    which says its window, rope and pages)."""

    group: jax.Array  # [] int32
    position: int = dataclasses.field(metadata=dict(static=True))
    period: int = dataclasses.field(metadata=dict(static=True))

    @property
    def index(self) -> jax.Array:
        """The layer's index in the model (traced)."""
        return self.group * self.period + self.position


def layer_position(layer_index) -> int:
    """The static index that says a layer's kind: its own (a Python int) or its stack's."""
    return layer_index.position if isinstance(layer_index, StackedLayer) else layer_index


def random_param(rngs: nnx.Rngs, shape, dtype, axes, scale: float = 0.02) -> nnx.Param:
    """A parameter of normal random values times `scale` with logical `axes`."""
    value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


def _zeros(shape, dtype, axes) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in float32, scaled in the input dtype (as HF's Llama
    does); `gemma`: scaled by `1 + weight` in float32, then cast (HF's Gemma)."""

    def __init__(self, dim: int, eps: float, dtype, axis_name: str = "norm",
                 gemma: bool = False):
        self.eps = eps
        self.gemma = gemma
        initial = jnp.zeros((dim,), dtype) if gemma else jnp.ones((dim,), dtype)
        self.weight = nnx.Param(initial, logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return fixed_order.rowwise(self._normed, x)

    def _normed(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.gemma:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)


def norm(cfg: ModelConfig, dim: int, dtype, axis_name: str = "norm") -> RMSNorm:
    """An RMSNorm of the family's kind."""
    return RMSNorm(dim, cfg.rms_norm_eps, dtype, axis_name, gemma=cfg.gemma is not None)


class Attention(nnx.Module):
    """Grouped-query self-attention projections, rope and optional q/k norm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, layer: int = 0):
        e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj, self.q_proj_scale = weight_param(
            cfg, "q_proj", rngs, (e, hq, d), dtype, ("embed", "heads", "head_dim"))
        self.k_proj, self.k_proj_scale = weight_param(
            cfg, "k_proj", rngs, (e, hkv, d), dtype, ("embed", "kv_heads", "head_dim"))
        self.v_proj, self.v_proj_scale = weight_param(
            cfg, "v_proj", rngs, (e, hkv, d), dtype, ("embed", "kv_heads", "head_dim"))
        self.o_proj, self.o_proj_scale = weight_param(
            cfg, "o_proj", rngs, (hq, d, e), dtype, ("heads", "head_dim", "embed"))
        self.quantization = cfg.quantization
        if cfg.qkv_bias:
            self.q_bias = _zeros((hq, d), dtype, ("heads", "head_dim"))
            self.k_bias = _zeros((hkv, d), dtype, ("kv_heads", "head_dim"))
            self.v_bias = _zeros((hkv, d), dtype, ("kv_heads", "head_dim"))
        self.o_bias = _zeros((e,), dtype, ("embed",)) if cfg.o_bias else None
        self.sinks = (nnx.Param(jnp.zeros((hq,), dtype), logical_axes=("heads",))
                      if cfg.attention_sinks else None)
        if cfg.qk_norm:
            self.q_norm = norm(cfg, d, dtype, "head_dim")
            self.k_norm = norm(cfg, d, dtype, "head_dim")
        self.qkv_bias = cfg.qkv_bias
        self.qk_norm = cfg.qk_norm
        self.rope = cfg.layer_rope(layer)  # static; frequencies are constants at trace time
        self.head_dim = d
        # Gemma's score scale, folded into the queries (the kernels scale by D ** -0.5)
        self.query_scale = (None if cfg.gemma is None else
                            (cfg.gemma.query_pre_attn_scalar / d) ** -0.5)

    def __call__(self, layer_index: int, x: jax.Array, positions: jax.Array,
                 attention: AttentionFn, layer_cache: Any,
                 lora: LoRABatch | None = None) -> tuple[jax.Array, Any]:
        q = self._project("...e,ehd->...hd", x, self.q_proj, self.q_proj_scale)  # [..., Hq, D]
        k = self._project("...e,ehd->...hd", x, self.k_proj, self.k_proj_scale)  # [..., Hkv, D]
        v = self._project("...e,ehd->...hd", x, self.v_proj, self.v_proj_scale)  # [..., Hkv, D]
        if self.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        q, k, v = (add_delta(lora, name, x, out)
                   for name, out in (("q_proj", q), ("k_proj", k), ("v_proj", v)))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotated(q, positions), self._rotated(k, positions)
        # A row whose activations overflowed (an adapter's, say) must reach no other row:
        # attention multiplies invisible keys' values by zero weights, and 0 x NaN is NaN,
        # in this step and for the next owner of a page it wrote. So K/V are kept finite.
        k, v = _finite(k), _finite(v)
        if self.query_scale is not None:
            q = (q.astype(jnp.float32) * self.query_scale).astype(q.dtype)
        sinks = {} if self.sinks is None else {"sinks": self.sinks[...].astype(jnp.float32)}
        out, layer_cache = attention(layer_index, q, k, v, layer_cache, **sinks)  # [..., Hq, D]
        # One [Hq * D, E] matmul: as an einsum over (h, d), XLA CPU may transpose the weight
        # (a copy of all of o_proj) in every step to suit the attention output's layout.
        out = out.astype(x.dtype).reshape(*out.shape[:-2], -1)  # [..., Hq * D]
        kernel = self.o_proj[...].reshape(-1, self.o_proj.shape[-1])  # [Hq * D, E]
        scale = None if self.o_proj_scale is None else self.o_proj_scale[...]
        projected = project("...k,ke->...e", out, kernel, scale, self.quantization)
        if self.o_bias is not None:
            projected = projected + self.o_bias[...]
        return add_delta(lora, "o_proj", out, projected), layer_cache

    def _project(self, spec, x, kernel: nnx.Param, scale: nnx.Param | None) -> jax.Array:
        return project(spec, x, kernel[...], None if scale is None else scale[...],
                       self.quantization)

    def _rotated(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x `[..., H, D]` with rope on its first `partial_rotary_factor * D` dimensions
        (all of them but in GLM), the rest as they are."""
        rotary = int(self.head_dim * self.rope.partial_rotary_factor)
        inv_freq = inverse_frequencies(self.rope, rotary)  # [rotary / 2]
        turned = apply_rope(x[..., :rotary], positions, inv_freq, rope_scale(self.rope))
        return turned if rotary == self.head_dim else jnp.concatenate(
            [turned, x[..., rotary:]], axis=-1)


def _finite(x: jax.Array) -> jax.Array:
    """`x` with its non-finite values (NaN, ±inf) as 0; the same bits everywhere else."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu,
                                                                    approximate=True)}


class MLP(nnx.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh-GELU
    (Gemma's GeGLU)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs,
                 intermediate_size: int | None = None):
        e, i = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_proj, self.gate_proj_scale = weight_param(
            cfg, "gate_proj", rngs, (e, i), dtype, ("embed", "mlp"))
        self.up_proj, self.up_proj_scale = weight_param(
            cfg, "up_proj", rngs, (e, i), dtype, ("embed", "mlp"))
        self.down_proj, self.down_proj_scale = weight_param(
            cfg, "down_proj", rngs, (i, e), dtype, ("mlp", "embed"))
        self.quantization = cfg.quantization
        if cfg.mlp_bias:
            self.gate_bias = _zeros((i,), dtype, ("mlp",))
            self.up_bias = _zeros((i,), dtype, ("mlp",))
            self.down_bias = _zeros((e,), dtype, ("embed",))
        self.mlp_bias = cfg.mlp_bias
        self.hidden_act = cfg.hidden_act

    def __call__(self, x: jax.Array, lora: LoRABatch | None = None) -> jax.Array:
        gate = self._project(x, self.gate_proj, self.gate_proj_scale)  # [..., I]
        up = self._project(x, self.up_proj, self.up_proj_scale)  # [..., I]
        if self.mlp_bias:
            gate, up = gate + self.gate_bias[...], up + self.up_bias[...]
        gate, up = add_delta(lora, "gate_proj", x, gate), add_delta(lora, "up_proj", x, up)
        hidden = ACTIVATIONS[self.hidden_act](gate) * up  # [..., I]
        out = self._project(hidden, self.down_proj, self.down_proj_scale)  # [..., E]
        if self.mlp_bias:
            out = out + self.down_bias[...]
        return add_delta(lora, "down_proj", hidden, out)

    def _project(self, x, kernel: nnx.Param, scale: nnx.Param | None) -> jax.Array:
        return project("...i,io->...o", x, kernel[...], None if scale is None else scale[...],
                       self.quantization)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP (or mixture of experts). Gemma norms the
    outputs of both too (`attn_output_norm`, `mlp_output_norm`); `post_attention_norm` is
    the MLP's input norm in every family (HF's Gemma calls it `pre_feedforward_layernorm`)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, layer: int = 0):
        e = cfg.hidden_size
        self.input_norm = norm(cfg, e, dtype)
        self.attn = Attention(cfg, dtype, rngs, layer)
        self.post_attention_norm = norm(cfg, e, dtype)
        self.mlp = (SparseMoE(cfg, dtype, rngs, lambda width: MLP(cfg, dtype, rngs, width))
                    if cfg.sparse_layer(layer) else MLP(cfg, dtype, rngs))
        if cfg.gemma is not None:
            self.attn_output_norm = norm(cfg, e, dtype)
            self.mlp_output_norm = norm(cfg, e, dtype)
        self.output_norms = cfg.gemma is not None

    def __call__(self, layer_index, x, positions, attention, layer_cache,
                 lora: LoRABatch | None = None, experts: ExpertMixture | None = None):
        """→ (x, layer_cache, the experts each token chose `[T, K]` or None in a dense
        layer). `lora`: this layer's adapter stacks and the tokens' slots (None: the
        base); `experts`: how a mixture-of-experts layer runs its experts (None:
        `default_mixture`)."""
        attn_out, layer_cache = self.attn(
            layer_index, self.input_norm(x), positions, attention, layer_cache, lora)
        if self.output_norms:
            attn_out = self.attn_output_norm(attn_out)
        x = x + attn_out
        hidden = self.post_attention_norm(x)
        routed = None  # [T, K] the experts each token chose, in a mixture-of-experts layer
        if isinstance(self.mlp, SparseMoE):
            out, routed = self.mlp(hidden, experts)
        else:
            out = self.mlp(hidden, lora)
        if self.output_norms:
            out = self.mlp_output_norm(out)
        return x + out, layer_cache, routed


def stacked_layers(cfg: ModelConfig, dtype, rngs: nnx.Rngs, position: int = 0) -> DecoderLayer:
    """One `DecoderLayer` of layer `position`'s kind whose parameters hold the
    `cfg.scan_groups` layers at that position of each period on a leading "layers" axis."""

    @nnx.split_rngs(splits=cfg.scan_groups)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.scan_groups)
    def make(layer_rngs):
        return DecoderLayer(cfg, dtype, layer_rngs, position)

    layers = make(rngs)
    for _, var in nnx.to_flat_state(nnx.state(layers)):
        var.set_metadata("logical_axes", ("layers", *var.get_metadata()["logical_axes"]))
    return layers


class LlamaModel(nnx.Module):
    """Embedding, decoder layers, final norm and language-model head.

    Two layouts of the decoder layers, the same arithmetic:
    - `scan_layers=False`: a list of layers, run by a Python loop; the KV cache is a list of
      per-layer caches, and attention is called with the layer's own cache.
    - `scan_layers=True`: layers stacked by kind, run by `lax.scan`, so a program holds one
      copy of each kind and compiles in about the same time at any depth (80 layers of a 70B
      model compile like 1). The layers' kinds repeat every `cfg.scan_period` layers (1 when
      all are alike; Gemma 3: 6), so `layers` holds that many stacks of `cfg.scan_groups`
      layers (`[G, ...]`), one scan step running one of each; the few layers past the last
      whole period (`tail`) run after it one by one. The cache is `(stacks, tail)`: per stack
      one page pool of all its layers, carried through the scan whole; attention is called
      with a `StackedLayer` and its stack's pool, which it addresses
      (`jaxserve.attention.backend`); `tail` as in the loop.
    """

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
                 scan_layers: bool = False):
        self.config = cfg
        self.scan_layers = scan_layers
        self.compute_dtype = jnp.dtype(dtype)  # of activations and the KV cache
        self.embed, self.embed_scale = weight_param(
            cfg, "embed", rngs, (cfg.vocab_size, cfg.hidden_size), dtype, ("vocab", "embed"))
        if scan_layers:
            if not cfg.scannable:
                raise ValueError("scan_layers needs layers whose kinds (window, rope, dense or "
                                 "sparse MLP) repeat; this model's do not (run the loop)")
            self.layers = nnx.List([stacked_layers(cfg, dtype, rngs, position)
                                    for position in range(cfg.scan_period)])
            first_tail = cfg.scan_groups * cfg.scan_period
        else:
            self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, i)
                                    for i in range(cfg.num_layers)])
            first_tail = cfg.num_layers
        self.tail = nnx.List([DecoderLayer(cfg, dtype, rngs, i)
                              for i in range(first_tail, cfg.num_layers)])
        self.final_norm = norm(cfg, cfg.hidden_size, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head, self.lm_head_scale = weight_param(
                cfg, "lm_head", rngs, (cfg.hidden_size, cfg.vocab_size), dtype,
                ("embed", "vocab"))

    def __call__(self, token_ids: jax.Array, positions: jax.Array, kv_cache: Any,
                 step: StepContext, aux_layers: tuple[int, ...] = (),
                 count_experts: bool = False) -> ModelOutput:
        """token_ids, positions `[...]` int32 → final hidden states `[..., E]` and the new
        cache, as a `ModelOutput`.

        `kv_cache`: a list of per-layer caches, or with `scan_layers` `(stacks, tail)`.
        `step`: the attention, the experts, the real tokens and the LoRA batch (the adapter
        slots' stacks `[L, S, ...]` and each token's slot).
        `aux_layers`: also return the inputs of these layers side by side `[..., n * E]`
        (`ModelOutput.aux`, what an EAGLE-3 head reads).
        `count_experts` (mixture-of-experts models): also return the expert load `[L, X]`
        int32 (`ModelOutput.expert_load`): per layer, the (token, expert) pairs each expert
        got, counting the tokens `step.real_tokens` marks (all of them if None); dense
        layers' rows are 0."""
        attention, lora = step.attention, step.lora
        x = embedding_rows(self.embed[...], _value(self.embed_scale), token_ids,
                           self.compute_dtype)  # [..., E]
        if self.config.gemma is not None:  # sqrt(E), rounded to the compute dtype as HF does
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, self.compute_dtype)
        moe = self.config.moe if count_experts else None
        count = lambda routed: expert_counts(routed, moe.num_experts,  # noqa: E731
                                             step.real_tokens)
        load = None if moe is None else jnp.zeros((self.config.num_layers, moe.num_experts),
                                                  jnp.int32)  # [L, X]
        aux = [jnp.zeros_like(x) for _ in aux_layers]

        def run(layer, index, x, cache, aux, load, layer_lora):
            """One layer: its input kept if an aux layer, its expert load counted."""
            if isinstance(index, StackedLayer):
                flat = index.index  # traced
                aux = [jnp.where(flat == at, x, kept) for at, kept in zip(aux_layers, aux)]
            else:
                flat = index
                aux = [x if flat == at else kept for at, kept in zip(aux_layers, aux)]
            x, cache, routed = layer(index, x, positions, attention, cache, layer_lora,
                                     step.experts)
            if load is not None and routed is not None:
                load = load.at[flat].set(count(routed))
            return x, cache, aux, load

        if self.scan_layers:
            stacks, tail_caches = kv_cache
            x, stacks, aux, load = self._scan(run, x, stacks, aux, load, lora)
        else:
            tail_caches, stacks = kv_cache, None
        first_tail = self.config.num_layers - len(self.tail)
        layers = self.tail if self.scan_layers else self.layers
        new_caches = []
        for offset, layer in enumerate(layers):
            index = offset + (first_tail if self.scan_layers else 0)
            x, cache, aux, load = run(layer, index, x, tail_caches[offset], aux, load,
                                      None if lora is None else lora.layer(index))
            new_caches.append(cache)
        kv_cache = (stacks, new_caches) if self.scan_layers else new_caches
        return self._outputs(x, kv_cache, aux, load)

    def _scan(self, run, x, stacks, aux, load, lora):
        """The stacked layers: one scan step per group, running one layer of each stack."""
        graphdef, params = nnx.split(self.layers)
        period, groups = self.config.scan_period, self.config.scan_groups
        # the adapters' [L, S, ...] stacks as [G, period, S, ...], a group per scan step
        lora_stacks = None if lora is None else jax.tree.map(
            lambda w: w[:groups * period].reshape(groups, period, *w.shape[1:]), lora.stacks)

        def one_group(carry, per_group):
            x, stacks, aux, load = carry
            group, params, group_lora = per_group
            stacks = list(stacks)
            for position, layer in enumerate(nnx.merge(graphdef, params)):
                layer_lora = None if lora is None else lora.with_stacks(
                    jax.tree.map(lambda w: w[position], group_lora))
                x, stacks[position], aux, load = run(
                    layer, StackedLayer(group, position, period), x, stacks[position], aux,
                    load, layer_lora)
            return (x, stacks, aux, load), None

        groups_index = jnp.arange(groups, dtype=jnp.int32)
        (x, stacks, aux, load), _ = jax.lax.scan(
            one_group, (x, list(stacks), aux, load), (groups_index, params, lora_stacks))
        return x, stacks, aux, load

    def _outputs(self, x, kv_cache, aux, load) -> ModelOutput:
        """The final hidden states and cache, the layer inputs asked for when there are
        some, the expert load when counted."""
        return ModelOutput(self.final_norm(x), kv_cache,
                           jnp.concatenate(aux, axis=-1) if aux else None, load)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Hidden states `[..., E]` → float32 logits `[..., V]`."""
        quant = self.config.quantization
        if self.config.tie_word_embeddings:
            out = project("...e,ve->...v", hidden, self.embed[...], _value(self.embed_scale),
                          quant)
        else:
            out = project("...e,ev->...v", hidden, self.lm_head[...],
                          _value(self.lm_head_scale), quant)
        out = out.astype(jnp.float32)
        cap = None if self.config.gemma is None else self.config.gemma.final_logit_softcap
        return out if cap is None else cap * jnp.tanh(out / cap)


def _value(param: nnx.Param | None) -> jax.Array | None:
    return None if param is None else param[...]
