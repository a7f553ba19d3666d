"""The decode kernels' safety contract and cost, against the jnp reference (interpret mode).

- Page-table entries past a sequence's pages hold -1 or ids past the pool; TPU interpret mode
  (`InterpretParams`) raises on any out-of-bounds read and detects DMA races, so reading one
  fails the test. The cache rows past each sequence's kv_len and every page no sequence owns
  hold NaN, so attending to one (on either kernel) shows in the output.
- kv_len 0, 1, exact page multiples and the table's full length; longer is a ValueError.
- Attention sinks (gpt-oss) on some cases: added once, after the last block (and after the
  split-K combine), so a kv_len 0 row still gives zeros.

The reference runs before the kernel it checks: TPU interpret mode (`InterpretParams`) runs
the kernel through host callbacks that dispatch jax ops of their own, and with the test's next
ops dispatched while the kernel was in flight the two were seen to wait on each other for good
on a 2-core machine (the decode sinks case with race detection, 4 runs in 5).
- The same kv_lens with a 32x wider page table cost about the same (work bounded by each
  sequence's keys, not by the table).
"""

import functools
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels as pk
from pallas_kernels import batch_rows, gpu_decode, reference, tpu_prefill

BF16 = ml_dtypes.bfloat16
PAGE = 16


def poisoned_case(make_case, seed, *, hq=8, hkv=2, head_dim=64, dtype=np.float32,
                  pages_per_seq=4, kv_lens=(0, 1, PAGE, 2 * PAGE + 1, 4 * PAGE, 5)):
    """A case whose tables are poisoned past each sequence's pages and whose cache is NaN
    wherever no sequence's keys are. Returns (case, kv_lens, poisoned table, clean table)."""
    kv_lens = np.array(kv_lens, np.int32)
    case = make_case(seed, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                     page_size=PAGE, num_seqs=len(kv_lens), pages_per_seq=pages_per_seq,
                     dtype=dtype)
    num_pages = case.k_pages.shape[0]
    owned = np.zeros((num_pages, PAGE), bool)
    table = case.page_indices.copy()
    for s, kv_len in enumerate(kv_lens):
        pos = np.arange(kv_len)
        owned[table[s, pos // PAGE], pos % PAGE] = True
        used = -(-kv_len // PAGE)
        table[s, used:] = -1 if s % 2 else num_pages + 7
    for pages in (case.k_pages, case.v_pages):
        pages[~owned] = np.nan
    clean = np.where(table < 0, 0, np.minimum(table, num_pages - 1)).astype(np.int32)
    return case, kv_lens, table, clean


def denan(pages):
    """pages with NaN replaced by 0 (np.nan_to_num leaves bfloat16 alone)."""
    return np.where(np.isnan(pages.astype(np.float32)), 0, pages).astype(pages.dtype)


def check(out, want, case):
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, **case.tol)


# (backend, interpret) pairs: the TPU kernel also in TPU interpret mode with race detection.
MODES = [("gpu", True), ("tpu", True), ("tpu", pltpu.InterpretParams(detect_races=True))]


@pytest.mark.parametrize("backend,interpret", MODES, ids=["gpu", "tpu", "tpu-races"])
@pytest.mark.parametrize("hq,hkv,d,dtype,window,sinks", [
    (8, 2, 64, np.float32, None, False), (4, 1, 128, BF16, None, False),
    (8, 4, 64, np.float32, 21, True)])
def test_decode_never_reads_past_its_pages(make_case, backend, interpret, hq, hkv, d, dtype,
                                           window, sinks):
    case, kv_lens, table, clean = poisoned_case(make_case, hq + d, hq=hq, hkv=hkv,
                                                head_dim=d, dtype=dtype)
    q = case.queries(len(kv_lens))
    opts = dict(sliding_window=window, sinks=case.sinks() if sinks else None)
    want = reference.paged_attention(q, denan(case.k_pages),
                                     denan(case.v_pages), kv_lens, clean, **opts)
    out = pk.paged_attention(q, case.k_pages, case.v_pages, kv_lens, table, backend=backend,
                             interpret=interpret, **opts)
    check(out, want, case)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # kv_len 0


@pytest.mark.parametrize("splits,sinks", [(1, True), (2, False), (8, True)])
def test_gpu_split_k_matches_reference(make_case, splits, sinks):
    """Split-K partials merged by the combine pass, with splits shorter than the context and
    splits left empty (more splits than a short sequence's pages). Sinks: in the kernel with
    one split, else in the combine pass, once (not once per split)."""
    case, kv_lens, table, clean = poisoned_case(
        make_case, splits, pages_per_seq=40, kv_lens=(0, 1, 40 * PAGE, 17 * PAGE + 3, 300, 33))
    q = case.queries(len(kv_lens))
    sinks = case.sinks() if sinks else None
    hkv, d = case.num_kv_heads, case.head_dim
    key_lo, key_hi = batch_rows.decode_key_ranges(kv_lens, None)
    out = gpu_decode.attention(q.reshape(len(kv_lens), hkv, -1, d), case.k_pages,
                               case.v_pages, table, key_lo, key_hi, sinks=sinks,
                               sm_scale=d**-0.5, splits=splits, interpret=True)
    want = reference.paged_attention(q, denan(case.k_pages),
                                     denan(case.v_pages), kv_lens, clean, sinks=sinks)
    check(out.reshape(q.shape), want, case)


@pytest.mark.parametrize("backend,interpret", MODES[:2], ids=["gpu", "tpu"])
def test_ragged_decode_rows_never_read_past_their_pages(make_case, backend, interpret):
    """A mixed batch (two chunks, three decode rows, a padding row) over poisoned tables,
    with attention sinks."""
    case, kv_lens, table, clean = poisoned_case(
        make_case, 11, kv_lens=(20, 1, PAGE, 2 * PAGE + 1, 4 * PAGE, 5))
    q_lens = np.array([20, 1, 1, 9, 1, 0])
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = case.queries(40)
    sinks = case.sinks()
    args = (q, case.k_pages, case.v_pages, kv_lens, table, cu_q_lens, np.array([5], np.int32))
    want = reference.ragged_paged_attention(q, denan(case.k_pages),
                                            denan(case.v_pages), kv_lens, clean,
                                            *args[5:], sinks=sinks)
    out = pk.ragged_paged_attention(*args, backend=backend, interpret=interpret, q_block=8,
                                    sinks=sinks)
    check(out, want, case)


def test_prefill_prefetch_across_chunks_and_tiles_reads_only_their_pages(make_case):
    """The TPU prefill kernel fetches the next chunk's first K/V block (the tile's next
    sequence, or the next tile's first on the same core) during a chunk's last block. Short
    chunks, decode rows between them (no keys for the prefill kernel), tiles of 8 tokens
    straddling chunks, an odd tile count (a padding tile), blocks of one page (so chunks
    span several): in TPU interpret mode with race detection over poisoned tables, so a
    prefetch of the wrong pages, a slot or table-row mix-up or a race fails. With attention
    sinks, which each tile adds to its rows' softmax when it writes them."""
    case, kv_lens, table, clean = poisoned_case(
        make_case, 12, kv_lens=(3, 2 * PAGE + 5, 1, PAGE, 9, 1, 4 * PAGE))
    q_lens = np.array([3, 5, 1, 2, 9, 1, 12])  # 33 tokens: 5 tiles of 8, one padding tile
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = case.queries(int(cu_q_lens[-1]))
    num_seqs = np.array([7], np.int32)
    sinks = case.sinks()
    want = reference.ragged_paged_attention(q, denan(case.k_pages), denan(case.v_pages),
                                            kv_lens, clean, cu_q_lens, num_seqs, sinks=sinks)
    rows = batch_rows.split_rows(jnp.asarray(cu_q_lens), jnp.asarray(num_seqs))
    out = tpu_prefill.attention(q, case.k_pages, case.v_pages, kv_lens, table, cu_q_lens,
                                rows.chunk_len, sinks=sinks, sm_scale=64**-0.5, q_block=8,
                                pages_per_block=1,
                                interpret=pltpu.InterpretParams(detect_races=True))
    chunk_rows = np.repeat(q_lens > 1, q_lens)  # [T] rows the prefill kernel answers
    check(np.asarray(out)[chunk_rows], np.asarray(want)[chunk_rows], case)
    assert not np.asarray(out)[~chunk_rows].any()  # decode rows: zeros


def test_kv_len_past_the_table_is_an_error(make_case):
    case = make_case(0, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=PAGE,
                     num_seqs=2, pages_per_seq=2)
    kv_lens = np.array([3, 2 * PAGE + 1], np.int32)
    with pytest.raises(ValueError, match="kv_lens holds 33, more than page_indices covers"):
        pk.paged_attention(case.queries(2), case.k_pages, case.v_pages, kv_lens,
                           case.page_indices)


def best_times(fns, repeats=7):
    """Each fn's shortest call, in seconds, over `repeats` rounds that call them in turn
    (after a warm-up call each), so a slow spell of the machine hits them alike."""
    for fn in fns:
        np.asarray(fn())
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            np.asarray(fn())
            best[i] = min(best[i], time.perf_counter() - start)
    return best


@pytest.mark.parametrize("backend,interpret", MODES[:2], ids=["gpu", "tpu"])
@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_cost_does_not_grow_with_the_table(make_case, kind, backend, interpret):
    """The same kv_lens (and, ragged, the same chunks) with a 32x wider table (32 -> 1024
    pages a sequence, the extra entries poison) take at most 1.5x the time: no grid step,
    copy or loop iteration per table entry. The kernels before these ran ~1000x (TPU) and
    ~2x (GPU) slower here. (Both tables span at least a TPU copy block, 512 keys: a table
    narrower than that shrinks the block, the one thing the width sets.)"""
    kv_lens = ((512, 467, 160, 1, 512, 372, 320, 2, 300, 511, 64, 17, 256, 200, 100, 3)
               if kind == "decode" else (128, 117, 40, 1, 128, 93, 80, 2))
    case, kv_lens, table, _ = poisoned_case(make_case, 5, pages_per_seq=32, kv_lens=kv_lens)
    wide = np.full((table.shape[0], 32 * table.shape[1]), -1, np.int32)
    wide[:, :table.shape[1]] = table
    if kind == "decode":
        q = case.queries(len(kv_lens))
        attend = jax.jit(functools.partial(pk.paged_attention, backend=backend,
                                           interpret=interpret))
        args = (q, case.k_pages, case.v_pages, kv_lens)
        rest = ()
    else:  # two chunks and six decode rows
        q_lens = np.array([30, 1, 1, 1, 20, 1, 1, 1])
        cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        q = case.queries(64)
        attend = jax.jit(functools.partial(pk.ragged_paged_attention, backend=backend,
                                           interpret=interpret, q_block=16))
        args = (q, case.k_pages, case.v_pages, kv_lens)
        rest = (cu_q_lens, np.array([8], np.int32))

    def run(t):
        t = jnp.asarray(t)
        return lambda: attend(*args, t, *rest)

    narrow_s, wide_s = best_times([run(table), run(wide)])
    assert wide_s <= 1.5 * narrow_s, (narrow_s, wide_s)
