"""Pallas GPU (Triton) decode attention: one query token per sequence, split over the context.

Grid (sequence, kv head, split). A program takes the G query heads of its kv head as one
`[G', D]` block (G padded to the 16 rows `tl.dot` needs, not to 16 tokens) and walks the
pages of its part of the sequence's key range a step of pages at a time (below): the
steps' page ids, then the pages' K and V rows of its head (int8 pages: also the pages'
scales of the head; fp8 pages: their bytes), dequantized in registers
to q's dtype (`gpu_dequant`). Work is bounded by the sequence's own keys: pages outside
`[key_lo, key_hi)` are never visited, so page-table entries past a sequence's pages are
never read.

Split-K (flash-decoding): a small batch has too few (sequence, kv head) pairs to fill an
H100/H200's 132 SMs (batch 1 with 8 kv heads: 8 programs), so the key range is cut into
`splits` parts (a power of two) of at least MIN_SPLIT_KEYS keys, each its own program writing
a float32 partial (max, sum, weighted sum). `default_splits` picks the count statically from
batch x kv heads against TARGET_PROGRAMS: one (no combine) when the batch already fills the
card. A second Pallas kernel (`combine`, one launch) merges the partials, one program per
(sequence, query head), and writes only the G real rows (no slice of the padded rows after
it); in interpret mode the same `merge` runs as XLA ops (`combine_in_xla`). Attention sinks
join the softmax once, where the rows are finished (`softmax.normalize`): in the kernel with
one split (each program's `[G']` rows' sinks as a block), else in the combine: a sink given
to every split would be counted once per split.

A program walks its keys a step at a time: one page a step unsplit (as tuned for large
batches), `pages_per_step` pages (KEYS_PER_STEP keys: 4 pages of 16, 2 of 32) a step when
split, their ids in one load and their rows in one gathered load, so a split's few steps
each move more bytes per pair of dependent loads (page ids, then rows).

Launch parameters per step's keys (`LAUNCH`), the reason being the pipelined K/V tiles of
`num_stages` steps in shared memory and the registers of a `[keys, D]` tile:
  16 keys: 4 warps, 4 stages  small tiles, deep pipeline to keep enough bytes in flight;
  32 keys: 4 warps, 3 stages;
  64 keys: 4 warps, 2 stages  (64 x 128 bf16 = 16 KiB per tile, K and V);
  128 keys: 8 warps, 2 stages  more threads for the larger tile.
head_dim 256 halves the stages (at least 1) to keep the tiles within shared memory and
doubles the warps (a [64, 256] float32 tile spilled registers with 4, measured with ptxas).
float32 inputs are multiplied at full precision (`Precision.HIGHEST`: IEEE, not TF32).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_dequant, softmax
from pallas_kernels.reference import MASK_VALUE

KEYS_PER_STEP = 64  # keys a program loads per loop step (several pages of 16 or 32)
MIN_DOT_ROWS = 16  # tl.dot needs M >= 16
TARGET_PROGRAMS = 2 * 132  # two programs per SM of an H100 / H200
MAX_SPLITS = 32
# A split reads >= 4 pages of 16 (>= 32 KiB of bf16 K/V per kv head of 128) for its 8 KiB
# float32 partial: batch 1 at 2,048 keys fills 256 programs (32 splits x 8 kv heads).
MIN_SPLIT_KEYS = 64
LAUNCH = {16: (4, 4), 32: (4, 3), 64: (4, 2), 128: (8, 2)}  # step's keys -> (warps, stages)


def default_splits(batch: int, num_kv_heads: int) -> int:
    """Splits of each sequence's keys: the power of two nearest below what brings batch x kv
    heads x splits to TARGET_PROGRAMS (so at least half of it), at most MAX_SPLITS; 1 when
    batch x kv heads fills the card alone. Not tied to the page table's width: a split past
    a sequence's keys exits at once, and each split spans at least MIN_SPLIT_KEYS keys of
    its sequence."""
    wanted = -(-TARGET_PROGRAMS // (batch * num_kv_heads))
    return min(1 << (wanted.bit_length() - 1), MAX_SPLITS)


def min_split_pages(page_size: int) -> int:
    """The fewest pages a split walks (MIN_SPLIT_KEYS keys, at least one page)."""
    return max(1, MIN_SPLIT_KEYS // page_size)


def pages_per_step(page_size: int) -> int:
    """Pages a split's program loads at once (KEYS_PER_STEP keys): a split walks only a
    few pages, so each step's dependent loads (page ids, then rows) should carry more bytes
    than one page of 16 (an unsplit program, of a large batch, keeps one page a step)."""
    return max(1, KEYS_PER_STEP // page_size)


def launch_parameters(tile_keys: int, head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages) for a step's keys (pages x page size) and head_dim, from
    LAUNCH."""
    warps, stages = LAUNCH[tile_keys]
    if head_dim > 128:
        warps, stages = min(2 * warps, 8), max(1, stages // 2)
    return warps, stages


def split_pages(key_lo, key_hi, split, splits, page_size, min_split_pages):
    """Pages [lo, hi) (int32 scalars) that split `split` of `splits` walks for a query seeing
    keys [key_lo, key_hi): the range's pages cut into equal runs of at least min_split_pages,
    the last run shorter, splits past the range empty (lo = hi)."""
    first = jax.lax.div(key_lo, page_size)
    last = jnp.where(key_hi > key_lo, jax.lax.div(key_hi + page_size - 1, page_size), first)
    per_split = jnp.maximum(jax.lax.div(last - first + splits - 1, splits), min_split_pages)
    lo = jnp.minimum(first + split * per_split, last)
    return lo, jnp.minimum(lo + per_split, last)


def _kernel(key_lo_ref, key_hi_ref, pt_ref, q_ref, k_ref, v_ref, *refs, page_size, splits,
            min_split_pages, per_step, scaled, with_sinks, sm_scale, soft_cap, precision):
    # q_ref [G', D]; k_ref, v_ref [N, page_size, Hkv, D]; pt_ref [B, P]. refs: the scales
    # ks_ref, vs_ref [N, Hkv * S] float32 (int8 pages only), the rows' sinks sink_ref [G']
    # float32 (sinks only, with splits 1), then the outputs: o [G', D] (splits 1), or the
    # partials acc [G', D], m [G'], l [G'] (float32).
    ks_ref, vs_ref = refs[:2] if scaled else (None, None)
    refs = refs[2:] if scaled else refs
    sink_ref, out_refs = (refs[0], refs[1:]) if with_sinks else (None, refs)
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    key_lo, key_hi = key_lo_ref[seq], key_hi_ref[seq]
    q = q_ref[...]  # [G', D]
    rows, head_dim = q.shape
    lo_page, hi_page = split_pages(key_lo, key_hi, split, splits, page_size, min_split_pages)
    step_pages = jnp.arange(per_step, dtype=jnp.int32)  # [P]
    offsets = jnp.arange(per_step * page_size, dtype=jnp.int32)  # [P * ps]
    stride = ks_ref.shape[1] // k_ref.shape[2] if scaled else 0  # S: a head's scale run

    def page_ids(first):
        if per_step == 1:  # one page a step: its id as a scalar (a plain load, no gather)
            return pt_ref[seq, first]
        live = first + step_pages < hi_page  # [P]
        # one load; ids past the split's run are not read (page 0 instead, its keys masked)
        return plgpu.load(pt_ref.at[seq, pl.ds(first, per_step)], mask=live, other=0)  # [P]

    def gather(ref, pages, cols):  # the pages' rows of this head: [P * ps, ...]
        tile = ref[pages, cols] if cols is not None else ref[pages, :, head, :]
        return tile if per_step == 1 else tile.reshape(per_step * page_size, *tile.shape[2:])

    def body(step, carry):
        m, l, acc = carry  # [G'], [G'], [G', D]
        first = lo_page + step * per_step
        pages = page_ids(first)  # [P], or a scalar
        scale_cols = pl.ds(head * stride, page_size)  # the head's run in the page's row
        k_scale = gather(ks_ref, pages, scale_cols) if scaled else None  # [P * ps]
        v_scale = gather(vs_ref, pages, scale_cols) if scaled else None  # [P * ps]
        k = gpu_dequant.dequantize(gather(k_ref, pages, None), k_scale, q.dtype)  # [P*ps, D]
        v = gpu_dequant.dequantize(gather(v_ref, pages, None), v_scale, q.dtype)  # [P*ps, D]
        key_pos = first * page_size + offsets  # [P * ps]
        seen = (key_pos >= key_lo) & (key_pos < jnp.minimum(key_hi, hi_page * page_size))
        v = jnp.where(seen[:, None], v, jnp.zeros_like(v))  # rows past kv_len may hold anything
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale  # [G', P*ps]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(seen[None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))  # [G']
        p = jnp.where(seen[None, :], jnp.exp(s - m_new[:, None]), 0.0)  # [G', P*ps]
        alpha = jnp.exp(m - m_new)  # [G']
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision,
                                 preferred_element_type=jnp.float32)  # [G', D]
        return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + pv

    init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    steps = jax.lax.div(hi_page - lo_page + per_step - 1, per_step)
    m, l, acc = jax.lax.fori_loop(0, steps, body, init)
    if splits == 1:
        (o_ref,) = out_refs
        sink = None if sink_ref is None else sink_ref[...][:, None]  # [G', 1]
        o_ref[...] = softmax.normalize(acc, m[:, None], l[:, None], sink).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...], m_ref[...], l_ref[...] = acc, m, l


