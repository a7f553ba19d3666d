"""Checks the jnp oracle itself against dense numpy attention on gathered pages."""

import numpy as np
import pytest

from pallas_kernels import reference

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`


def dense_attention(q, k, v, q_pos, kv_len, sm_scale, soft_cap=None, window=None,
                    sinks=None):
    """One query [Hq, D] against contiguous k, v [L, Hkv, D]; plain numpy float64. sinks [Hq]
    (gpt-oss, as transformers computes them): head h's softmax over its visible keys' scores
    and sinks[h], the sink's share then dropped."""
    num_q_heads = q.shape[0]
    group = num_q_heads // k.shape[1]
    keys = [j for j in range(kv_len) if j <= q_pos and (window is None or q_pos - j < window)]
    out = np.zeros(q.shape)
    if not keys:
        return out
    for h in range(num_q_heads):
        kh, vh = k[keys, h // group].astype(np.float64), v[keys, h // group].astype(np.float64)
        logits = kh @ q[h].astype(np.float64) * sm_scale  # [len(keys)]
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        if sinks is not None:
            logits = np.append(logits, np.float64(sinks[h]))  # [len(keys) + 1]
        w = np.exp(logits - logits.max())
        out[h] = (w / w.sum())[:len(keys)] @ vh
    return out


def contiguous(pages, table_row, head_dim):
    """pages [N, page_size, Hkv * D], table_row [P] -> [P * page_size, Hkv, D]."""
    keys = np.concatenate([pages[p] for p in table_row], axis=0)  # [P * page_size, Hkv * D]
    return keys.reshape(keys.shape[0], -1, head_dim)


@pytest.mark.parametrize("soft_cap,window", [(None, None), (5.0, 3)])
def test_decode_reference_matches_dense(make_case, soft_cap, window):
    case = make_case(0, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                     num_seqs=4, pages_per_seq=3)
    kv_lens = np.array([0, 1, 16, 45], np.int32)
    q = case.queries(4)
    out = reference.paged_attention(q, case.k_pages, case.v_pages, kv_lens, case.page_indices,
                                    soft_cap=soft_cap, sliding_window=window)
    for b in range(4):
        k = contiguous(case.k_pages, case.page_indices[b], 64)
        v = contiguous(case.v_pages, case.page_indices[b], 64)
        want = dense_attention(q[b], k, v, kv_lens[b] - 1, kv_lens[b], 64**-0.5, soft_cap, window)
        np.testing.assert_allclose(np.asarray(out[b]), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_ragged_reference_matches_dense(make_case, with_sinks):
    case = make_case(1, num_q_heads=6, num_kv_heads=3, head_dim=64, page_size=16,
                     num_seqs=4, pages_per_seq=3)
    q_lens, kv_lens = [5, 1, 0, 7], np.array([20, 33, 9, 7], np.int32)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_seqs = np.array([3], np.int32)  # the 4th sequence is padding
    q = case.queries(16)
    sinks = case.sinks() if with_sinks else None
    out = np.asarray(reference.ragged_paged_attention(
        q, case.k_pages, case.v_pages, kv_lens, case.page_indices, cu_q_lens, num_seqs,
        sm_scale=0.1, sinks=sinks))
    for s in range(3):
        k = contiguous(case.k_pages, case.page_indices[s], 64)
        v = contiguous(case.v_pages, case.page_indices[s], 64)
        for i in range(q_lens[s]):
            t = cu_q_lens[s] + i
            pos = kv_lens[s] - q_lens[s] + i
            want = dense_attention(q[t], k, v, pos, kv_lens[s], 0.1, sinks=sinks)
            np.testing.assert_allclose(out[t], want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[cu_q_lens[3]:], 0.0)


@pytest.mark.parametrize("soft_cap,window", [(None, None), (2.0, 20)])
def test_decode_reference_with_sinks_matches_dense(make_case, soft_cap, window):
    """Sinks of 4 query heads per kv head, around the largest scores (they take much of each
    row's weight), one of 30 (its head's outputs vanish) and one of -inf (no sink): against
    the numpy transcription, and kv_len 0 still gives zeros."""
    case = make_case(3, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                     num_seqs=4, pages_per_seq=3)
    kv_lens = np.array([0, 1, 17, 45], np.int32)
    q = case.queries(4)
    sinks = case.sinks()
    sinks[0] = -np.inf
    args = (q, case.k_pages, case.v_pages, kv_lens, case.page_indices)
    opts = dict(soft_cap=soft_cap, sliding_window=window)
    out = np.asarray(reference.paged_attention(*args, sinks=sinks, **opts))
    for b in range(4):
        k = contiguous(case.k_pages, case.page_indices[b], 64)
        v = contiguous(case.v_pages, case.page_indices[b], 64)
        want = dense_attention(q[b], k, v, kv_lens[b] - 1, kv_lens[b], 64**-0.5, soft_cap,
                               window, sinks)
        np.testing.assert_allclose(out[b], want, atol=1e-5, rtol=1e-5)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0], 0.0)  # kv_len 0
    assert np.abs(out[:, -1]).max() < 1e-9  # the sink of 30 takes (nearly) all the weight
    without = np.asarray(reference.paged_attention(*args, **opts))
    np.testing.assert_array_equal(out[:, 0], without[:, 0])  # a sink of -inf is none
    # a sink only adds to the denominator: it scales a row, by its keys' share of the weight
    kept = np.linalg.norm(out[1:], axis=-1) / np.linalg.norm(without[1:], axis=-1)  # [3, Hq]
    assert kept.max() <= 1 + 1e-6 and np.median(kept[:, 1:-1]) < 0.8, kept


def test_write_kv_reference(make_case):
    case = make_case(2, num_q_heads=2, num_kv_heads=2, head_dim=64, page_size=16,
                     num_seqs=2, pages_per_seq=2)
    k_new = case.rng.standard_normal((3, 2, 64)).astype(np.float32)
    v_new = case.rng.standard_normal((3, 2, 64)).astype(np.float32)
    slots = np.array([16 * 3 + 5, -1, 7], np.int32)
    k, v = reference.write_kv(case.k_pages, case.v_pages, k_new, v_new, slots)
    want_k, want_v = case.k_pages.copy(), case.v_pages.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot // 16, slot % 16] = k_new[t].reshape(-1)  # heads side by side
            want_v[slot // 16, slot % 16] = v_new[t].reshape(-1)
    np.testing.assert_array_equal(np.asarray(k), want_k)
    np.testing.assert_array_equal(np.asarray(v), want_v)
