"""The block step both TPU kernels share: one copied K/V block folded into every kv head's
online softmax (float32 running max, sum and weighted sum in VMEM scratch).

A copied K/V block is `[pages_per_block, page_size, Hkv * D]`: a page's rows with the kv
heads side by side (`kv_quant`), so head h is the static lane slice `[h * D, (h + 1) * D)`
(for head_dim 64, half of a 128-lane row: sliced in VMEM, with no copy of the pool in HBM).
Where f tokens share a row (`kv_quant.tokens_per_row`: one kv head of 64 per device), a block
is `[pages_per_block, page_size / f, f * Hkv * D]` and head h's page is its f lane slices
`[(h * f + j) * D, (h * f + j + 1) * D)` stacked along sublanes: row r of part j is token
`j * page_size / f + r`, so the stack is the page's keys in order.

Quantized pages arrive as stored: each head's int8 tile is widened to float32, multiplied by
its scales and rounded to q's dtype; an fp8 tile is cast to q's dtype. A copied scale block
is `[pages_per_block, Hkv * S]` (a page's row of the pool, each head's run S >= page_size
floats, `kv_quant`): head h's scales are a static lane slice `[pages_per_block, page_size]`
at `h * S`, transposed (Mosaic transposes
32-bit tiles; it cannot reshape lanes into sublanes) so that page i's become the column
`[page_size, 1]` its tile rows are multiplied by. So the MXU dots see exactly the
values the reference dequantizes to (`kv_quant.dequantize`).

`finish` ends both kernels: the weighted sums over the weights' sums, with attention sinks
(`softmax.normalize`) read as float32 scalars from SMEM. A kv head's block rows are its G
query heads token after token (row r: head r % G), and Mosaic cannot turn a `[G]` lane
vector into that sublane column, so each head's column is assembled from the G scalars
(G selects of an `[R, 1]` column, once per grid step).

`grid_spec` is the grid both kernels run and the scratch they keep: the page table and the
pools stay in HBM and are copied by hand (`tpu_copies`)."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import softmax, tpu_copies
from pallas_kernels.reference import MASK_VALUE


def _tile(buf, scale_buf, slot, h, head_dim, fold, dtype):
    """Head h's keys of block `slot` of buf [2, pages_per_block, page_size / fold, fold * Hkv
    * D] (its lanes [(h * fold + j) * D, (h * fold + j + 1) * D) for the fold parts j,
    stacked) as [KB, D] in dtype, int8 codes times their scales from scale_buf [2,
    pages_per_block, Hkv * S] float32, head h's at lanes [h * S, h * S + page_size) (None: no
    scales, a plain cast)."""
    pages_per_block, rows = buf.shape[1:3]
    page_size = rows * fold
    parts = [buf[slot, :, :, (h * fold + j) * head_dim:(h * fold + j + 1) * head_dim]
             for j in range(fold)]  # fold x [ppb, ps / fold, D]
    tile = parts[0] if fold == 1 else jnp.concatenate(parts, axis=1)  # [ppb, ps, D]
    if scale_buf is None:
        return tile.reshape(pages_per_block * page_size, -1).astype(dtype)  # [KB, D]
    stride = scale_buf.shape[-1] * head_dim * fold // buf.shape[-1]  # S: Hkv * S / Hkv
    columns = scale_buf[slot, :, h * stride:h * stride + page_size].T  # [ps, ppb]
    return jnp.concatenate(
        [tile[i].astype(jnp.float32) * columns[:, i:i + 1] for i in range(pages_per_block)],
        axis=0).astype(dtype)  # [KB, D]


def attend_block(q_ref, k_buf, v_buf, slot, mask, key_valid, m_ref, l_ref, acc_ref, *,
                 sm_scale, soft_cap, k_scale_buf=None, v_scale_buf=None):
    """Folds K/V block `slot` into the running softmax of every kv head.

    q_ref [Hkv, R, D]; k_buf, v_buf [2, pages_per_block, page_size / f, f * Hkv * D] in q's
    dtype, int8 or float8_e4m3fn; k_scale_buf, v_scale_buf [2, pages_per_block, Hkv * S]
    float32 for int8 pages; mask [R or 1, KB] the keys each row sees; key_valid [KB, 1] keys
    in range (V rows outside it are zeroed: stale VMEM may hold anything); m_ref, l_ref
    [Hkv, R, 1], acc_ref [Hkv, R, D] float32.
    """
    num_kv_heads, _, head_dim = q_ref.shape
    fold = k_buf.shape[-1] // (num_kv_heads * head_dim)  # tokens per page row
    for h in range(num_kv_heads):
        k = _tile(k_buf, k_scale_buf, slot, h, head_dim, fold, q_ref.dtype)  # [KB, D]
        v = _tile(v_buf, v_scale_buf, slot, h, head_dim, fold, q_ref.dtype)  # [KB, D]
        v = jnp.where(key_valid, v, jnp.zeros_like(v))
        scores = jax.lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * sm_scale  # [R, KB]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(mask, scores, MASK_VALUE)
        m_prev = m_ref[h]  # [R, 1]
        m_new = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))  # [R, 1]
        p = jnp.where(mask, jnp.exp(scores - m_new), 0.0)  # [R, KB]
        alpha = jnp.exp(m_prev - m_new)  # [R, 1]
        l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
        acc_ref[h] = alpha * acc_ref[h] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32)  # [R, D]
        m_ref[h] = m_new


def finish(o_ref, m_ref, l_ref, acc_ref, sink_ref=None):
    """o_ref [Hkv, R, D] = acc_ref [Hkv, R, D] over l_ref [Hkv, R, 1] (rows that saw no key:
    zeros), plus the sinks of sink_ref (SMEM [Hq] float32, None: none), row r of kv head h
    query head h * G + r % G, relative to the running max m_ref [Hkv, R, 1]."""
    if sink_ref is None:
        o_ref[...] = softmax.normalize(acc_ref[...], None, l_ref[...]).astype(o_ref.dtype)
        return
    num_kv_heads, rows, _ = acc_ref.shape
    group = sink_ref.shape[0] // num_kv_heads
    head = jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)  # [R, 1]
    for h in range(num_kv_heads):
        sink = jnp.full((rows, 1), sink_ref[h * group], jnp.float32)  # [R, 1]
        for g in range(1, group):
            sink = jnp.where(head == g, sink_ref[h * group + g], sink)
        o_ref[h] = softmax.normalize(acc_ref[h], m_ref[h], l_ref[h], sink).astype(o_ref.dtype)


def block_pages(k_pages, k_scales, page_size: int, pages_per_seq: int, buffer_bytes: int
                ) -> int:
    """The pages a copied K/V block holds by default (`tpu_copies.pages_per_block`) for pools
    like `k_pages` (with `k_scales [N, Hkv * S]` for int8 pages, else None)."""
    return tpu_copies.pages_per_block(*k_pages.shape[1:], page_size, k_pages.dtype.itemsize,
                                      pages_per_seq, buffer_bytes,
                                      0 if k_scales is None else k_scales.shape[1])


def grid_spec(q_spec, pools, sink_in, num_scalar_prefetch: int, steps: int, cores: int,
              pages_per_block: int, pages_per_seq: int, state_words: int, acc_shape
              ) -> pltpu.PrefetchScalarGridSpec:
    """The grid `(cores, steps)` of both TPU kernels: after `num_scalar_prefetch` scalar
    arrays, q's blocks (`q_spec`, also the output's), the sinks whole in SMEM (`sink_in`:
    () or one array), then the page table and the `pools` (K, V and for int8 their scales)
    left in HBM. Scratch: two slots of `pages_per_block` pages of each pool and their DMA
    semaphores `[pools, 2]`, two page-table rows `[2, pages_per_seq]` in SMEM and their
    semaphores, `state_words` int32 of the kernel's state, then the online softmax's running
    max and sum `acc_shape[:-1] + (1,)` and weighted sum `acc_shape`, float32."""
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    buffers = [pltpu.VMEM((2, pages_per_block) + pool.shape[1:], pool.dtype)
               for pool in pools]  # [2, pages_per_block, ...] each
    column = tuple(acc_shape[:-1]) + (1,)
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=num_scalar_prefetch,
        grid=(cores, steps),
        in_specs=([q_spec] + [pl.BlockSpec(memory_space=pltpu.SMEM)] * len(sink_in)
                  + [any_spec] * (1 + len(pools))),
        out_specs=q_spec,
        scratch_shapes=[
            *buffers, pltpu.SemaphoreType.DMA((len(pools), 2)),
            pltpu.SMEM((2, pages_per_seq), jnp.int32), pltpu.SemaphoreType.DMA((2,)),
            pltpu.SMEM((state_words,), jnp.int32),
            pltpu.VMEM(column, jnp.float32), pltpu.VMEM(column, jnp.float32),
            pltpu.VMEM(tuple(acc_shape), jnp.float32),
        ],
    )