def merge(m, l, acc, sink=None):
    """The softmax of S split partials, merged: m, l [..., S] (running max, sum of weights),
    acc [..., S, D] (weighted sums), float32; sink [...] float32 (None: none) -> [..., D]
    float32. Each partial is rescaled from its own max to the largest (a split that saw no
    key has l 0 and adds nothing unless all are empty: zeros out)."""
    m_max = m.max(axis=-1)  # [...]
    weight = jnp.exp(m - m_max[..., None])  # [..., S]
    total = (weight * l).sum(axis=-1)  # [...]
    out = (weight[..., None] * acc).sum(axis=-2)  # [..., D]
    return softmax.normalize(out, m_max[..., None], total[..., None],
                             None if sink is None else sink[..., None])


def _combine_kernel(m_ref, l_ref, acc_ref, *refs, with_sinks):
    # One query head's row: m_ref, l_ref [S], acc_ref [S, D] float32 (its S partials);
    # refs: the sinks sink_ref [Hkv, G'] float32 (with sinks only), then o_ref [D].
    sink_ref, o_ref = refs if with_sinks else (None, refs[0])
    sink = sink_ref[pl.program_id(1), pl.program_id(2)] if with_sinks else None
    o_ref[...] = merge(m_ref[...], l_ref[...], acc_ref[...], sink).astype(o_ref.dtype)


