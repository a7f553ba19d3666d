"""Ragged paged attention in plain jnp, fast enough for CPU serving.

The reference in `pallas_kernels.reference` gathers every query token's whole page table
(`[T, max_model_len, Hkv, D]` copied per layer), which dominates a CPU step. Most steps of
continuous batching need far less: fresh prompts (no cached context) attend only to the
step's own new tokens (`[T, T]`, masked to same-sequence and causal), and decode rows (one
token after cached context) need one page-table gather per sequence (`[S, L]`), not per
token. Steps made only of those two kinds take this path; others (a later chunk of a long
prompt, a prefix-cache hit) fall back to the reference. The choice is a `lax.cond`, so one
compiled program serves both and only the chosen branch runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import reference


def ragged_attention(q, k_new, v_new, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                     num_seqs, sliding_window=None):
    """Same contract as `ragged_paged_attention` (the new tokens' K/V already written to the
    pages); `k_new`, `v_new` `[T, Hkv, D]` are this step's keys and values."""
    num_seqs_total = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    context = kv_lens - q_lens  # [S] cached tokens before this step's (padding rows: 0)
    simple = jnp.all((context == 0) | (q_lens == 1))  # fresh prompts and decode rows only

    def from_pages():
        return reference.ragged_paged_attention(
            q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
            sliding_window=sliding_window)

    def among_own_tokens():
        tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_new.shape[1]
        token = jnp.arange(tokens, dtype=jnp.int32)  # [T]
        valid = token < cu_q_lens[num_seqs[0]]  # [T]
        seq = jnp.searchsorted(cu_q_lens[1:], token, side="right")  # [T]
        seq = jnp.minimum(seq, num_seqs_total - 1)
        pos = token - cu_q_lens[seq]  # [T] position in its sequence (no context before it)
        visible = ((seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
                   & valid[:, None] & valid[None, :])  # [T, T] query × key
        if sliding_window is not None:
            visible &= pos[:, None] - pos[None, :] < sliding_window
        group = num_heads // num_kv_heads
        qg = q.astype(jnp.float32).reshape(tokens, num_kv_heads, group, head_dim)
        scores = jnp.einsum("thgd,uhd->hgtu", qg, k_new.astype(jnp.float32))  # [Hkv, G, T, T]
        scores = jnp.where(visible, scores * head_dim ** -0.5, -jnp.inf)
        peak = jnp.max(scores, axis=-1, keepdims=True)
        weights = jnp.where(visible, jnp.exp(scores - jnp.where(visible.any(-1, keepdims=True),
                                                                  peak, 0.0)), 0.0)
        weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1e-30)
        out = jnp.einsum("hgtu,uhd->thgd", weights, v_new.astype(jnp.float32))  # [T, Hkv, G, D]
        return out.reshape(tokens, num_heads, head_dim).astype(q.dtype)

    def fresh_and_decode():
        out = among_own_tokens()  # right for fresh prompts; decode rows are replaced below
        first = jnp.minimum(cu_q_lens[:-1], q.shape[0] - 1)  # [S] each row's first token
        decoded = reference.paged_attention(q[first], k_pages, v_pages, kv_lens, page_indices,
                                            sliding_window=sliding_window)  # [S, Hq, D]
        decode_row = (context > 0) & (jnp.arange(num_seqs_total) < num_seqs[0])
        target = jnp.where(decode_row, first, q.shape[0])  # out of range: dropped
        return out.at[target].set(decoded, mode="drop")

    return jax.lax.cond(simple, fresh_and_decode, from_pages)
