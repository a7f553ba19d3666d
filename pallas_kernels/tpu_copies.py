"""The TPU kernels' manual copies: page-table rows into SMEM, K/V page blocks into VMEM.

Page-table rows: copied from HBM into SMEM, only the part in use.
A whole table does not fit SMEM (1 MiB: 256 sequences x 2048 pages is 2 MiB), so the kernels
keep it in HBM and copy a sequence's entries for pages [first, last) before using them, in
chunks of ROW_CHUNK entries: the copied bytes follow the sequence's length, not the table's
width. The entries land at their own offsets in the SMEM row, so `row[page_slot]` reads them.
Mosaic slices an HBM row only at offsets of whole 512-byte words (128 int32), so a table
whose width is not a multiple of ROW_CHUNK is copied a whole row at a time.

K/V blocks: one copy per page and per K/V, issued by a loop over exactly the block's pages in
use (a loop, not one unrolled copy per possible page: the program stays small), each
[page_size / f, f * Hkv * D] contiguous in HBM (`kv_quant.page_shape`). int8 pages add one
copy per page of each scale pool
(the page's row `[Hkv * S]` float32, `kv_quant`): four copies per page instead of
two.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

ROW_CHUNK = 128  # table entries per copy (512 bytes)
TARGET_BLOCK_KEYS = 512  # keys per copy block: large copies amortise the DMA issue cost
LANES = 128  # a VMEM row: a page's float32 scale row is padded to whole 128 lanes
SUBLANES = 8  # a VMEM tile's rows of 32-bit values (16 of bf16, 32 of int8 and fp8)


def pages_per_block(page_rows, row_width, page_size, itemsize, pages_per_seq, buffer_bytes,
                    scale_row=0):
    """Pages per copy block: TARGET_BLOCK_KEYS keys, fewer if K and V's two slots (with
    their pages' rows of `scale_row` float32 scales, int8 pages) would exceed buffer_bytes of
    VMEM, never more than a sequence's table holds. A page is stored `[page_rows,
    row_width]` (`kv_quant.page_shape`) and takes whole (sublanes, 128)-tiles of VMEM;
    itemsize: the pages' (1 for int8 and fp8)."""
    sublanes = SUBLANES * max(1, 4 // itemsize)
    page_bytes = (pl.cdiv(page_rows, sublanes) * sublanes * pl.cdiv(row_width, LANES) * LANES
                  * itemsize)
    page_bytes += 4 * LANES * pl.cdiv(scale_row, LANES)
    by_memory = buffer_bytes // (4 * page_bytes)
    return max(1, min(pages_per_seq, TARGET_BLOCK_KEYS // page_size, by_memory))


def row_copies(table_hbm, seq, row_ref, sem, first, last, start: bool):
    """Starts (start=True) or waits for the copies of table_hbm[seq, first:last] into the same
    entries of row_ref [P] (SMEM), one per chunk; nothing when last <= first. A start and its
    wait must be given the same (seq, first, last)."""
    pages_per_seq = table_hbm.shape[1]

    def act(copy):
        if start:
            copy.start()
        else:
            copy.wait()

    if pages_per_seq % ROW_CHUNK:
        @pl.when(last > first)
        def _whole_row():
            act(pltpu.make_async_copy(table_hbm.at[seq], row_ref, sem))
        return
    lo = jax.lax.div(first, ROW_CHUNK)
    hi = jnp.where(last > first, jax.lax.div(last + ROW_CHUNK - 1, ROW_CHUNK), lo)

    def body(c, carry):
        offset = pl.multiple_of(c * ROW_CHUNK, ROW_CHUNK)
        act(pltpu.make_async_copy(table_hbm.at[seq, pl.ds(offset, ROW_CHUNK)],
                                  row_ref.at[pl.ds(offset, ROW_CHUNK)], sem))
        return carry

    jax.lax.fori_loop(lo, hi, body, 0)


def block_copies(row_ref, pools, buffers, sems, slot, page0, num_pages, start: bool):
    """Starts or waits for the copies of pages row_ref[page0 : page0 + num_pages] of each
    pool in HBM (K, V [N, page_size, Hkv * D], then the int8 pages' K and V scales
    [N, Hkv * S]) into the same-index buffer's [slot] [pages_per_block, ...]
    (semaphores sems[pool, slot]). A start and its wait must get the same pages."""

    def body(p, carry):
        page = row_ref[page0 + p]
        for i, (hbm, buf) in enumerate(zip(pools, buffers)):
            copy = pltpu.make_async_copy(hbm.at[page], buf.at[slot, p], sems.at[i, slot])
            if start:
                copy.start()
            else:
                copy.wait()
        return carry

    jax.lax.fori_loop(0, num_pages, body, 0)