def combine(acc, m, l, sinks, group, dtype, interpret=False):
    """Merges split partials acc [B, Hkv, S, G', D], m and l [B, Hkv, S, G'] float32 into
    [B, Hkv, G, D] of dtype, with the rows' sinks [Hkv, G'] float32 (None: none): one
    Pallas launch, a program per (sequence, kv head, real row), each merging its row's S
    partials (`merge`)."""
    batch, num_kv_heads, splits, _, head_dim = acc.shape
    row = lambda b, h, g: (b, h, 0, g)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_combine_kernel, with_sinks=sinks is not None),
        grid=(batch, num_kv_heads, group),
        in_specs=[pl.BlockSpec((None, None, splits, None), row),
                  pl.BlockSpec((None, None, splits, None), row),
                  pl.BlockSpec((None, None, splits, None, head_dim),
                               lambda b, h, g: (b, h, 0, g, 0))]
        + [pl.BlockSpec(memory_space=pl.ANY)] * (sinks is not None),
        out_specs=pl.BlockSpec((None, None, None, head_dim), lambda b, h, g: (b, h, g, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, group, head_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="decode_combine_triton",
    )(m, l, acc, *(() if sinks is None else (sinks,)))


def combine_in_xla(acc, m, l, sinks, group, dtype):
    """`combine` as XLA ops on the whole arrays (the same `merge`), for interpret mode: it
    runs a grid as a loop of sliced steps, which for the combine's B x Hkv x G programs cost
    2-3x the whole decode call on CPU and about 0.7 s more compile per program."""
    rows = lambda x: jnp.swapaxes(x, 2, 3)[:, :, :group]  # noqa: E731  [B, Hkv, G, S, ...]
    sink = None if sinks is None else sinks[None, :, :group]  # [1, Hkv, G]
    return merge(rows(m), rows(l), rows(acc), sink).astype(dtype)  # [B, Hkv, G, D]


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "splits", "interpret",
                                             "page_size"))
