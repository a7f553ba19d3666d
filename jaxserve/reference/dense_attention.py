"""Dense attention without pages: the reference generation path and training.

With a cache, each batch row owns a contiguous cache `[S, Hkv, D]` per layer. New keys/values
are written at
their own positions, and a query at position p sees keys 0..p (and, with a sliding window W,
only those with p - j < W). Because every row is masked by its query positions, ragged
prompts can be right-padded: padded slots are written with garbage that is overwritten by the
decode step at that position before any query can see it. Without one (`layer_cache` None,
as training passes), queries attend causally to the step's own keys, at their positions.

`kv_cache_dtype` "int8" / "fp8" makes keys and values read back as a quantized paged cache
would give them (`pallas_kernels.kv_quant.round_trip`; fp8 with `head_scales`, per layer,
K/V and kv head, as a calibrated fp8 cache holds them), so the dense path can measure what
KV quantization costs (`jaxserve bench quality`) without pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.attention.backend import layer_window
from jaxserve.model.config import ModelConfig
from pallas_kernels.kv_quant import page_dtype, round_trip


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseAttention:
    """Attention over per-row dense caches; call signature is the model's `AttentionFn`."""

    positions: jax.Array  # [B, T] int32 position of every query token
    # each layer's sliding window (None: the whole context); one entry: every layer's
    windows: tuple[int | None, ...] = dataclasses.field(default=(None,),
                                                        metadata=dict(static=True))
    kv_cache_dtype: str = dataclasses.field(default="auto", metadata=dict(static=True))
    head_scales: jax.Array | None = None  # [L, 2, Hkv] fp8 scales of K and V (None: 1)
    soft_cap: float | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def of_model(cls, cfg: ModelConfig, positions: jax.Array, kv_cache_dtype: str = "auto",
                 head_scales: jax.Array | None = None) -> "DenseAttention":
        """The attention `cfg`'s layers ask for: their windows and score cap."""
        return cls(positions, cfg.layer_windows, kv_cache_dtype, head_scales,
                   None if cfg.gemma is None else cfg.gemma.attn_logit_softcap)

    def __call__(self, layer_index, q, k, v, layer_cache, sinks=None):
        """With `sinks` `[Hq]` float32 (gpt-oss), each head's sink logit joins the softmax's
        denominator."""
        batch, tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[-2]
        if self.kv_cache_dtype != "auto":
            stored = page_dtype(self.kv_cache_dtype, k.dtype)
            k_scale, v_scale = (None, None) if self.head_scales is None else (
                self.head_scales[layer_index])
            k, v = round_trip(k, stored, k_scale), round_trip(v, stored, v_scale)
        if layer_cache is None:  # the step's own keys, at the queries' positions
            keys, values = k, v  # [B, T, Hkv, D]
            key_pos = self.positions[:, None, :]  # [B, 1, T]
        else:
            k_cache, v_cache = layer_cache  # [B, S, Hkv, D] each
            rows = jnp.arange(batch)[:, None]  # [B, 1]
            keys = k_cache.at[rows, self.positions].set(k.astype(k_cache.dtype))
            values = v_cache.at[rows, self.positions].set(v.astype(v_cache.dtype))
            layer_cache = (keys, values)
            key_pos = jnp.arange(keys.shape[1])[None, None, :]  # [1, 1, S]
        group = num_heads // num_kv_heads
        q = q.reshape(batch, tokens, num_kv_heads, group, head_dim)  # [B, T, Hkv, G, D]
        scores = jnp.einsum("btkgd,bskd->bkgts", q, keys,
                            preferred_element_type=jnp.float32)  # [B, Hkv, G, T, S]
        scores = scores * (head_dim ** -0.5)
        if self.soft_cap is not None:
            scores = self.soft_cap * jnp.tanh(scores / self.soft_cap)
        query_pos = self.positions[:, :, None]  # [B, T, 1]
        visible = key_pos <= query_pos  # [B, T, S]
        window = layer_window(self.windows, layer_index)
        if window is not None:
            visible &= query_pos - key_pos < window
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        if sinks is None:
            probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
        else:  # the softmax over [scores, sink], the sink's column dropped
            sink = sinks.reshape(num_kv_heads, group)[None, :, :, None]  # [1, Hkv, G, 1]
            peak = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink[..., None])
            weights = jnp.exp(scores - peak)  # [B, Hkv, G, T, S]
            total = weights.sum(-1, keepdims=True) + jnp.exp(sink[..., None] - peak)
            probs = (weights / total).astype(values.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, values,
                         preferred_element_type=jnp.float32)  # [B, T, Hkv, G, D]
        out = out.reshape(batch, tokens, num_heads, head_dim).astype(q.dtype)
        return out, layer_cache


def empty_dense_cache(num_layers: int, batch: int, length: int, num_kv_heads: int,
                      head_dim: int, dtype) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed per-layer (k, v) caches, each `[B, S, Hkv, D]`."""
    shape = (batch, length, num_kv_heads, head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]
