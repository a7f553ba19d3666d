"""Pallas GPU (Triton) attention for prefill chunks over paged K/V.

Why Triton rather than Mosaic GPU: the deployment presets target A100 (sm80) as well as
H100/H200 (sm90). Pallas' Mosaic GPU backend needs sm90+ (TMA, wgmma), while the Triton
backend compiles for both.

The chunks are cut into work items (`work_items`): up to `q_block` consecutive query tokens
of one sequence, packed as `[items, Hkv, q_block * G, D]`. One program per (work item, kv
head) keeps the item's `q_block * G` query rows in registers ([R, D], R padded to a power of
two >= 16 for tl.dot) and loops over the item's key range only, `block_keys` keys at a time:
it gathers the page ids of the block, loads the K and V rows of those pages for its kv head
(masked past the range, so page-table entries beyond it are never dereferenced), and folds
them into an online softmax in float32. Every K/V byte is read once per (item, kv head) for
all the query heads that share it. Triton software-pipelines the loop (`num_stages`).
float32 inputs are multiplied at full precision (IEEE, not TF32). Decode rows go to
`gpu_decode` instead.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import work_items as wi
from pallas_kernels.reference import MASK_VALUE
from pallas_kernels.work_items import WorkItems

MIN_DOT_ROWS = 16  # tl.dot needs M >= 16
MIN_BLOCK_KEYS = 16  # tl.dot needs N, K >= 16
# Shared memory for the pipelined K and V blocks (num_stages copies of each). 64 KiB leaves
# room for the query rows and Triton's scratch on every target: A100 offers 163 KiB per block,
# H100/H200 227 KiB. (head_dim 256 in float32 with 64-key blocks would ask for 320 KiB.)
KV_STAGE_BYTES = 64 << 10
DEFAULT_Q_BLOCK = 16  # query tokens per work item (at most)
# A work item's packed query rows (q_block * G of head_dim) stay within this many bytes: the
# kernel keeps them on chip beside the K/V blocks (A100: 163 KiB of shared memory per block).
QUERY_BLOCK_BYTES = 64 << 10


def default_q_block(group: int, head_dim: int, itemsize: int) -> int:
    """Query tokens per work item: DEFAULT_Q_BLOCK, halved while the item's rows
    (q_block * group of head_dim) exceed QUERY_BLOCK_BYTES."""
    q_block = DEFAULT_Q_BLOCK
    while q_block > 1 and q_block * group * head_dim * itemsize > QUERY_BLOCK_BYTES:
        q_block //= 2
    return q_block


def default_block_keys(page_size: int, head_dim: int, itemsize: int, num_stages: int) -> int:
    """Keys per loop step: max(64, page_size), halved until the K and V blocks of all
    pipeline stages fit `KV_STAGE_BYTES` of shared memory."""
    block_keys = max(64, page_size)
    while (block_keys > MIN_BLOCK_KEYS
           and 2 * num_stages * block_keys * head_dim * itemsize > KV_STAGE_BYTES):
        block_keys //= 2
    return block_keys


def _kernel(seq_ref, pos0_ref, kv_len_ref, key_lo_ref, key_hi_ref, pt_ref, q_ref,
            k_ref, v_ref, o_ref, *, group, page_size, block_keys, sm_scale,
            soft_cap, sliding_window, precision):
    # q_ref, o_ref [R, D]; k_ref, v_ref [num_pages * page_size, Hkv, D]; pt_ref [S, P].
    item, head = pl.program_id(0), pl.program_id(1)
    seq, pos0, kv_len = seq_ref[item], pos0_ref[item], kv_len_ref[item]
    key_lo, key_hi = key_lo_ref[item], key_hi_ref[item]
    q = q_ref[...]  # [R, D]
    rows, head_dim = q.shape
    pages_per_seq = pt_ref.shape[1]
    q_pos = pos0 + jax.lax.div(jnp.arange(rows, dtype=jnp.int32), group)  # [R]
    lanes = jnp.arange(head_dim, dtype=jnp.int32)  # [D]

    def body(block, carry):
        m, l, acc = carry  # [R], [R], [R, D]
        key_pos = block * block_keys + jnp.arange(block_keys, dtype=jnp.int32)  # [KB]
        slot = jax.lax.div(key_pos, page_size)  # [KB]
        in_range = (key_pos < key_hi) & (slot < pages_per_seq)  # [KB]
        page = plgpu.load(pt_ref.at[seq, slot], mask=in_range, other=0)  # [KB]
        kv_row = page * page_size + jax.lax.rem(key_pos, page_size)  # [KB]
        # All-array indices (not a slice on D) so interpret mode can discharge the gather.
        kv_idx = (kv_row[:, None], head, lanes[None, :])
        k = plgpu.load(k_ref.at[kv_idx], mask=in_range[:, None], other=0)  # [KB, D]
        v = plgpu.load(v_ref.at[kv_idx], mask=in_range[:, None], other=0)  # [KB, D]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale  # [R, KB]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = (in_range[None, :] & (key_pos[None, :] <= q_pos[:, None])
                & (key_pos[None, :] < kv_len))  # [R, KB]
        if sliding_window is not None:
            mask &= q_pos[:, None] - key_pos[None, :] < sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))  # [R]
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # [R, KB]
        alpha = jnp.exp(m - m_new)  # [R]
        l = alpha * l + p.sum(axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision,
                                 preferred_element_type=jnp.float32)  # [R, D]
        return m_new, l, alpha[:, None] * acc + pv

    init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(jax.lax.div(key_lo, block_keys),
                                  jax.lax.div(key_hi + block_keys - 1, block_keys), body, init)
    o_ref[...] = (acc / jnp.where(l == 0, 1.0, l)[:, None]).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("group", "sm_scale", "soft_cap", "sliding_window", "block_keys",
                     "num_warps", "num_stages", "interpret"),
)
def items_attention(q, k_pages, v_pages, page_indices, items: WorkItems, *, group, sm_scale,
                    soft_cap=None, sliding_window=None, block_keys=None, num_warps=4,
                    num_stages=2, interpret=False):
    """Attention of packed query rows over paged K/V.

    q [I, Hkv, R, D] (row r = query token r // group); k_pages, v_pages
    [N, page_size, Hkv, D]; page_indices int32 [S, P]; items: WorkItems of [I].
    Returns [I, Hkv, R, D]. block_keys: keys per loop step (default
    `default_block_keys`); must be a power of two.
    """
    num_items, num_kv_heads, rows, head_dim = q.shape
    num_pages, page_size = k_pages.shape[:2]
    if block_keys is None:
        block_keys = default_block_keys(page_size, head_dim, k_pages.dtype.itemsize, num_stages)
    padded_rows = max(MIN_DOT_ROWS, pl.next_power_of_2(rows))
    q = jnp.pad(q, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))  # [I, Hkv, R', D]
    precision = (jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    kernel = functools.partial(
        _kernel, group=group, page_size=page_size, block_keys=block_keys,
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        precision=precision)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    row_spec = pl.BlockSpec((None, None, padded_rows, head_dim), lambda i, h: (i, h, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads),
        in_specs=[any_spec] * 6 + [row_spec, any_spec, any_spec],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="prefill_attention_triton",
    )(*items, page_indices, q,
      k_pages.reshape(num_pages * page_size, num_kv_heads, head_dim),
      v_pages.reshape(num_pages * page_size, num_kv_heads, head_dim))
    return out[:, :, :rows]  # [I, Hkv, R, D]


def attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, chunk_len, *, sm_scale,
              soft_cap=None, sliding_window=None, q_block=None, interpret=False):
    """Attention of the prefill chunks of a flat batch q [T, Hq, D] over paged K/V.

    Sequence s's chunk is the chunk_len[s] tokens from cu_q_lens[s] (0: not here), at
    positions ending at kv_lens[s] - 1. Rows of no chunk come out as zeros. q_block default:
    `default_q_block`. Returns [T, Hq, D].
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    q_block = q_block or default_q_block(group, head_dim, q.dtype.itemsize)
    items, row0, q_len = wi.ragged_items(kv_lens, cu_q_lens, chunk_len, num_tokens, q_block,
                                         sliding_window)
    q_packed, token = wi.pack_queries(q, row0, q_len, num_kv_heads, q_block)
    out = items_attention(q_packed, k_pages, v_pages, page_indices, items, group=group,
                          sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                          interpret=interpret)  # [I, Hkv, q_block * G, D]
    return wi.unpack_outputs(out, token, num_tokens, q_block)  # [T, Hq, D]
