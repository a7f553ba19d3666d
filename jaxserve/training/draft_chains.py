"""Attention for training a draft head on whole chains of its own proposals at once
(EAGLE-3's "training-time test").

At serving time a round runs the head once per proposal. The first pass at position c reads
(token c, the model's hidden state at c - 1) and its keys are the head's cache, as every
kept token's are. Pass j (j >= 1) of the same round sits at position c + j, reads (the
previous proposal, the head's own previous output) and attends to the cached keys of
positions 0..c plus the keys that passes 1..j of this round wrote, one position each.

Training runs pass j for every start c of a sequence at once: pass j's arrays have one row
per chain, `[B, L - j, ...]`, row c being the chain that starts at c. So its query at row c
sees pass 0's keys at rows 0..c (causally) and the keys of passes 1..j at row c only (the
diagonal), which is what `ChainAttention` computes. Without it, a later pass would attend to
other chains' later passes, which no round ever shows it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChainAttention:
    """The model's `AttentionFn` for one training pass of a one-layer head. `layer_cache`
    is the earlier passes' keys and values, `((k0, v0), (k1, v1), ...)` with pass m's
    `[B, L - m, Hkv, D]` (`()` for pass 0); the returned cache adds this pass's."""

    def __call__(self, layer_index, q, k, v, layer_cache, sinks=None):
        del layer_index
        if sinks is not None:
            raise ValueError("ChainAttention: attention sinks are not supported")
        batch, chains, num_heads, head_dim = q.shape  # pass j: chains = L - j
        num_kv_heads = k.shape[-2]
        passes = tuple(layer_cache) + ((k, v),)
        (first_k, first_v), later = passes[0], passes[1:]
        group = num_heads // num_kv_heads
        q = q.reshape(batch, chains, num_kv_heads, group, head_dim)  # [B, C, Hkv, G, D]
        scale = head_dim ** -0.5
        causal = jnp.einsum("bckgd,bskd->bkgcs", q, first_k,
                            preferred_element_type=jnp.float32) * scale  # [B, Hkv, G, C, L]
        row = jnp.arange(chains)[:, None]
        causal = jnp.where(jnp.arange(first_k.shape[1])[None, :] <= row, causal, -jnp.inf)
        # each later pass's key of the same chain: [B, Hkv, G, C, j]
        diagonal = [jnp.einsum("bckgd,bckd->bkgc", q, pk[:, :chains],
                               preferred_element_type=jnp.float32)[..., None] * scale
                    for pk, _ in later]
        probs = jax.nn.softmax(jnp.concatenate([causal, *diagonal], axis=-1), axis=-1)
        out = jnp.einsum("bkgcs,bskd->bckgd", probs[..., :first_k.shape[1]],
                         first_v.astype(jnp.float32))  # [B, C, Hkv, G, D]
        for m, (_, pv) in enumerate(later):
            weight = probs[..., first_k.shape[1] + m]  # [B, Hkv, G, C]
            out = out + jnp.einsum("bkgc,bckd->bckgd", weight, pv[:, :chains].astype(
                jnp.float32))
        out = out.reshape(batch, chains, num_heads, head_dim).astype(q.dtype)
        return out, passes
