"""Pallas Mosaic TPU attention for prefill chunks: query tiles of the flat batch over paged K/V.

The ragged batch's T tokens are cut into tiles of `q_block` consecutive tokens (128 by
default), one grid step each. The grid is (core, step), `(NUM_CORES, ceil(tiles /
NUM_CORES))`, "parallel" x "arbitrary": on a megacore chip each TensorCore walks its own run
of tiles in order (so a step may prefetch for the next), on a single-core chip the runs
follow each other; the tile count is padded to whole runs (padding tiles hold no chunk). A
tile may hold the end of one chunk and the start of the next; the step loops over the
sequences whose chunks overlap it (`seq_lo..seq_hi`, found once per call) and, for each, over
the key blocks that its rows in the tile can see: from the window's start (0 without a
sliding window) to its last row's position. So work is bounded by each sequence's keys and
its chunk, never by the page table's width, and no query is copied into per-sequence
blocks: the tile is a plain BlockSpec block of the queries, the output tile likewise.

Queries enter as `[Hkv, T' * G, D]` (each kv head's G query heads of each token as
consecutive rows), so a tile is one dense `[q_block * G, D]` matrix per kv head: the MXU
takes all the group's heads and tokens at once. Rows of other sequences (and decode rows,
which `ragged_paged_attention` gives to the decode kernel) are masked out of a sequence's
softmax and come out as zeros here.

Each chunk's page-table entries in use are copied from HBM into SMEM (two row slots) before
its pages (`tpu_copies`). K/V: manual async copies of `pages_per_block` pages per block into
two VMEM slots, the next block fetched while the current one computes, and during a chunk's
last block the first block of the next chunk this core visits (the tile's next sequence, or
the first of the core's next tile), as in the decode kernel: only a core's first chunk, and
a chunk that follows one with no keys here (a decode row), wait for their first block. Copies
are clipped to the pages that hold the chunk's keys, so table entries past them are never
read; V rows past the range are zeroed.
Quantized pages as in `tpu_decode`: copied as stored (int8 with their scale pages, four
copies per page instead of two) and dequantized per head in VMEM. Attention sinks as in
`tpu_decode`: `[Hq]` float32 in SMEM, applied when a tile's output is written.

Relation to RPA v3: like it, one kernel walks sequences inside a step with manual
double-buffered page copies, the next sequence's first block prefetched; unlike it, the
tiles are fixed windows of the flat batch (not per-sequence query blocks), so the grid is
static and every tile is one BlockSpec block.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import batch_rows, tpu_attend, tpu_copies
from pallas_kernels.reference import MASK_VALUE
from pallas_kernels.tpu_decode import NUM_CORES

DEFAULT_Q_BLOCK = 128  # query tokens per tile
KV_BUFFER_BYTES = 4 << 20  # K and V, both slots
VMEM_LIMIT_BYTES = 48 << 20  # tiles of 128 tokens x 32 heads need more than v5e's 16 MiB default


def _kernel(kv_lens_ref, cu_ref, chunk_ref, seq_lo_ref, seq_hi_ref, q_ref, *refs, q_block,
            group, page_size, pages_per_block, num_pools, sm_scale, soft_cap, sliding_window,
            with_sinks):
    # refs: sink_ref (sinks only), table_hbm, the num_pools pools in HBM, o_ref, their
    # num_pools VMEM buffers, then sems, rows_ref, row_sems, state_ref, m_ref, l_ref, acc_ref.
    # q_ref, o_ref [Hkv, R = q_block * G, D]; sink_ref SMEM [Hq] float32; table_hbm [S, P]
    # and the pools k_hbm, v_hbm [N, page_size / f, f * Hkv * D] (then, int8 pages, their
    # scales [N, Hkv * S] float32) in HBM; buffers [2, pages_per_block, ...] of each pool's
    # pages; sems DMA [pool, 2 (slot)]; rows_ref SMEM [2, P] (this and the next chunk's table
    # rows), row_sems DMA [2]; state_ref SMEM [3]: the next chunk's K/V slot, whether its
    # first block is already fetched, its table-row slot; m_ref, l_ref [Hkv, R, 1] and
    # acc_ref [Hkv, R, D] float32.
    sink_ref, refs = (refs[0], refs[1:]) if with_sinks else (None, refs)
    table_hbm, pools, o_ref = refs[0], refs[1:num_pools + 1], refs[num_pools + 1]
    buffers = refs[num_pools + 2:2 * num_pools + 2]
    sems, rows_ref, row_sems, state_ref, m_ref, l_ref, acc_ref = refs[2 * num_pools + 2:]
    core, step = pl.program_id(0), pl.program_id(1)
    steps = pl.num_programs(1)
    tile = core * steps + step
    num_kv_heads, rows, _ = q_ref.shape
    block_keys = page_size * pages_per_block
    tile_start = tile * q_block

    def chunk(t, s):
        """Sequence s's chunk in tile t: `chunk_in_tile`'s (a, b, pos_shift, key_lo, key_hi),
        then the pages [first, last) holding those keys and their block count."""
        a, b, pos_shift, key_lo, key_hi = batch_rows.chunk_in_tile(
            cu_ref[s], chunk_ref[s], kv_lens_ref[s], t * q_block, q_block, sliding_window)
        first = jax.lax.div(key_lo, page_size)
        last = jnp.where(key_hi > key_lo, jax.lax.div(key_hi + page_size - 1, page_size), first)
        blocks = jax.lax.div(last - first + pages_per_block - 1, pages_per_block)
        return a, b, pos_shift, key_lo, key_hi, first, last, blocks

    def copy_block(row_slot, first, last, index, slot, start):
        """Starts or waits for block `index` of pages [first, last) (table row in
        rows_ref[row_slot]) into K/V `slot`: its pages up to the last."""
        page0 = first + index * pages_per_block
        tpu_copies.block_copies(rows_ref.at[row_slot], pools, buffers, sems, slot, page0,
                                jnp.minimum(last - page0, pages_per_block), start)

    def fetch_first(s, row_slot, first, last, slot):
        """Copies sequence s's table entries [first, last) (waiting for them), then starts
        its first K/V block's copies into `slot`."""
        for start in (True, False):
            tpu_copies.row_copies(table_hbm, s, rows_ref.at[row_slot], row_sems.at[row_slot],
                                  first, last, start)
        copy_block(row_slot, first, last, 0, slot, start=True)

    @pl.when(step == 0)
    def _first_on_core():
        state_ref[0], state_ref[1], state_ref[2] = 0, 0, 0

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    # Token (tile_start + r // G) of each query row, as a column and as the scores' rows.
    row_token = tile_start + jax.lax.div(
        jax.lax.broadcasted_iota(jnp.int32, (rows, block_keys), 0), group)  # [R, KB]

    def attend_sequence(s, carry):
        a, b, pos_shift, key_lo, key_hi, first, last, blocks = chunk(tile, s)
        slot0, prefetched, row_slot = state_ref[0], state_ref[1], state_ref[2]
        state_ref[1] = 0

        @pl.when((blocks > 0) & (prefetched == 0))
        def _fetch_first():
            fetch_first(s, row_slot, first, last, slot0)

        def body(index, carry):
            slot = jax.lax.rem(slot0 + index, 2)

            @pl.when(index + 1 < blocks)
            def _prefetch_next_block():
                copy_block(row_slot, first, last, index + 1, 1 - slot, start=True)

            @pl.when(index + 1 == blocks)
            def _prefetch_next_chunk():
                # The next (tile, sequence) this core visits: the tile's next sequence, else
                # the first of the core's next tile (this core's next grid step).
                in_tile = s < seq_hi_ref[tile]
                next_tile = jnp.where(in_tile, tile, tile + 1)
                next_seq = jnp.where(in_tile, s + 1,
                                     seq_lo_ref[jnp.minimum(tile + 1, seq_lo_ref.shape[0] - 1)])
                *_, next_first, next_last, next_blocks = chunk(next_tile, next_seq)

                @pl.when((in_tile | (step + 1 < steps)) & (next_blocks > 0))
                def _():
                    fetch_first(next_seq, 1 - row_slot, next_first, next_last, 1 - slot)
                    state_ref[1] = 1

            copy_block(row_slot, first, last, index, slot, start=False)
            key0 = (first + index * pages_per_block) * page_size
            key_pos = key0 + jax.lax.broadcasted_iota(jnp.int32, (rows, block_keys), 1)
            q_pos = row_token + pos_shift  # [R, KB]
            mask = ((row_token >= a) & (row_token < b) & (key_pos <= q_pos)
                    & (key_pos >= key_lo))  # [R, KB]
            if sliding_window is not None:
                mask &= q_pos - key_pos < sliding_window
            key_col = key0 + jax.lax.broadcasted_iota(jnp.int32, (block_keys, 1), 0)
            key_valid = (key_col >= key_lo) & (key_col < key_hi)  # [KB, 1]
            tpu_attend.attend_block(q_ref, *buffers[:2], slot, mask, key_valid, m_ref, l_ref,
                                    acc_ref, sm_scale=sm_scale, soft_cap=soft_cap,
                                    **dict(zip(("k_scale_buf", "v_scale_buf"), buffers[2:])))
            return carry

        jax.lax.fori_loop(0, blocks, body, 0)
        state_ref[0] = jax.lax.rem(slot0 + blocks, 2)
        state_ref[2] = 1 - row_slot
        return carry

    jax.lax.fori_loop(seq_lo_ref[tile], seq_hi_ref[tile] + 1, attend_sequence, 0)
    tpu_attend.finish(o_ref, m_ref, l_ref, acc_ref, sink_ref)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "q_block", "pages_per_block",
                     "interpret", "page_size"),
)
def attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, chunk_len, k_scales=None,
              v_scales=None, sinks=None, *, sm_scale, soft_cap=None, sliding_window=None,
              q_block=None, pages_per_block=None, interpret=False, page_size=None):
    """Attention of the prefill chunks of a flat batch q [T, Hq, D] over paged K/V
    [N, page_size / f, f * Hkv * D] (q's dtype, int8 with k_scales, v_scales [N, Hkv * S]
    float32, or float8_e4m3fn; page_size None: the pages' rows, f = 1).

    Sequence s's chunk is the chunk_len[s] tokens from cu_q_lens[s] (0: not here, e.g. a
    decode row), at positions ending at kv_lens[s] - 1, attending causally (and within
    sliding_window). page_indices int32 [S, P]; kv_lens must be <= P * page_size. sinks [Hq]
    float: each query head's attention sink (None: none). Rows of no chunk come out as
    zeros. Returns [T, Hq, D].
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = page_size or k_pages.shape[1]
    num_kv_heads = k_pages.shape[2] * k_pages.shape[1] // (page_size * head_dim)
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]
    q_block = q_block or DEFAULT_Q_BLOCK
    if pages_per_block is None:
        pages_per_block = tpu_attend.block_pages(k_pages, k_scales, page_size, pages_per_seq,
                                                 KV_BUFFER_BYTES)
    steps = pl.cdiv(pl.cdiv(num_tokens, q_block), NUM_CORES)
    num_tiles = steps * NUM_CORES  # each core walks its `steps` tiles in order
    padded = num_tiles * q_block
    rows = q_block * group
    q_heads = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0))).reshape(
        padded, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3).reshape(
        num_kv_heads, padded * group, head_dim)  # [Hkv, T' * G, D]
    seq_lo, seq_hi = batch_rows.tile_sequences(cu_q_lens, chunk_len, num_tiles, q_block)
    q_spec = pl.BlockSpec((num_kv_heads, rows, head_dim),
                          lambda core, step, *_: (0, core * steps + step, 0))
    sink_in = () if sinks is None else (sinks.astype(jnp.float32),)  # [Hq], whole in SMEM
    # K, V, then (int8) their scale pools [N, Hkv * S].
    pools = (k_pages, v_pages) + (() if k_scales is None else (k_scales, v_scales))
    grid_spec = tpu_attend.grid_spec(q_spec, pools, sink_in, 5, steps, NUM_CORES,
                                     pages_per_block, pages_per_seq, 3,
                                     (num_kv_heads, rows, head_dim))
    kernel = functools.partial(
        _kernel, q_block=q_block, group=group, page_size=page_size,
        pages_per_block=pages_per_block, num_pools=len(pools), sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window, with_sinks=bool(sink_in))
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_heads.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=interpret,
        name="prefill_attention_mosaic",
    )(kv_lens, cu_q_lens, chunk_len, seq_lo, seq_hi, q_heads, *sink_in, page_indices,
      *pools)  # [Hkv, T' * G, D]
    out = out.reshape(num_kv_heads, padded, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(padded, num_q_heads, head_dim)[:num_tokens]  # [T, Hq, D]
