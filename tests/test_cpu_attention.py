"""The CPU attention paths (`jnp_attention` for any step, `loop_attention` for the decode
loop) against `pallas_kernels.reference`, on hand-built pages and steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxserve.model import jnp_attention, loop_attention


def test_cpu_attention_fast_paths_equal_the_reference():
    """jnp_attention against pallas_kernels.reference (sliding window on) for steps of fresh
    prompts, fresh prompts beside a decode row (one needing both pages, one only the first), a
    continued chunk beside a decode row, and two continued chunks. Three real sequences,
    padding tokens and one padding sequence; earlier context is random K/V already in the
    pages."""
    rng = np.random.default_rng(0)
    page, hkv, hq, d, tokens = 16, 2, 4, 16, 32
    q_lens = [5, 17, 1]
    cu = np.array([0, 5, 22, 23, 23], np.int32)
    page_indices = np.array([[1, 2], [3, 4], [5, 6], [0, 0]], np.int32)
    cache = rng.normal(size=(2, 8, page, hkv, d)).astype(np.float32)
    k_new = rng.normal(size=(tokens, hkv, d)).astype(np.float32)
    v_new = rng.normal(size=(tokens, hkv, d)).astype(np.float32)
    q = rng.normal(size=(tokens, hq, d)).astype(np.float32)
    def attend(q, k_new, v_new, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
        plan = jnp_attention.plan_step(tokens, kv_lens, page_indices, cu_q_lens, num_seqs,
                                       page, sliding_window=6)
        return jnp_attention.ragged_attention(q, k_new, v_new, k_pages, v_pages, page_indices,
                                              plan)

    for kv_lens in ([5, 17, 1, 0], [5, 17, 30, 0], [5, 17, 10, 0], [5, 27, 30, 0],
                    [9, 27, 1, 0]):
        kv_lens = np.array(kv_lens, np.int32)
        slots = np.full(tokens, -1, np.int32)
        for s, n in enumerate(q_lens):
            pos = np.arange(kv_lens[s] - n, kv_lens[s])
            slots[cu[s]:cu[s] + n] = page_indices[s][pos // page] * page + pos % page
        k_pages, v_pages = pallas_kernels.write_kv(jax.numpy.asarray(cache[0]),
                                                   jax.numpy.asarray(cache[1]), k_new, v_new,
                                                   slots)
        args = (k_pages, v_pages, kv_lens, page_indices, cu, np.array([3], np.int32))
        ours = np.asarray(jax.jit(attend)(q, k_new, v_new, *args))
        expected = np.asarray(pallas_kernels.reference.ragged_paged_attention(
            q, *args, sliding_window=6))
        np.testing.assert_allclose(ours, expected, atol=1e-5, err_msg=str(kv_lens))


@pytest.mark.parametrize("sliding_window", [None, 8])
def test_decode_loop_attention_equals_the_reference(sliding_window):
    """Six loop steps of three rows (one padding row) whose loop tokens cross a page edge.
    The context is gathered once before the loop; each step then writes the row's new K/V and
    attends over the carried context. The pages at and after each row's start are overwritten
    with fresh values after the gather, so reading stale gathered slots instead of the loop's
    own tokens would show."""
    rng = np.random.default_rng(1)
    page, hkv, hq, d, steps = 16, 2, 4, 16, 6
    page_indices = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [0, 0, 0, 0]],
                            np.int32)
    width = page_indices.shape[1] * page
    start = np.array([5, 20, 30, 0], np.int32)  # cached tokens before the loop
    live = np.array([True, True, True, False])
    k_pages, v_pages = (jnp.asarray(rng.normal(size=(13, page, hkv, d)), jnp.float32)
                        for _ in range(2))
    [(_, _, keys, values)] = loop_attention.with_context([(k_pages, v_pages)], page_indices,
                                                          None)
    k_pages, v_pages = np.array(k_pages), np.array(v_pages)
    for row in range(3):  # everything from the row's start on changes after the gather
        for pos in range(start[row], width):
            slot = (page_indices[row, pos // page], pos % page)
            k_pages[slot], v_pages[slot] = rng.normal(size=(2, hkv, d))
    layer_cache = (k_pages, v_pages, keys, values)
    for step in range(steps):
        position = start + step  # [S] the token fed this step
        slots = np.where(live, page_indices[np.arange(4), position // page] * page
                         + position % page, -1).astype(np.int32)
        q = rng.normal(size=(4, hq, d)).astype(np.float32)
        k_new, v_new = (rng.normal(size=(4, hkv, d)).astype(np.float32) for _ in range(2))
        attention = loop_attention.LoopAttention(
            slots, position,
            loop_attention.context_bias(position, live, width, sliding_window))
        ours, layer_cache = jax.jit(lambda att, *args: att(0, *args))(
            attention, q, k_new, v_new, layer_cache)
        expected = pallas_kernels.reference.paged_attention(
            q, *layer_cache[:2], np.where(live, position + 1, 0).astype(np.int32),
            page_indices, sliding_window=sliding_window)
        np.testing.assert_allclose(np.asarray(ours)[live], np.asarray(expected)[live],
                                   atol=1e-5, err_msg=f"step {step}")
