"""N-gram (prompt lookup) drafts, found on device over each row's token history.

vLLM's rule: among the earlier occurrences of the row's last n tokens, for n from
`prompt_lookup_min` to `prompt_lookup_max`, take the longest n, then the earliest occurrence,
and propose the (up to k) tokens that followed it. An occurrence may overlap the last tokens
themselves, but must end before the last token, so at least one token follows it.

On device that is one comparison per (history position, n): an occurrence ending at position
e matches n tokens when `history[e - i] == history[T - 1 - i]` for i < n, so the match length
ending at e is the count of leading trues, a cumulative product along i. No host round trip,
no loop over positions: `[S, L, max_n]` comparisons a round, small beside a forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NO_DRAFT = -1  # a draft slot with nothing proposed; never equals a sampled token


def propose(history: jax.Array, lengths: jax.Array, k: int, min_n: int, max_n: int,
            max_model_len: int) -> jax.Array:
    """Drafts `[S, k]` int32 (`NO_DRAFT` where none) for rows whose tokens are
    `history[s, :lengths[s]]` (`history` `[S, L]`, `lengths` `[S]`)."""
    rows, length = history.shape
    last = lengths[:, None] - 1  # [S, 1] index of the newest token
    back = jnp.arange(max_n)  # [N] i: compare the token i before each end
    suffix_at = last - back[None, :]  # [S, N]
    suffix = jnp.where(suffix_at >= 0,
                       jnp.take_along_axis(history, jnp.maximum(suffix_at, 0), axis=1),
                       -2)  # [S, N] the row's last tokens, newest first; -2 matches nothing
    ends = jnp.arange(length)  # [L] e
    at = ends[:, None] - back[None, :]  # [L, N] e - i
    earlier = jnp.where(at[None] >= 0, history[:, jnp.maximum(at, 0)], -3)  # [S, L, N]
    equal = earlier == suffix[:, None, :]  # [S, L, N]
    match = jnp.sum(jnp.cumprod(equal, axis=-1), axis=-1)  # [S, L] n matched ending at e
    allowed = (ends[None, :] <= last - 1) & (match >= min_n)  # ends before the newest token
    match = jnp.where(allowed, match, 0)
    best = jnp.max(match, axis=-1)  # [S] longest n
    end = jnp.argmax(match == best[:, None], axis=-1)  # [S] earliest end with it
    start = end + 1  # [S] first proposed token
    count = jnp.minimum(jnp.minimum(k, lengths - start), max_model_len - lengths)  # [S]
    count = jnp.where(best > 0, count, 0)
    offsets = jnp.arange(k)  # [k]
    index = jnp.minimum(start[:, None] + offsets[None, :], length - 1)  # [S, k]
    drafts = jnp.take_along_axis(history, index, axis=1)
    return jnp.where(offsets[None, :] < count[:, None], drafts, NO_DRAFT).astype(jnp.int32)
