"""Kernels (TPU and GPU, Pallas interpret mode on CPU) against the jnp reference."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pallas_kernels as pk
from pallas_kernels import reference

BF16 = ml_dtypes.bfloat16
KERNELS = ["tpu", "gpu"]

# (num_q_heads, num_kv_heads, head_dim, page_size, dtype, soft_cap, sliding_window, sinks)
DECODE_GRID = [
    (8, 2, 128, 16, np.float32, None, None, False),  # GQA
    (4, 4, 64, 32, BF16, None, None, False),  # MHA, bf16
    (8, 1, 256, 64, np.float32, None, None, False),  # MQA, head_dim 256
    (6, 2, 128, 128, BF16, None, None, True),  # group of 3, largest page; attention sinks
    (8, 2, 64, 16, np.float32, 4.0, 21, True),  # soft-cap + sliding window + sinks
]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("hq,hkv,d,ps,dtype,soft_cap,window,sinks", DECODE_GRID)
def test_decode_matches_reference(make_case, backend, hq, hkv, d, ps, dtype, soft_cap, window,
                                  sinks):
    pages_per_seq = 3
    case = make_case(hq + d + ps, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                     num_seqs=6, pages_per_seq=pages_per_seq, dtype=dtype)
    # 0, 1, an exact page, two pages + 1, the longest that fits; the last row's table
    # is longer than needed (only its first page is used).
    kv_lens = np.array([0, 1, ps, 2 * ps + 1, pages_per_seq * ps, 5], np.int32)
    q = case.queries(6)
    args = (q, case.k_pages, case.v_pages, kv_lens, case.page_indices)
    opts = dict(soft_cap=soft_cap, sliding_window=window,
                sinks=case.sinks() if sinks else None)
    out = pk.paged_attention(*args, backend=backend, interpret=True, **opts)
    want = reference.paged_attention(*args, **opts)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               **case.tol)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # kv_len 0


def test_default_dispatch_runs_interpret_on_cpu(make_case):
    case = make_case(3, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                     num_seqs=2, pages_per_seq=2)
    args = (case.queries(2), case.k_pages, case.v_pages, np.array([3, 20], np.int32),
            case.page_indices)
    np.testing.assert_allclose(np.asarray(pk.paged_attention(*args)),
                               np.asarray(reference.paged_attention(*args)), **case.tol)


def ragged_args(case, q_lens, kv_extra, num_tokens, num_live):
    """Builds ragged inputs: sequence s has q_lens[s] new tokens after kv_extra[s] old ones."""
    kv_lens = (np.asarray(q_lens) + np.asarray(kv_extra)).astype(np.int32)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = case.queries(num_tokens)
    return (q, case.k_pages, case.v_pages, kv_lens, case.page_indices, cu_q_lens,
            np.array([num_live], np.int32))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype,window,sinks", [(np.float32, None, True), (BF16, 10, False)])
def test_ragged_matches_reference(make_case, backend, dtype, window, sinks):
    case = make_case(4, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                     num_seqs=5, pages_per_seq=4, dtype=dtype)
    # prefill chunk spanning q blocks, decode token, chunk after a prefix,
    # empty query, padding sequence; 4 padding tokens at the end.
    args = ragged_args(case, q_lens=[19, 1, 6, 0, 3], kv_extra=[0, 40, 27, 5, 2],
                       num_tokens=33, num_live=4)
    opts = dict(sliding_window=window, soft_cap=None if window else 3.0,
                sinks=case.sinks() if sinks else None)
    out = pk.ragged_paged_attention(*args, backend=backend, interpret=True, q_block=8, **opts)
    want = reference.ragged_paged_attention(*args, **opts)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               **case.tol)
    np.testing.assert_array_equal(np.asarray(out[26:], np.float32), 0.0)  # padding rows


@st.composite
def ragged_batches(draw, max_seqs=4, pages_per_seq=4, page_size=16, num_tokens=24):
    """Random live sequences whose new tokens fit in num_tokens and whose kv fits the table."""
    num_live = draw(st.integers(1, max_seqs))
    q_lens, budget = [], num_tokens
    for _ in range(num_live):
        q_lens.append(draw(st.integers(0, min(budget, 12))))
        budget -= q_lens[-1]
    q_lens += [0] * (max_seqs - num_live)
    max_kv = pages_per_seq * page_size
    kv_extra = [draw(st.integers(0, max_kv - n)) for n in q_lens]
    return q_lens, kv_extra, num_live


@pytest.mark.parametrize("backend", KERNELS)
# make_case only returns a class, so sharing it across examples is safe.
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=ragged_batches(), window=st.sampled_from([None, 9]))
def test_ragged_random_batches(make_case, backend, batch, window):
    q_lens, kv_extra, num_live = batch
    case = make_case(sum(q_lens) + sum(kv_extra), num_q_heads=4, num_kv_heads=1, head_dim=64,
                     page_size=16, num_seqs=4, pages_per_seq=4)
    args = ragged_args(case, q_lens, kv_extra, num_tokens=24, num_live=num_live)
    out = pk.ragged_paged_attention(*args, backend=backend, interpret=True, q_block=8,
                                    sliding_window=window)
    want = reference.ragged_paged_attention(*args, sliding_window=window)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **case.tol)
