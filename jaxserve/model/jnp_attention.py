"""Ragged paged attention in plain jnp, fast enough for CPU serving.

The reference in `pallas_kernels.reference` gathers every query token's whole page table
(`[T, max_model_len, Hkv, D]` copied per layer), which dominates a CPU step. A step of
continuous batching needs far less:
- fresh prompts (no cached context) attend only to the step's own new tokens (`[T, T]`,
  masked to same-sequence and causal);
- decode rows (one token after cached context) need one page-table gather per sequence
  (`[S, L]`), not per token;
- the FCFS scheduler continues at most one long prompt per step, so one sequence's context
  is gathered once (`[L]`) and joined to the own-token keys of that sequence's queries.
Steps made only of those take this path; others (several continued chunks, prefix-cache
hits beside a continued chunk) fall back to the reference. The choice is a `lax.cond`, so one
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
    rows = kv_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    context = kv_lens - q_lens  # [S] cached tokens before this step's (padding rows: 0)
    continued = (context > 0) & (q_lens > 1)  # [S] multi-token chunks after cached context
    simple = jnp.sum(continued) <= 1

    def from_pages():
        return reference.ragged_paged_attention(
            q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
            sliding_window=sliding_window)

    def fast():
        prefill = (q_lens > 1) | ((context == 0) & (q_lens > 0))  # [S] rows beyond decode
        out = jax.lax.cond(  # an all-decode step (every decode-loop step) skips this part
            jnp.any(prefill),
            lambda: _own_tokens_and_one_context(q, k_new, v_new, k_pages, v_pages, context,
                                                page_indices, cu_q_lens, num_seqs, continued,
                                                sliding_window),
            lambda: jnp.zeros_like(q))
        first = jnp.minimum(cu_q_lens[:-1], q.shape[0] - 1)  # [S] each row's first token
        decoded = reference.paged_attention(q[first], k_pages, v_pages, kv_lens, page_indices,
                                            sliding_window=sliding_window)  # [S, Hq, D]
        decode_row = (context > 0) & (q_lens == 1) & (jnp.arange(rows) < num_seqs[0])
        target = jnp.where(decode_row, first, q.shape[0])  # out of range: dropped
        return out.at[target].set(decoded, mode="drop")

    return jax.lax.cond(simple, fast, from_pages)


def _own_tokens_and_one_context(q, k_new, v_new, k_pages, v_pages, context, page_indices,
                                cu_q_lens, num_seqs, continued, sliding_window):
    """Attention over [the continued sequence's cached context ++ the step's own tokens].

    Right for every token except decode rows (which see only themselves here; the caller
    replaces them). Returns `[T, Hq, D]`; padding tokens get zeros.
    """
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    token = jnp.arange(tokens, dtype=jnp.int32)  # [T]
    valid = token < cu_q_lens[num_seqs[0]]  # [T]
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], token, side="right"),
                      context.shape[0] - 1)  # [T]
    pos = context[seq] + token - cu_q_lens[seq]  # [T] absolute position of each token
    own = ((seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
           & valid[:, None] & valid[None, :])  # [T, T] query × own-token key
    chunk_seq = jnp.argmax(continued)  # the continued sequence (any, if there is none)
    slot = jnp.arange(page_indices.shape[1] * k_pages.shape[1])  # [L] context positions
    ctx = ((seq[:, None] == chunk_seq) & continued[chunk_seq] & valid[:, None]
           & (slot[None, :] < context[chunk_seq]))  # [T, L]
    if sliding_window is not None:
        own &= pos[:, None] - pos[None, :] < sliding_window
        ctx &= pos[:, None] - slot[None, :] < sliding_window
    k_ctx = k_pages[page_indices[chunk_seq]].reshape(-1, num_kv_heads, head_dim)  # [L, Hkv, D]
    v_ctx = v_pages[page_indices[chunk_seq]].reshape(-1, num_kv_heads, head_dim)
    keys = jnp.concatenate([k_ctx, k_new.astype(k_ctx.dtype)]).astype(jnp.float32)  # [L+T, ..]
    values = jnp.concatenate([v_ctx, v_new.astype(v_ctx.dtype)]).astype(jnp.float32)
    visible = jnp.concatenate([ctx, own], axis=1)  # [T, L+T]
    group = num_heads // num_kv_heads
    qg = q.astype(jnp.float32).reshape(tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("thgd,uhd->hgtu", qg, keys) * head_dim ** -0.5  # [Hkv, G, T, L+T]
    scores = jnp.where(visible, scores, -jnp.inf)
    peak = jnp.where(visible.any(-1), jnp.max(scores, axis=-1), 0.0)[..., None]
    weights = jnp.where(visible, jnp.exp(scores - peak), 0.0)
    weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1e-30)
    out = jnp.einsum("hgtu,uhd->thgd", weights, values)  # [T, Hkv, G, D]
    return out.reshape(tokens, num_heads, head_dim).astype(q.dtype)
