"""Pallas Mosaic TPU decode attention: one query token per sequence over its paged K/V.

Work is bounded by each sequence's keys, never by the page table's width. The grid is
(core, sequence): `(NUM_CORES, ceil(B / NUM_CORES))`, "parallel" x "arbitrary", so on a
megacore chip (v4, v5p) each TensorCore walks its own half of the batch in order, and on a
single-core chip (v5e, v6e) the halves simply run one after the other. Each grid step owns one
sequence and runs a loop over *its* key blocks only: `ceil(pages in [key_lo, key_hi) /
pages_per_block)` iterations, none for a sequence with no keys.

K/V move by manual async copies from HBM (`memory_space=ANY`) into a two-slot VMEM buffer:
while block i is computed, block i+1 is already in flight, and during a sequence's last
block the *next* sequence's first block is fetched (the grid's "arbitrary" axis keeps a
core's steps in order, so the copy started in one step is waited for in the next). A block
is `pages_per_block` pages, one contiguous DMA per page and per K/V; the last block's copies
are clipped to the pages that hold valid keys, so a page-table entry past a sequence's pages
is never read (it may be -1 or past the pool). The table stays in HBM: each sequence's
entries in use are copied into SMEM one step ahead (double-buffered, `tpu_copies`). Keys
past `key_hi` inside the last page are masked, and their V rows zeroed, so stale VMEM never
reaches the output.

Quantized pages (`kv_quant`) are copied as stored (int8 or fp8: half a bf16 page) and
dequantized per head in VMEM (`tpu_attend`). int8 pages bring their float32 scales along
(the page's row `[Hkv * S]` of the scale pool): one more copy per page for each of K
and V (four per page instead of two), into two-slot buffers of their own that the VMEM
budget counts. XLA passes the pool to the kernel as it is when a device's rows are a
multiple of 128 floats (8 kv heads with pages of 64), so where they would not be (one kv
head with pages of 64) each head's run is padded (`kv_quant.scale_stride`): a narrower row
was laid out pages-minor and copied whole on every call (tests/kernels/test_pallas_compile.py
shows both).

Queries: the G query heads of each kv head form one `[G, D]` block (all Hkv groups of a
sequence arrive as one `[Hkv, G, D]` VMEM block through a BlockSpec); Mosaic pads G to the
sublane tile itself, no query is replicated. Softmax in float32; scores and the weighted sum
are MXU matmuls with float32 accumulation. Attention sinks (`[Hq]` float32, whole in SMEM)
enter once per sequence, when its output is written (`tpu_attend.finish`).

How this follows and departs from tpu-inference's ragged paged attention v3 (RPA v3):
- follows: manual double-buffered page copies with the next sequence's first block prefetched
  across grid steps, page counts clipped to the valid tokens, float32 online softmax;
- departs: decode only (RPA v3 is one kernel for decode, prefill and mixed batches, with a
  per-step distribution of the three); the grid is one step per sequence rather than a
  single sequential loop, so megacore splits the batch; K and V stay separate pools, each
  `[N, page_size, Hkv * D]` with a token's heads packed along lanes (`kv_quant`), where
  RPA v3 fuses K and V of a page and packs heads along sublanes. Either way a page row is
  lane-dense: a copied block is `[pages_per_block, page_size, Hkv * D]`, one (8, 128)-tiled
  slab per page, and head h is the static lane slice `[h * D, (h + 1) * D)`; no sublane
  padding of a `(Hkv, D)` tile, no strided head loads. Where a device's heads fill less than
  128 lanes (one kv head of 64, e.g. a model with 2 kv heads of 64 at tp=2; or 3 heads of
  64), f tokens share a row (`kv_quant.tokens_per_row`): the block is `[pages_per_block,
  page_size / f, f * Hkv * D]` and a head's page is its f lane slices stacked. RPA v3 pads
  head_dim 64 to 128 instead (and fuses K/V), which doubles such a cache; folding pads
  nothing. Measured in full compiles (tests/kernels/test_pallas_compile.py): every head
  count of head_dim 64 and 128 needs no copy of the cache (the former `[N, page_size, Hkv,
  D]` pools were laid out pages-minor for head_dim 64 and copied whole on every call, and
  one-token rows of 64 or 192 values still are).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_attend, tpu_copies
from pallas_kernels.reference import MASK_VALUE

NUM_CORES = 2  # TensorCores per megacore chip; single-core chips run the halves in turn.
KV_BUFFER_BYTES = 8 << 20  # VMEM for K and V, both slots (v5e's scoped default is 16 MiB)


def _kernel(key_lo_ref, key_hi_ref, q_ref, *refs, batch, page_size, pages_per_block,
            num_pools, sm_scale, soft_cap, with_sinks):
    # refs: sink_ref (sinks only), table_hbm, the num_pools pools in HBM, o_ref, their
    # num_pools VMEM buffers, then sems, rows_ref, row_sems, state_ref, m_ref, l_ref, acc_ref.
    # q_ref, o_ref [Hkv, G, D]; sink_ref SMEM [Hq] float32; table_hbm [B, P] and the pools
    # k_hbm, v_hbm [N, page_size, Hkv * D] (then, int8 pages, their scales [N, Hkv * S]
    # float32) in HBM; buffers [2, pages_per_block, ...] of each pool's pages; sems DMA [pool, 2
    # (slot)]; rows_ref SMEM [2, P] (this and the next sequence's table rows), row_sems DMA
    # [2]; state_ref SMEM [2] (K/V slot of the step's first block, whether the step's row is
    # already waited for); m_ref, l_ref [Hkv, G, 1] and acc_ref [Hkv, G, D] float32.
    sink_ref, refs = (refs[0], refs[1:]) if with_sinks else (None, refs)
    table_hbm, pools, o_ref = refs[0], refs[1:num_pools + 1], refs[num_pools + 1]
    buffers = refs[num_pools + 2:2 * num_pools + 2]
    sems, rows_ref, row_sems, state_ref, m_ref, l_ref, acc_ref = refs[2 * num_pools + 2:]
    core, step = pl.program_id(0), pl.program_id(1)
    steps = pl.num_programs(1)
    seq = core * steps + step
    block_keys = page_size * pages_per_block
    num_kv_heads, group, _ = q_ref.shape

    def page_range(s):
        """(first page, one past the last page) holding keys of sequence s."""
        lo, hi = key_lo_ref[s], key_hi_ref[s]
        first = jax.lax.div(lo, page_size)
        last = jnp.where(hi > lo, jax.lax.div(hi + page_size - 1, page_size), first)
        return first, last

    def num_blocks(s):
        first, last = page_range(s)
        return jax.lax.div(last - first + pages_per_block - 1, pages_per_block)

    def row_copy(s, row_slot, start):
        """Starts or waits for the copy of sequence s's table entries in use into
        rows_ref[row_slot] (a batch-padding sequence, s >= batch, uses none)."""
        first, last = page_range(s)
        tpu_copies.row_copies(table_hbm, jnp.minimum(s, batch - 1), rows_ref.at[row_slot],
                             row_sems.at[row_slot], first, last, start)

    def copy_block(s, row_slot, index, slot, start):
        """Starts or waits for block `index` of sequence s (table row in rows_ref[row_slot])
        into `slot`: its pages up to the sequence's last."""
        first, last = page_range(s)
        page0 = first + index * pages_per_block
        tpu_copies.block_copies(rows_ref.at[row_slot], pools, buffers, sems, slot, page0,
                                jnp.minimum(last - page0, pages_per_block), start)

    # Table rows: each step's row was started by the previous step (by itself at step 0) and
    # waited for there if that step prefetched this sequence's first block.
    row_slot = jax.lax.rem(step, 2)

    @pl.when(step == 0)
    def _first_on_core():
        state_ref[0], state_ref[1] = 0, 0
        row_copy(seq, row_slot, start=True)

    @pl.when(state_ref[1] == 0)
    def _wait_row():
        row_copy(seq, row_slot, start=False)

    state_ref[1] = 0

    @pl.when(step + 1 < steps)
    def _fetch_next_row():
        row_copy(seq + 1, 1 - row_slot, start=True)

    blocks = num_blocks(seq)
    # The previous step (same core) prefetched this sequence's first block if it had keys.
    prefetched = (step > 0) & (num_blocks(jnp.maximum(seq - 1, 0)) > 0)
    slot0 = state_ref[0]

    @pl.when((blocks > 0) & ~prefetched)
    def _fetch_first():
        copy_block(seq, row_slot, 0, slot0, start=True)

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    first_page, _ = page_range(seq)
    key_lo, key_hi = key_lo_ref[seq], key_hi_ref[seq]

    def body(index, carry):
        slot = jax.lax.rem(slot0 + index, 2)
        next_slot = 1 - slot

        @pl.when(index + 1 < blocks)
        def _prefetch_next_block():
            copy_block(seq, row_slot, index + 1, next_slot, start=True)

        @pl.when((index + 1 == blocks) & (step + 1 < steps))
        def _prefetch_next_sequence():
            @pl.when(num_blocks(seq + 1) > 0)
            def _():
                row_copy(seq + 1, 1 - row_slot, start=False)  # the next step will not wait
                state_ref[1] = 1
                copy_block(seq + 1, 1 - row_slot, 0, next_slot, start=True)

        copy_block(seq, row_slot, index, slot, start=False)
        key0 = (first_page + index * pages_per_block) * page_size

        def visible(shape, dim):
            key_pos = key0 + jax.lax.broadcasted_iota(jnp.int32, shape, dim)
            return (key_pos >= key_lo) & (key_pos < key_hi)  # key_lo applies the window

        mask = visible((1, block_keys), 1)  # [1, KB] for the scores
        key_valid = visible((block_keys, 1), 0)  # [KB, 1] for the V rows
        tpu_attend.attend_block(q_ref, *buffers[:2], slot, mask, key_valid, m_ref, l_ref,
                                acc_ref, sm_scale=sm_scale, soft_cap=soft_cap,
                                **dict(zip(("k_scale_buf", "v_scale_buf"), buffers[2:])))
        return carry

    jax.lax.fori_loop(0, blocks, body, 0)
    state_ref[0] = jax.lax.rem(slot0 + blocks, 2)
    tpu_attend.finish(o_ref, m_ref, l_ref, acc_ref, sink_ref)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "pages_per_block", "interpret", "page_size"),
)
def attention(q, k_pages, v_pages, page_indices, key_lo, key_hi, k_scales=None,
              v_scales=None, sinks=None, *, sm_scale, soft_cap=None, pages_per_block=None,
              interpret=False, page_size=None):
    """Decode attention of q [B, Hkv, G, D] over paged K/V [N, page_size / f, f * Hkv * D]
    (q's dtype, int8 with k_scales, v_scales [N, Hkv * S] float32, or float8_e4m3fn;
    page_size None: the pages' rows, f = 1).

    Sequence b's query sees keys [key_lo[b], key_hi[b]) (int32 [B] each: causality and any
    sliding window are already in the range; key_hi <= key_lo: none, zeros out);
    page_indices int32 [B, P], entries past a sequence's pages never read. key_hi must be
    <= P * page_size (the caller clamps). sinks [Hkv * G] float: each query head's
    attention sink (None: none). Returns [B, Hkv, G, D]. `interpret`: False, True or a
    `pltpu.InterpretParams`.
    """
    batch, num_kv_heads, group, head_dim = q.shape
    page_size = page_size or k_pages.shape[1]
    pages_per_seq = page_indices.shape[1]
    if pages_per_block is None:
        pages_per_block = tpu_attend.block_pages(k_pages, k_scales, page_size, pages_per_seq,
                                                 KV_BUFFER_BYTES)
    steps = pl.cdiv(batch, NUM_CORES)
    pad = steps * NUM_CORES - batch  # padding sequences: no keys, no pages
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0)))  # [B', Hkv, G, D]
    key_lo, key_hi = (jnp.pad(x, (0, pad)) for x in (key_lo, key_hi))  # [B']

    def q_map(core, step, *_):
        return (core * steps + step, 0, 0, 0)

    q_spec = pl.BlockSpec((None, num_kv_heads, group, head_dim), q_map)
    sink_in = () if sinks is None else (sinks.astype(jnp.float32),)  # [Hq], whole in SMEM
    # K, V, then (int8) their scale pools [N, Hkv * S].
    pools = (k_pages, v_pages) + (() if k_scales is None else (k_scales, v_scales))
    grid_spec = tpu_attend.grid_spec(q_spec, pools, sink_in, 2, steps, NUM_CORES,
                                     pages_per_block, pages_per_seq, 2,
                                     (num_kv_heads, group, head_dim))
    kernel = functools.partial(
        _kernel, batch=batch, page_size=page_size, pages_per_block=pages_per_block,
        num_pools=len(pools), sm_scale=sm_scale, soft_cap=soft_cap, with_sinks=bool(sink_in))
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="decode_attention_mosaic",
    )(key_lo, key_hi, q, *sink_in, page_indices, *pools)
    return out[:batch]  # [B, Hkv, G, D]