def attention(q, k_pages, v_pages, page_indices, key_lo, key_hi, k_scales=None,
              v_scales=None, sinks=None, *, sm_scale, soft_cap=None, splits=None, interpret=False,
              page_size=None):
    """Decode attention of q [B, Hkv, G, D] over paged K/V [N, page_size, Hkv * D] (q's
    dtype, int8 with k_scales, v_scales [N, Hkv * S] float32, or float8_e4m3fn;
    TPU's folded rows, `kv_quant.tokens_per_row`, are unfolded first: a copy).

    Sequence b's query sees keys [key_lo[b], key_hi[b]) (int32 [B] each: causality and any
    sliding window are already in the range; key_hi <= key_lo: none, zeros out);
    page_indices int32 [B, P], entries past a sequence's pages never read. key_hi must be
    <= P * page_size (the caller clamps). sinks [Hkv * G] float: each query head's attention
    sink (None: none). splits: a power of two (the combine's block), default
    `default_splits`. Returns [B, Hkv, G, D].
    """
    batch, num_kv_heads, group, head_dim = q.shape
    page_size = page_size or k_pages.shape[1]
    if splits is None:
        splits = default_splits(batch, num_kv_heads)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two (the combine's block), got {splits}")
    rows = max(MIN_DOT_ROWS, pl.next_power_of_2(group))
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [B, Hkv, G', D]
    per_step = pages_per_step(page_size) if splits > 1 else 1  # unsplit: as tuned before
    num_warps, num_stages = launch_parameters(per_step * page_size, head_dim)
    precision = (jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    scales = () if k_scales is None else (k_scales, v_scales)
    row_sinks = None if sinks is None else softmax.row_sinks(sinks, num_kv_heads, 1,
                                                             rows)  # [Hkv, G']
    sink_in = (row_sinks,) if row_sinks is not None and splits == 1 else ()
    kernel = functools.partial(
        _kernel, page_size=page_size, splits=splits,
        min_split_pages=min_split_pages(page_size) if splits > 1 else 1,
        per_step=per_step,
        scaled=bool(scales), with_sinks=bool(sink_in), sm_scale=sm_scale, soft_cap=soft_cap,
        precision=precision)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))
    sink_spec = pl.BlockSpec((None, rows), lambda b, h, s: (h, 0))
    if splits == 1:
        out_specs = q_spec
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        part = (batch, num_kv_heads, splits, rows)
        out_specs = [
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0))]
        out_shape = [jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, splits),
        in_specs=([any_spec] * 3 + [q_spec] + [any_spec] * (2 + len(scales))
                  + [sink_spec] * len(sink_in)),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention_triton",
    )(key_lo, key_hi, page_indices, q, gpu_dequant.as_loaded(k_pages, head_dim, page_size),
      gpu_dequant.as_loaded(v_pages, head_dim, page_size), *scales, *sink_in)
    if splits > 1:
        merge_splits = combine_in_xla if interpret else combine
        return merge_splits(*out, row_sinks, group, q.dtype)  # [B, Hkv, G, D]
    return out[:, :, :group]  # [B, Hkv, G, D]
