"""The online softmax's last step, shared by the kernels: the weighted sum over the sum of the
weights, with an optional attention sink (gpt-oss).

A sink is one learned logit per query head that joins every row's softmax denominator and
takes no value: `out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink))`, the keys' scores
s_j as the kernels compute them (scaled, capped, masked) and the sink as it is. It enters
once, at the end, so the key loops (and the split-K partials) stay as without sinks. The
running max m of a row that saw no key is MASK_VALUE, so the sink is not added as
`exp(sink - m)`, which overflows there: both terms are rescaled to the larger of m and the
sink first.
"""

import jax.numpy as jnp


def normalize(acc, m, l, sink=None):
    """Rows of acc [..., R, D] (weighted sums, float32) over their weights' sum l [..., R, 1],
    taken relative to the running max m [..., R, 1], plus exp(sink) of the row's head (sink
    [..., R, 1] float32; None: no sink, and m is not used). Rows with no weight (l 0; with a
    sink of -inf) give zeros."""
    if sink is None:
        return acc / jnp.where(l == 0, 1.0, l)
    top = jnp.maximum(m, sink)  # [..., R, 1]
    keep = jnp.exp(m - top)  # the keys' weights, rescaled from m to top
    total = l * keep + jnp.exp(sink - top)  # [..., R, 1]
    return acc * (keep / jnp.where(total == 0, 1.0, total))


def row_sinks(sinks, num_kv_heads, tokens, rows):
    """sinks [Hq] per query row of a kv head's `[rows, D]` block of `tokens` tokens, each
    token's G = Hq / Hkv heads in consecutive rows: [Hkv, rows] float32, row r of kv head h
    the sink of query head h * G + r % G, rows past tokens * G (padding) 0."""
    group = sinks.shape[0] // num_kv_heads
    per_head = sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group)  # [Hkv, 1, G]
    per_row = jnp.broadcast_to(per_head, (num_kv_heads, tokens, group)).reshape(
        num_kv_heads, tokens * group)  # [Hkv, tokens * G]
    return jnp.pad(per_row, ((0, 0), (0, rows - tokens * group)))  # [Hkv, rows]
