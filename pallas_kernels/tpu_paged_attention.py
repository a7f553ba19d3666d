"""Pallas Mosaic TPU paged attention.

Grid (work item, key block). A key block is `pages_per_block` pages; each page
of the block is its own kernel operand (the same k_pages / v_pages array passed
`pages_per_block` times) whose BlockSpec index_map reads the page id from the
scalar-prefetched page table, so Pallas' pipeline DMAs a block's pages into
VMEM while the previous block is being processed, with no manual DMA code.
For key blocks outside an item's key range the index_map repeats the last
useful page, so the pipeline issues no copy, and the body is skipped. All kv
heads of a page arrive together (one contiguous [page_size, Hkv, D] DMA); the
kernel loops over kv heads, attending the G query heads of each group to that
head's keys with an online softmax (float32 m / l / acc in VMEM scratch).

TPU tiling constraints (the reason for the limits in validation.py):
* A block's last two dims must be multiples of the (8, 128) vreg tile or the full
  array dims. K/V blocks are (page, page_size, Hkv, D) with full (Hkv, D); query
  blocks are (item, Hkv, q_block * G, D) with full minor dims, so any head count
  and q_block are accepted.
* page_size must be a multiple of 16 (bf16 packs 16 rows per sublane tile), hence
  16..128; page_size * pages_per_block keys per block, ideally >= 128 lanes.
* The cache's minor tile is (Hkv, D): XLA pads Hkv up to 8 (f32) / 16 (bf16) in
  HBM, so Hkv below that wastes cache memory and DMA bandwidth, and picking one
  head out of a page is a sublane-strided VMEM load. Per-device Hkv >= 8 keeps it
  dense. head_dim 64 uses half a lane tile.
* The page table is scalar-prefetched into SMEM as a flat int32[S * P]; it must
  fit there (a few hundred KiB), which bounds max_seqs * pages_per_seq.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import MASK_VALUE
from pallas_kernels.work_items import WorkItems


def _kernel(seq_ref, pos0_ref, kv_len_ref, key_lo_ref, key_hi_ref, pt_ref, q_ref, *refs,
            group, pages_per_block, sm_scale, soft_cap, sliding_window):
    # q_ref, o_ref [Hkv, R, D]; each k/v ref [page_size, Hkv, D] ([page_size, D] if Hkv = 1);
    # m_ref, l_ref [Hkv, R, 1], acc_ref [Hkv, R, D] float32 scratch.
    k_refs, v_refs = refs[:pages_per_block], refs[pages_per_block:2 * pages_per_block]
    o_ref, m_ref, l_ref, acc_ref = refs[2 * pages_per_block:]
    item, block = pl.program_id(0), pl.program_id(1)
    num_kv_heads, rows, _ = q_ref.shape
    page_size = k_refs[0].shape[0]
    block_keys = page_size * pages_per_block
    key_lo, key_hi = key_lo_ref[item], key_hi_ref[item]

    @pl.when(block == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((block * block_keys < key_hi) & ((block + 1) * block_keys > key_lo))
    def _accumulate():
        row = jax.lax.broadcasted_iota(jnp.int32, (rows, block_keys), 0)  # [R, KB]
        q_pos = pos0_ref[item] + (jax.lax.div(row, group) if rows > group else 0)  # [R, KB]
        key_pos = block * block_keys + jax.lax.broadcasted_iota(
            jnp.int32, (rows, block_keys), 1)  # [R, KB]
        mask = (key_pos <= q_pos) & (key_pos < key_hi) & (key_pos < kv_len_ref[item])
        if sliding_window is not None:
            mask &= q_pos - key_pos < sliding_window
        key_col = block * block_keys + jax.lax.broadcasted_iota(
            jnp.int32, (block_keys, 1), 0)  # [KB, 1]
        key_valid = (key_col >= key_lo) & (key_col < key_hi)  # [KB, 1]
        for h in range(num_kv_heads):
            k = jnp.concatenate([_head(r, h) for r in k_refs], axis=0)  # [KB, D]
            v = jnp.concatenate([_head(r, h) for r in v_refs], axis=0)  # [KB, D]
            v = jnp.where(key_valid, v, jnp.zeros_like(v))  # rows past kv_len may hold anything
            s = jax.lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * sm_scale  # [R, KB]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, MASK_VALUE)
            m_prev = m_ref[h]  # [R, 1]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))  # [R, 1]
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)  # [R, KB]
            alpha = jnp.exp(m_prev - m_new)  # [R, 1]
            l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
            acc_ref[h] = alpha * acc_ref[h] + jax.lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32)  # [R, D]
            m_ref[h] = m_new

    @pl.when(block == pl.num_programs(1) - 1)
    def _finalize():
        l = l_ref[...]  # [Hkv, R, 1]
        o_ref[...] = (acc_ref[...] / jnp.where(l == 0, 1.0, l)).astype(o_ref.dtype)


def _head(page_ref, h):
    """Head h's rows `[page_size, D]` of a page block: `[page_size, Hkv, D]`, or
    `[page_size, D]` when pages hold one kv head (squeezed, see `attention`)."""
    return page_ref[...] if len(page_ref.shape) == 2 else page_ref[:, h, :]


def _page_index_map(n, pages_per_seq, page_size, pages_per_block, squeezed):
    """index_map of the n-th page operand: clamps the block into the item's key range."""

    def index_map(item, block, seq_ref, pos0_ref, kv_len_ref, key_lo_ref, key_hi_ref, pt_ref):
        del pos0_ref, kv_len_ref
        # lax.div (truncating) not //: floor division lowers through sign(), which
        # Mosaic only lowers on a real TPU. Keys are >= 0, so both agree.
        first_page = jax.lax.div(key_lo_ref[item], page_size)
        last_page = jnp.maximum(jax.lax.div(key_hi_ref[item] + page_size - 1, page_size) - 1,
                                first_page)
        slot = jnp.clip(block * pages_per_block + n, first_page, last_page)
        page = pt_ref[seq_ref[item] * pages_per_seq + slot]
        return (page, 0, 0) if squeezed else (page, 0, 0, 0)

    return index_map


