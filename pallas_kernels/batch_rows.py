"""Which kernel takes which rows of a batch, and what each row sees.

- `split_rows`: a ragged batch's rows with one new token go to the decode kernel, longer
  chunks to the prefill kernel.
- `decode_key_ranges`: the keys each decode row sees (both decode kernels).
- `tile_sequences`: the sequences whose chunks overlap each prefill tile (both prefill
  kernels cut the flat batch into tiles of q_block tokens); `chunk_in_tile`: which of a
  chunk's tokens a tile holds and the keys they see (scalar jnp, inside the kernels).

A query at position p of a sequence with kv_len keys sees keys [max(0, p - W + 1), p + 1)
with a sliding window W, [0, p + 1) without; kernels visit only the pages overlapping it.
"""

from typing import NamedTuple

import jax.numpy as jnp


class RowKinds(NamedTuple):
    """How a ragged batch's rows split between the two kernels, each [S]."""

    is_decode: jnp.ndarray  # [S] bool: one new token (the decode kernel's)
    chunk_len: jnp.ndarray  # [S] int32 new tokens of a longer chunk (the prefill kernel's), else 0


def split_rows(cu_q_lens, num_seqs) -> RowKinds:
    """Live rows with one new token go to the decode kernel, longer chunks to the prefill one."""
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    live = jnp.arange(q_len.shape[0]) < num_seqs[0]  # [S]
    return RowKinds(live & (q_len == 1), jnp.where(live & (q_len > 1), q_len, 0))


def decode_key_ranges(kv_lens, sliding_window):
    """(key_lo, key_hi) int32 [B]: row b's one query at kv_lens[b] - 1 sees keys
    [key_lo, key_hi) (kv_len 0: none, key_lo = key_hi = 0)."""
    key_hi = jnp.maximum(kv_lens, 0).astype(jnp.int32)  # [B]
    if sliding_window is None:
        return jnp.zeros_like(key_hi), key_hi
    return jnp.clip(key_hi - sliding_window, 0, key_hi).astype(jnp.int32), key_hi


def tile_sequences(cu_q_lens, chunk_len, num_tiles, q_block):
    """(seq_lo, seq_hi) int32 [tiles]: the sequences whose chunks overlap each tile of
    q_block tokens (seq_lo > seq_hi: none)."""
    max_seqs = chunk_len.shape[0]
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * q_block  # [tiles]
    seq_end = cu_q_lens[:-1] + chunk_len  # [S] non-decreasing
    # Chunks that end after the tile's start and begin before its end.
    seq_lo = jnp.searchsorted(seq_end, tile_start, side="right")
    seq_hi = jnp.searchsorted(cu_q_lens[:-1], tile_start + q_block, side="left") - 1
    return (jnp.minimum(seq_lo, max_seqs - 1).astype(jnp.int32),
            jnp.clip(seq_hi, -1, max_seqs - 1).astype(jnp.int32))


def chunk_in_tile(first_token, q_len, kv_len, tile_start, q_block, sliding_window):
    """For a chunk of q_len tokens from flat token first_token, ending at position
    kv_len - 1, and the tile of q_block tokens from tile_start: (a, b) the chunk's tokens in
    the tile, [a, b); pos_shift (a token's position is token + pos_shift); and
    (key_lo, key_hi) the keys those tokens see (key_hi = 0: none)."""
    a = jnp.maximum(first_token, tile_start)
    b = jnp.minimum(first_token + q_len, tile_start + q_block)
    pos_shift = kv_len - q_len - first_token
    key_hi = jnp.where(b > a, b + pos_shift, 0)  # one past the last token's position
    key_lo = jnp.zeros_like(key_hi) if sliding_window is None else jnp.maximum(
        a + pos_shift - sliding_window + 1, 0)
    return a, b, pos_shift, jnp.minimum(key_lo, key_hi), key_hi
