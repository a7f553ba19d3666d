"""Causal self-attention without a KV cache, for training on whole sequences.

Same call signature as the model's `AttentionFn`; the layer cache is passed through untouched
(training passes `None`). Query t sees keys 0..t of its own row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_attention(layer_index, q, k, v, layer_cache):
    """q `[B, T, Hq, D]`, k/v `[B, T, Hkv, D]` → out `[B, T, Hq, D]`, `layer_cache` unchanged."""
    del layer_index
    batch, tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    group = num_heads // num_kv_heads
    q = q.reshape(batch, tokens, num_kv_heads, group, head_dim)  # [B, T, Hkv, G, D]
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k,
                        preferred_element_type=jnp.float32)  # [B, Hkv, G, T, T]
    scores = scores * (head_dim ** -0.5)
    visible = jnp.tril(jnp.ones((tokens, tokens), dtype=bool))  # [T, T]
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)  # [B, T, Hkv, G, D]
    return out.reshape(batch, tokens, num_heads, head_dim), layer_cache