@functools.partial(
    jax.jit,
    static_argnames=("group", "sm_scale", "soft_cap", "sliding_window", "pages_per_block",
                     "interpret"),
)
def attention(q, k_pages, v_pages, page_indices, items: WorkItems, *, group, sm_scale,
              soft_cap=None, sliding_window=None, pages_per_block=None, interpret=False):
    """Attention of packed query rows over paged K/V.

    q [I, Hkv, R, D] (row r = query token r // group); k_pages, v_pages
    [N, page_size, Hkv, D]; page_indices int32 [S, P]; items: WorkItems of [I].
    Returns [I, Hkv, R, D]. pages_per_block default: enough pages for 256 keys.
    """
    num_items, num_kv_heads, rows, head_dim = q.shape
    page_size = k_pages.shape[1]
    num_seqs, pages_per_seq = page_indices.shape
    if pages_per_block is None:
        pages_per_block = max(1, min(pages_per_seq, 256 // page_size))
    num_blocks = pl.cdiv(pages_per_seq, pages_per_block)
    q_spec = pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda i, j, *_: (i, 0, 0, 0))
    # One kv head per device (tp = Hkv): XLA:TPU lays `[N, page_size, 1, D]` out with the unit
    # axis major (no padding), while a 4-d kernel operand wants it minor, so every call would
    # relayout (copy) the whole cache. `[N, page_size, D]` is the same bytes: a bitcast.
    squeezed = num_kv_heads == 1
    page_block = (None, page_size, head_dim) if squeezed else (
        None, page_size, num_kv_heads, head_dim)
    if squeezed:
        k_pages = k_pages.reshape(k_pages.shape[0], page_size, head_dim)
        v_pages = v_pages.reshape(v_pages.shape[0], page_size, head_dim)
    page_specs = [
        pl.BlockSpec(page_block,
                     _page_index_map(n, pages_per_seq, page_size, pages_per_block, squeezed))
        for n in range(pages_per_block)
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_items, num_blocks),
        in_specs=[q_spec] + page_specs + page_specs,
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _kernel, group=group, pages_per_block=pages_per_block, sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="paged_attention_mosaic",
    )(*items, page_indices.reshape(num_seqs * pages_per_seq), q,
      *([k_pages] * pages_per_block), *([v_pages] * pages_per_block))
