"""The pooling step: one forward over a packed ragged batch of whole sequences and the
pooled vector of each, computed on device; nothing is sampled and no KV cache is written.

A batch is `PackedSequences`: the sequences' tokens side by side, padded to a token bucket
`T`, with each token's segment (its sequence's row; padding has row `S`, the bucket's
sequence count) and position. Attention runs densely over the `[T, T]` pairs of the batch,
masked to pairs of one segment (and causal for decoders), so no page table is needed: a
pooling request is prefilled once and forgotten. Pooling reads the hidden states by segment:
the last token, the first (CLS) or the mean.

Prefix sharing (causal models only, where a token's hidden state depends on the tokens
before it alone): when every sequence of a batch starts with the same tokens (a reranker's
instruction and query before each document, an embedding model's instruction before each
query), the batch holds that prefix once, at its start; every sequence's own tokens attend
to it and to themselves, and take positions after it. The prefix's hidden states are the
same for all, so a mean adds their sum once per row, and CLS is the prefix's first token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedSequences:
    """Whole sequences packed into one padded batch (host numpy arrays)."""

    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32, 0 at each sequence's first token
    segments: np.ndarray  # [T] int32, the token's row; padding: S
    first_index: np.ndarray  # [S] int32, where each row starts in the batch
    last_index: np.ndarray  # [S] int32, where each row ends
    lengths: np.ndarray  # [S] int32, whole length (shared prefix included); padding: 0
    in_prefix: np.ndarray  # [T] bool, the token belongs to the prefix every row shares

    @classmethod
    def pack(cls, sequences: list[list[int]], tokens: int, rows: int,
             position_offset: int = 0, shared: int = 0) -> "PackedSequences":
        """`sequences` packed into a batch of `tokens` tokens and `rows` rows (the bucket);
        positions start at `position_offset` (XLM-RoBERTa's padding_idx + 1). `shared`:
        the first `shared` tokens of every sequence (equal in all, and shorter than each)
        are packed once, as the shared prefix."""
        token_ids = np.zeros((tokens,), np.int32)
        positions = np.zeros((tokens,), np.int32)
        segments = np.full((tokens,), rows, np.int32)
        in_prefix = np.zeros((tokens,), bool)
        first, last, lengths = (np.zeros((rows,), np.int32) for _ in range(3))
        if shared:
            token_ids[:shared] = sequences[0][:shared]
            positions[:shared] = np.arange(shared) + position_offset
            segments[:shared] = rows + 1  # a segment of its own, seen by every row
            in_prefix[:shared] = True
        start = shared
        for row, ids in enumerate(sequences):
            own = ids[shared:]
            end = start + len(own)
            token_ids[start:end] = own
            positions[start:end] = np.arange(shared, len(ids)) + position_offset
            segments[start:end] = row
            first[row] = 0 if shared else start
            last[row], lengths[row] = end - 1, len(ids)
            start = end
        if start > tokens or len(sequences) > rows:
            raise ValueError(f"{len(sequences)} sequences of {start} tokens do not fit a "
                             f"batch of {rows} rows and {tokens} tokens")
        return cls(token_ids, positions, segments, first, last, lengths, in_prefix)


def shared_prefix(sequences: list[list[int]]) -> int:
    """How many leading tokens all `sequences` (two or more) have in common, leaving each
    at least one token of its own (its last token is what LAST pools)."""
    if len(sequences) < 2:
        return 0
    shortest = min(len(ids) for ids in sequences) - 1
    first = sequences[0]
    count = 0
    while count < shortest and all(ids[count] == first[count] for ids in sequences):
        count += 1
    return count


QUERY_BLOCK = 512  # queries per block of a long batch's attention


def segment_attention(batch: PackedSequences, causal: bool):
    """An attention callable for the model (`attention(layer, q, k, v, cache) -> (out,
    cache)`): dense softmax attention among the tokens of one segment and the shared
    prefix (which comes first, so causal order holds), causal or not.
    A batch longer than `QUERY_BLOCK` (and a multiple of it) runs its queries a block at a
    time, so the scores take `[Hq, QUERY_BLOCK, T]`, not `[Hq, T, T]`."""
    segments = batch.segments  # [T]
    index = jnp.arange(segments.shape[0])
    rows = batch.lengths.shape[0]
    visible = segments[:, None] == segments[None, :]  # [T, T]
    visible |= (segments[:, None] < rows) & batch.in_prefix[None, :]  # rows see the prefix
    if causal:
        visible &= index[None, :] <= index[:, None]

    def attention(layer_index, q, k, v, layer_cache, sinks=None):
        if sinks is not None:
            raise ValueError("attention sinks are not supported by the pooling runner")
        tokens, hq, d = q.shape
        k = jnp.repeat(k, hq // k.shape[1], axis=1).astype(jnp.float32)  # [T, Hq, D]
        v = jnp.repeat(v, hq // v.shape[1], axis=1).astype(jnp.float32)  # [T, Hq, D]

        def block(queries, seen):  # [B, Hq, D], [B, T] -> [B, Hq, D]
            scores = jnp.einsum("qhd,khd->hqk", queries.astype(jnp.float32), k) * d ** -0.5
            weights = jax.nn.softmax(jnp.where(seen[None], scores, -jnp.inf), axis=-1)
            return jnp.einsum("hqk,khd->qhd", weights, v)

        if tokens > QUERY_BLOCK and tokens % QUERY_BLOCK == 0:
            blocks = tokens // QUERY_BLOCK
            out = jax.lax.map(lambda args: block(*args), (
                q.reshape(blocks, QUERY_BLOCK, hq, d), visible.reshape(blocks, QUERY_BLOCK,
                                                                       tokens)))
            out = out.reshape(tokens, hq, d)
        else:
            out = block(q, visible)
        return out.astype(q.dtype), layer_cache

    return attention


def pool(hidden: jax.Array, batch: PackedSequences, pooling_type: str) -> jax.Array:
    """Each row's vector `[S, E]` float32 from the hidden states `[T, E]`: its last token
    ("LAST"), first token ("CLS") or mean over its tokens, shared prefix included ("MEAN");
    padding rows are 0 for MEAN."""
    hidden = hidden.astype(jnp.float32)
    rows = batch.lengths.shape[0]
    if pooling_type == "LAST":
        return hidden[batch.last_index]
    if pooling_type == "CLS":
        return hidden[batch.first_index]
    sums = jax.ops.segment_sum(hidden, batch.segments, num_segments=rows + 2)[:rows]
    prefix = jnp.sum(jnp.where(batch.in_prefix[:, None], hidden, 0.0), axis=0)  # [E]
    sums = sums + jnp.where(batch.lengths[:, None] > 0, prefix[None], 0.0)
    return sums / jnp.maximum(batch.lengths, 1)[:, None].astype(jnp.float32)


jax.tree_util.register_dataclass(
    PackedSequences, data_fields=[f.name for f in dataclasses.fields(PackedSequences)],
    meta_fields=[])
