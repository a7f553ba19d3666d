"""shard_map over kv heads, the KV write op (with donation), and argument validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import reference


def test_shard_map_over_kv_heads_matches_unsharded(make_case):
    assert len(jax.devices()) == 8, "tests/pallas_kernels/conftest.py sets 8 host devices"
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("model",))
    case = make_case(5, num_q_heads=16, num_kv_heads=8, head_dim=64, page_size=16,
                     num_seqs=3, pages_per_seq=2)
    q_lens, kv_lens = [5, 1, 2], np.array([5, 30, 18], np.int32)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (case.queries(10), case.k_pages, case.v_pages, kv_lens, case.page_indices,
            cu_q_lens, np.array([3], np.int32))
    heads, cache, rep = P(None, "model", None), P(None, None, "model"), P()  # whole heads

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(heads, cache, cache, rep, rep, rep, rep),
                       out_specs=heads, check_vma=False)
    def sharded(*a):
        return pk.ragged_paged_attention(*a, q_block=4)

    out = sharded(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(pk.ragged_paged_attention(*args)),
                               **case.tol)
    np.testing.assert_allclose(np.asarray(out),
                               np.asarray(reference.ragged_paged_attention(*args)), **case.tol)


def test_write_kv_donated_in_place(make_case):
    case = make_case(6, num_q_heads=2, num_kv_heads=2, head_dim=64, page_size=16,
                     num_seqs=2, pages_per_seq=2)
    k_new = case.rng.standard_normal((4, 2, 64)).astype(np.float32)  # [T, Hkv, D]
    v_new = case.rng.standard_normal((4, 2, 64)).astype(np.float32)  # [T, Hkv, D]
    slots = np.array([3 * 16 + 15, -1, 16, 5], np.int32)  # one padding token
    want = reference.write_kv(case.k_pages, case.v_pages, k_new, v_new, slots)
    k_pages, v_pages = jnp.asarray(case.k_pages), jnp.asarray(case.v_pages)
    step = jax.jit(pk.write_kv, donate_argnums=(0, 1))
    k_out, v_out = step(k_pages, v_pages, k_new, v_new, slots)
    assert k_pages.is_deleted() and v_pages.is_deleted()  # buffers were donated
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(k_out)[2], case.k_pages[2])  # untouched page


def good_args(hq=4, hkv=2, d=64, ps=16, dtype=jnp.float32):
    q = jnp.zeros((2, hq, d), dtype)
    kv = jnp.zeros((8, ps, hkv * d), dtype)
    return [q, kv, kv, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 3), jnp.int32)]


@pytest.mark.parametrize("change,message", [
    (lambda a: good_args(hq=12, hkv=5),
     r"num_q_heads \(12\) must be a multiple of num_kv_heads \(5\)"),
    (lambda a: good_args(d=96), "head_dim 96 not supported"),
    (lambda a: [a[0][..., :48]] + a[1:], "not 1 token.s. of whole heads of q's head_dim 48"),
    (lambda a: good_args(ps=8), "page_size 8 not supported"),
    (lambda a: good_args(dtype=jnp.float16), "q dtype float16 not supported"),
    (lambda a: a[:4] + [a[4].astype(jnp.int64 if jax.config.x64_enabled else jnp.uint32)],
     "page_indices must be int32"),
    (lambda a: a[:3] + [a[3].astype(jnp.float32), a[4]], "kv_lens must be int32"),
    (lambda a: [a[0], a[1], a[2].astype(jnp.bfloat16)] + a[3:], "v_pages dtype"),
])
def test_invalid_arguments_raise(change, message):
    with pytest.raises(ValueError, match=message):
        pk.paged_attention(*change(good_args()))


def test_a_page_size_that_is_not_whole_rows_raises():
    """page_size says how many tokens a page holds; its rows must hold a whole number each
    (`kv_quant.tokens_per_row`)."""
    q, kv, _, kv_lens, table = good_args()
    with pytest.raises(ValueError, match="page_size 24 is not a whole number of k_pages' 16"):
        pk.paged_attention(q, kv, kv, kv_lens, table, page_size=24)
    with pytest.raises(ValueError, match="not 2 token.s. of whole heads"):
        pk.paged_attention(q, kv[:, :8, :64], kv[:, :8, :64], kv_lens, table, page_size=16)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_sinks_must_be_one_float_per_query_head(backend):
    """sinks: one float per query head of q (4 here); per kv head, per token or of integers is a
    ValueError naming sinks, from the kernels and the reference alike."""
    q, kv, _, kv_lens, table = good_args()
    ragged = (jnp.array([0, 1, 2], jnp.int32), jnp.array([2], jnp.int32))
    for sinks in (jnp.zeros((2,), jnp.float32), jnp.zeros((4, 1), jnp.float32),
                  jnp.zeros((4,), jnp.int32)):
        with pytest.raises(ValueError, match=r"sinks must be a float array \[num_q_heads\]"):
            pk.paged_attention(q, kv, kv, kv_lens, table, sinks=sinks, backend=backend)
        with pytest.raises(ValueError, match=r"sinks must be a float array \[num_q_heads\]"):
            pk.ragged_paged_attention(q, kv, kv, kv_lens, table, *ragged, sinks=sinks,
                                      backend=backend)
    out = jax.eval_shape(functools.partial(pk.paged_attention, sinks=jnp.zeros(4, jnp.bfloat16),
                                           backend=backend), q, kv, kv, kv_lens, table)
    assert out.shape == q.shape  # any float dtype (taken as float32)


def test_invalid_ragged_and_options_raise():
    q, kv, _, kv_lens, table = good_args()
    with pytest.raises(ValueError, match="cu_q_lens must have"):
        pk.ragged_paged_attention(q, kv, kv, kv_lens, table, jnp.zeros((2,), jnp.int32),
                                  jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        pk.paged_attention(q, kv, kv, kv_lens, table, sliding_window=0)
    with pytest.raises(ValueError, match="backend must be"):
        pk.paged_attention(q, kv, kv, kv_lens, table, backend="cuda")
    with pytest.raises(ValueError, match="slot_mapping must be int32"):
        pk.write_kv(kv, kv, q[:, :2], q[:, :2], jnp.zeros((2,), jnp.float32))
