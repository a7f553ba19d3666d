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


@pytest.mark.parametrize("sliding_window, rows", [(None, 4), (8, 4), (None, 1)])
def test_decode_loop_attention_equals_the_reference(sliding_window, rows):
    """Six loop steps of three rows (one padding row), or of one row alone, whose loop tokens
    cross a page edge. The context is gathered once before the loop; each step then writes the
    row's new K/V and attends over the carried context. The pages at and after each row's
    start are overwritten with fresh values after the gather, so reading stale gathered slots
    instead of the loop's own tokens would show."""
    rng = np.random.default_rng(1)
    page, hkv, hq, d, steps = 16, 2, 4, 16, 6
    page_indices = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [0, 0, 0, 0]],
                            np.int32)[:rows]
    width = page_indices.shape[1] * page
    start = np.array([5, 20, 30, 0], np.int32)[:rows]  # cached tokens before the loop
    live = np.array([True, True, True, False])[:rows]
    k_pages, v_pages = (jnp.asarray(rng.normal(size=(13, page, hkv, d)), jnp.float32)
                        for _ in range(2))
    [(keys, values)] = loop_attention.gather_context([(k_pages, v_pages)], page_indices, None)
    k_pages, v_pages = np.array(k_pages), np.array(v_pages)
    for row in range(int(live.sum())):  # everything from the row's start on changes
        for pos in range(start[row], width):
            slot = (page_indices[row, pos // page], pos % page)
            k_pages[slot], v_pages[slot] = rng.normal(size=(2, hkv, d))
    layer_cache = (k_pages, v_pages, keys, values)
    for step in range(steps):
        position = start + step  # [S] the token fed this step
        slots = np.where(live, page_indices[np.arange(rows), position // page] * page
                         + position % page, -1).astype(np.int32)
        q = rng.normal(size=(rows, hq, d)).astype(np.float32)
        k_new, v_new = (rng.normal(size=(rows, hkv, d)).astype(np.float32) for _ in range(2))
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


def test_a_held_loop_context_serves_only_a_loop_over_the_same_rows():
    """Hand-made cases of `HeldContext.serves`: the last loop (page size 4) began rows 0 and
    1 at positions 5 and 2 and produced 3 and 4 tokens, so they continue at 8 and 6."""
    held_pages = np.array([[1, 2, 3, 0], [4, 5, 0, 0], [0, 0, 0, 0]], np.int32)
    held = loop_attention.HeldContext([], held_pages, np.array([5, 2, 0]),
                                      jnp.array([3, 4, 0]), num_seqs=2)
    same_rows = np.array([8, 6, 0])

    def serves(pages=held_pages, positions=same_rows, num_seqs=2):
        return held.serves(pages, positions, num_seqs, page_size=4)

    assert serves()
    grown = held_pages.copy()
    grown[1, 2] = 6  # a new page past row 1's context, for the tokens to come
    assert serves(grown)
    assert serves(num_seqs=1)  # the last row finished
    assert not serves(num_seqs=3)  # a row the last loop did not have
    assert not serves(positions=np.array([8, 7, 0]))  # row 1 moved on without the loop
    changed = held_pages.copy()
    changed[1, 1] = 9  # a page under row 1's context differs: another sequence
    assert not serves(changed)
    assert not serves(np.zeros((4, 4), np.int32), np.zeros(4, np.int32))  # another bucket
