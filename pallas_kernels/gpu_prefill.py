"""Pallas GPU (Triton) attention for prefill chunks: query tiles of the flat batch over paged K/V.

Why Triton rather than Mosaic GPU: the deployment presets target A100 (sm80) as well as
H100/H200 (sm90). Pallas' Mosaic GPU backend needs sm90+ (TMA, wgmma), while the Triton
backend compiles for both.

Like `tpu_prefill`, the batch's T tokens are cut into tiles of `q_block` consecutive tokens;
one program per (tile, kv head) holds the tile's `q_block * G` query rows of its kv head
(`TILE_ROWS` = 128 rows by default: 32 tokens of a 4-head group, 128 tokens without GQA,
padded to a power of two for tl.dot) and loops over the sequences whose chunks overlap the
tile, and for each over only the key blocks its rows see, `block_keys` keys at a time: it
gathers the block's page ids, loads the K and V rows of its kv head (masked past the range,
so page-table entries beyond it are never dereferenced), and folds them into an online
softmax in float32 (rows of other sequences masked). No query is copied into per-sequence
blocks. Triton software-pipelines the key loop (`num_stages`). float32 inputs are multiplied
at full precision (IEEE, not TF32). Decode rows go to `gpu_decode` instead.

Quantized pages are read as stored and dequantized in registers (`gpu_dequant`): int8 rows
times their `[block_keys]` scales of the head (loaded with the same row indices and mask),
fp8 rows decoded from their bytes, both rounded to q's dtype before the dots, as the
reference rounds.

Attention sinks reach a program as its tile's `[R']` rows' sinks (`softmax.row_sinks`: row r
is query head r % G of its kv head) and join the softmax when its rows are finished
(`softmax.normalize`).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import batch_rows, gpu_dequant, softmax
from pallas_kernels.reference import MASK_VALUE

MIN_DOT_ROWS = 16  # tl.dot needs M >= 16
MIN_BLOCK_KEYS = 16  # tl.dot needs N, K >= 16
# Shared memory for the pipelined K and V blocks (num_stages copies of each). 64 KiB leaves
# room for the query rows and Triton's scratch on every target: A100 offers 163 KiB per block,
# H100/H200 227 KiB. (head_dim 256 in float32 with 64-key blocks would ask for 320 KiB.)
KV_STAGE_BYTES = 64 << 10
TILE_ROWS = 128  # query rows (tokens x group heads) per program
# A tile's query rows stay within this many bytes: the kernel keeps them on chip beside the
# K/V blocks.
QUERY_BLOCK_BYTES = 64 << 10


def default_q_block(group: int, head_dim: int, itemsize: int) -> int:
    """Query tokens per tile: TILE_ROWS // group, halved while the tile's rows
    (q_block * group of head_dim) exceed QUERY_BLOCK_BYTES."""
    q_block = max(1, TILE_ROWS // group)
    while q_block > 1 and q_block * group * head_dim * itemsize > QUERY_BLOCK_BYTES:
        q_block //= 2
    return q_block


def default_block_keys(page_size: int, head_dim: int, itemsize: int, num_stages: int) -> int:
    """Keys per loop step: max(64, page_size), halved until the K and V blocks of all
    pipeline stages fit `KV_STAGE_BYTES` of shared memory. itemsize: q's, also for quantized
    pages (their 1-byte stages are smaller, but the tiles widened to q's dtype for the dots
    go through shared memory too: float32 q, head_dim 256, 1-byte pages of 64 sized by the
    pages' bytes asked an A100 for 225 KiB)."""
    block_keys = max(64, page_size)
    while (block_keys > MIN_BLOCK_KEYS
           and 2 * num_stages * block_keys * head_dim * itemsize > KV_STAGE_BYTES):
        block_keys //= 2
    return block_keys


def _kernel(kv_lens_ref, cu_ref, chunk_ref, seq_lo_ref, seq_hi_ref, pt_ref, q_ref, k_ref,
            v_ref, *refs, q_block, group, page_size, block_keys, scaled, scale_stride, with_sinks,
            sm_scale, soft_cap, sliding_window, precision):
    # q_ref, o_ref [R', D] (row r: token tile * q_block + r // group, rows past q_block * G
    # padding); k_ref, v_ref [N * page_size, Hkv, D]; pt_ref [S, P]; refs: the scales
    # ks_ref, vs_ref [N * Hkv * S] float32 (int8 pages only, S = scale_stride), the rows'
    # sinks sink_ref [R'] float32 (sinks only), then o_ref.
    ks_ref, vs_ref = refs[:2] if scaled else (None, None)
    sink_ref = refs[-2] if with_sinks else None
    o_ref = refs[-1]
    tile, head = pl.program_id(0), pl.program_id(1)
    q = q_ref[...]  # [R', D]
    rows, head_dim = q.shape
    pages_per_seq = pt_ref.shape[1]
    tile_start = tile * q_block
    row = jnp.arange(rows, dtype=jnp.int32)  # [R']
    row_token = jnp.where(row < q_block * group, tile_start + jax.lax.div(row, group),
                          -1)  # [R'] -1: padding row
    lanes = jnp.arange(head_dim, dtype=jnp.int32)  # [D]

    def attend_sequence(s, carry):
        q_len, first_token, kv_len = chunk_ref[s], cu_ref[s], kv_lens_ref[s]
        a, b, pos_shift, key_lo, key_hi = batch_rows.chunk_in_tile(
            first_token, q_len, kv_len, tile_start, q_block, sliding_window)
        mine = (row_token >= a) & (row_token < b)  # [R']
        q_pos = row_token + pos_shift  # [R']

        def body(block, carry):
            m, l, acc = carry  # [R'], [R'], [R', D]
            key_pos = block * block_keys + jnp.arange(block_keys, dtype=jnp.int32)  # [KB]
            slot = jax.lax.div(key_pos, page_size)  # [KB]
            in_range = (key_pos >= key_lo) & (key_pos < key_hi) & (slot < pages_per_seq)
            page = plgpu.load(pt_ref.at[s, slot], mask=in_range, other=0)  # [KB]
            kv_row = page * page_size + jax.lax.rem(key_pos, page_size)  # [KB]
            # All-array indices (not a slice on D) so interpret mode can discharge the gather.
            kv_idx = (kv_row[:, None], head, lanes[None, :])
            k = plgpu.load(k_ref.at[kv_idx], mask=in_range[:, None], other=0)  # [KB, D]
            v = plgpu.load(v_ref.at[kv_idx], mask=in_range[:, None], other=0)  # [KB, D]
            if scaled:
                # page's row of scales, the head's run in it, the key's offset (`kv_quant`)
                scale_idx = ((page * k_ref.shape[1] + head) * scale_stride
                             + jax.lax.rem(key_pos, page_size))  # [KB]
                k_scale = plgpu.load(ks_ref.at[scale_idx], mask=in_range, other=0)  # [KB]
                v_scale = plgpu.load(vs_ref.at[scale_idx], mask=in_range, other=0)  # [KB]
            else:
                k_scale = v_scale = None
            k = gpu_dequant.dequantize(k, k_scale, q.dtype)  # [KB, D]
            v = gpu_dequant.dequantize(v, v_scale, q.dtype)  # [KB, D]
            scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            mask = (mine[:, None] & in_range[None, :]
                    & (key_pos[None, :] <= q_pos[:, None]))  # [R', KB]
            if sliding_window is not None:
                mask &= q_pos[:, None] - key_pos[None, :] < sliding_window
            scores = jnp.where(mask, scores, MASK_VALUE)  # [R', KB]
            m_new = jnp.maximum(m, scores.max(axis=1))  # [R']
            p = jnp.where(mask, jnp.exp(scores - m_new[:, None]), 0.0)  # [R', KB]
            alpha = jnp.exp(m - m_new)  # [R']
            pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                     precision=precision,
                                     preferred_element_type=jnp.float32)  # [R', D]
            return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + pv

        first = jax.lax.div(key_lo, block_keys)
        last = jnp.where(key_hi > key_lo, jax.lax.div(key_hi + block_keys - 1, block_keys),
                         first)
        return jax.lax.fori_loop(first, last, body, carry)

    init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = jax.lax.fori_loop(seq_lo_ref[tile], seq_hi_ref[tile] + 1, attend_sequence,
                                  init)
    sink = None if sink_ref is None else sink_ref[...][:, None]  # [R', 1]
    o_ref[...] = softmax.normalize(acc, m[:, None], l[:, None], sink).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "q_block", "block_keys",
                     "num_warps", "num_stages", "interpret", "page_size"),
)
def attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, chunk_len, k_scales=None,
              v_scales=None, sinks=None, *, sm_scale, soft_cap=None, sliding_window=None,
              q_block=None, block_keys=None, num_warps=None, num_stages=2, interpret=False,
              page_size=None):
    """Attention of the prefill chunks of a flat batch q [T, Hq, D] over paged K/V
    [N, page_size, Hkv * D] (q's dtype, int8 with k_scales, v_scales [N, Hkv * S]
    float32, or float8_e4m3fn; TPU's folded rows, `kv_quant.tokens_per_row`, are unfolded
    first: a copy).

    Sequence s's chunk is the chunk_len[s] tokens from cu_q_lens[s] (0: not here, e.g. a
    decode row), at positions ending at kv_lens[s] - 1, attending causally (and within
    sliding_window). page_indices int32 [S, P]. sinks [Hq] float: each query head's
    attention sink (None: none). Rows of no chunk come out as zeros.
    q_block default: `default_q_block`; block_keys (a power of two) default:
    `default_block_keys`; num_warps default: 8 when the tile's float32 accumulator has
    128 x 128 elements or more (it spills registers with 4, measured with ptxas), else 4.
    Returns [T, Hq, D].
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages = k_pages.shape[0]
    page_size = page_size or k_pages.shape[1]
    num_kv_heads = k_pages.shape[2] * k_pages.shape[1] // (page_size * head_dim)
    group = num_q_heads // num_kv_heads
    q_block = q_block or default_q_block(group, head_dim, q.dtype.itemsize)
    if block_keys is None:  # sized by q's dtype: quantized tiles are widened to it for the dots
        block_keys = default_block_keys(page_size, head_dim, q.dtype.itemsize, num_stages)
    num_tiles = pl.cdiv(num_tokens, q_block)
    rows = q_block * group
    padded_rows = max(MIN_DOT_ROWS, pl.next_power_of_2(rows))
    if num_warps is None:
        num_warps = 8 if padded_rows * head_dim >= 128 * 128 else 4
    q_tiles = jnp.pad(q, ((0, num_tiles * q_block - num_tokens), (0, 0), (0, 0)))
    q_tiles = q_tiles.reshape(num_tiles, q_block, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, padded_rows - rows),
                                (0, 0)))  # [tiles, Hkv, R', D]
    seq_lo, seq_hi = batch_rows.tile_sequences(cu_q_lens, chunk_len, num_tiles, q_block)
    precision = (jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    scales = () if k_scales is None else tuple(x.reshape(-1) for x in (k_scales, v_scales))
    sink_in = () if sinks is None else (
        softmax.row_sinks(sinks, num_kv_heads, q_block, padded_rows),)  # [Hkv, R']
    kernel = functools.partial(
        _kernel, q_block=q_block, group=group, page_size=page_size, block_keys=block_keys,
        scaled=bool(scales), scale_stride=0 if k_scales is None else
        k_scales.shape[1] // num_kv_heads, with_sinks=bool(sink_in), sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window, precision=precision)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    tile_spec = pl.BlockSpec((None, None, padded_rows, head_dim), lambda t, h: (t, h, 0, 0))
    sink_spec = pl.BlockSpec((None, padded_rows), lambda t, h: (h, 0))
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        in_specs=([any_spec] * 6 + [tile_spec] + [any_spec] * (2 + len(scales))
                  + [sink_spec] * len(sink_in)),
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="prefill_attention_triton",
    )(kv_lens, cu_q_lens, chunk_len, seq_lo, seq_hi, page_indices, q_tiles,
      *(gpu_dequant.as_loaded(x, head_dim, page_size).reshape(num_pages * page_size, num_kv_heads,
                                                    head_dim)
        for x in (k_pages, v_pages)), *scales, *sink_in)  # [tiles, Hkv, R', D]
    out = out[:, :, :rows].reshape(num_tiles, num_kv_heads, q_block, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_tiles * q_block, num_q_heads, head_dim)
    return out[:num_tokens]  # [T, Hq, D]
