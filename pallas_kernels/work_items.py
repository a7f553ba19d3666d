"""Key ranges and work items: how a batch's rows become kernel work.

`decode_items` gives each decode row its key range (both decode kernels); `split_rows` sends
a ragged batch's one-token rows to the decode kernel and its longer chunks to the prefill
kernel. The GPU prefill kernel sees the chunks as a list of work items: an item is up to
`q_block` consecutive query tokens of ONE sequence, for all query heads; the kernel runs one
program per (item, kv head) and streams that sequence's pages. For the ragged batch, queries are gathered into a dense
[items, Hkv, q_block * G, D] array (row r = token r // G, head r % G of the
kv-head group) so every kernel block is aligned and static-shaped; the output is
scattered back to token order, padding rows ending up as zeros. The extra
gather/scatter touches only q-sized data, which is small next to the KV read.

Key range of an item: queries at positions [pos0, pos0 + len) see keys
[max(0, pos0 - W + 1), min(pos0 + len, kv_len)); kernels visit only the key
blocks overlapping it.
"""

from typing import NamedTuple

import jax.numpy as jnp


class WorkItems(NamedTuple):
    """Per-item int32 scalars, each [I]."""

    seq: jnp.ndarray  # [I] sequence (row of page_indices)
    pos0: jnp.ndarray  # [I] position of the item's first query token
    kv_len: jnp.ndarray  # [I] kv length of the sequence
    key_lo: jnp.ndarray  # [I] first key the item can see
    key_hi: jnp.ndarray  # [I] one past the last key the item can see (<= key_lo: none)


def _finish(seq, pos0, q_len, kv_len, sliding_window):
    key_hi = jnp.where(q_len > 0, jnp.minimum(pos0 + q_len, kv_len), 0)  # [I]
    key_lo = jnp.zeros_like(key_hi) if sliding_window is None else pos0 - sliding_window + 1
    key_lo = jnp.clip(key_lo, 0, jnp.maximum(key_hi, 0))  # [I]
    key_hi = jnp.maximum(key_hi, key_lo)  # [I]
    return WorkItems(seq, pos0, kv_len, key_lo.astype(jnp.int32), key_hi.astype(jnp.int32))


def decode_items(kv_lens, sliding_window) -> WorkItems:
    """One item per sequence, one query at position kv_len - 1."""
    seq = jnp.arange(kv_lens.shape[0], dtype=jnp.int32)  # [B]
    return _finish(seq, kv_lens - 1, jnp.ones_like(kv_lens), kv_lens, sliding_window)


def num_ragged_items(num_tokens, max_seqs, q_block):
    """Static upper bound on the items of a ragged batch."""
    return -(-num_tokens // q_block) + max_seqs


class RowKinds(NamedTuple):
    """How a ragged batch's rows split between the two kernels, each [S]."""

    is_decode: jnp.ndarray  # [S] bool: one new token (the decode kernel's)
    chunk_len: jnp.ndarray  # [S] int32 new tokens of a longer chunk (the ragged kernel's), else 0


def split_rows(cu_q_lens, num_seqs) -> RowKinds:
    """Live rows with one new token go to the decode kernel, longer chunks to the ragged one."""
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    live = jnp.arange(q_len.shape[0]) < num_seqs[0]  # [S]
    return RowKinds(live & (q_len == 1), jnp.where(live & (q_len > 1), q_len, 0))


def ragged_items(kv_lens, cu_q_lens, seq_q_len, num_tokens, q_block, sliding_window):
    """Splits each sequence's `seq_q_len` [S] queries (the flat tokens from cu_q_lens[s])
    into chunks of <= q_block tokens.

    Returns (WorkItems, row0 [I] first flat token of each item, q_len [I] tokens in it).
    Items past the real ones have q_len 0 and see no keys.
    """
    max_seqs = kv_lens.shape[0]
    num_items = num_ragged_items(num_tokens, max_seqs, q_block)
    n_chunks = -(-seq_q_len // q_block)  # [S]
    chunk_end = jnp.cumsum(n_chunks)  # [S]
    item = jnp.arange(num_items, dtype=jnp.int32)  # [I]
    seq = jnp.minimum(jnp.searchsorted(chunk_end, item, side="right"), max_seqs - 1)  # [I]
    seq = seq.astype(jnp.int32)
    q_off = (item - (chunk_end - n_chunks)[seq]) * q_block  # [I] offset inside the sequence
    q_len = jnp.where(item < chunk_end[-1], jnp.minimum(q_block, seq_q_len[seq] - q_off), 0)  # [I]
    pos0 = kv_lens[seq] - seq_q_len[seq] + q_off  # [I]
    row0 = cu_q_lens[seq] + q_off  # [I]
    items = _finish(seq, pos0, q_len, kv_lens[seq], sliding_window)
    return items, row0, q_len


def pack_queries(q, row0, q_len, num_kv_heads, q_block):
    """q [T, Hq, D] -> [I, Hkv, q_block * G, D] plus each packed token's row in q ([I * q_block], T = none)."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    offs = jnp.arange(q_block, dtype=jnp.int32)  # [q_block]
    token = row0[:, None] + offs[None, :]  # [I, q_block]
    token = jnp.where(offs[None, :] < q_len[:, None], token, num_tokens)  # [I, q_block]
    num_items = row0.shape[0]
    packed = q[jnp.minimum(token, num_tokens - 1)]  # [I, q_block, Hq, D]
    packed = packed.reshape(num_items, q_block, num_kv_heads, group, head_dim)
    packed = packed.transpose(0, 2, 1, 3, 4).reshape(
        num_items, num_kv_heads, q_block * group, head_dim
    )  # [I, Hkv, q_block * G, D]
    return packed, token.reshape(-1)


def unpack_outputs(out, token, num_tokens, q_block):
    """out [I, Hkv, q_block * G, D] -> [T, Hq, D]; rows whose token is T are dropped."""
    num_items, num_kv_heads, rows, head_dim = out.shape
    group = rows // q_block
    out = out.reshape(num_items, num_kv_heads, q_block, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(
        num_items * q_block, num_kv_heads * group, head_dim
    )  # [I * q_block, Hq, D]
    result = jnp.zeros((num_tokens, num_kv_heads * group, head_dim), out.dtype)  # [T, Hq, D]
    return result.at[token].set(out, mode="drop")
