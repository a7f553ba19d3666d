"""Every attention backend, through the interface the runner uses (`for_step`, for steps and
decode-loop steps), against a numpy attention written out here from the definition, on
hand-built pages and steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import BACKENDS, PagedBatch
from jaxserve.model.llama import StackedLayer

PAGE, HKV, HQ, D = 16, 2, 4, 64  # the kernels take head_dim 64, 128 or 256


def make_backend(name, windows, soft_cap=None):
    """`windows`: one per layer (a single one: every layer's)."""
    return BACKENDS[name](PAGE, tuple(windows), soft_cap)


def numpy_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, window,
                    soft_cap=None):
    """Row s's queries sit at the last q_len positions of its kv_len keys (read from its
    pages) and attend causally, within `window` if set, scores capped by `soft_cap` if set;
    padding rows give zeros."""
    out = np.zeros(q.shape, np.float64)
    group = HQ // HKV
    for s in range(num_seqs):
        first, last, kv_len = cu_q_lens[s], cu_q_lens[s + 1], kv_lens[s]
        pos = np.arange(kv_len)
        keys = k_pages[page_indices[s][pos // PAGE], pos % PAGE]  # [L, Hkv, D]
        values = v_pages[page_indices[s][pos // PAGE], pos % PAGE]
        for t in range(first, last):
            here = kv_len - (last - t)
            visible = pos <= here
            if window is not None:
                visible &= here - pos < window
            for h in range(HQ):
                scores = keys[:, h // group] @ q[t, h] / np.sqrt(D)
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                scores = np.where(visible, scores, -np.inf)
                weights = np.exp(scores - scores.max())
                out[t, h] = weights @ values[:, h // group] / weights.sum()
    return out


def packed(pages, fold=1):
    """numpy pages [N, page_size, Hkv, D] as the backends store them: [N, page_size / fold,
    fold * Hkv * D], token p of a page in row p % (page_size / fold), head h's part p //
    (page_size / fold) at lanes (h * fold + part) * D (`kv_quant.tokens_per_row`)."""
    rows = PAGE // fold
    parts = pages.reshape(pages.shape[0], fold, rows, HKV, D).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(parts).reshape(pages.shape[0], rows, fold * HKV * D)


def heads(pages, fold=1):
    """A backend's pages (as `packed` stores them) as numpy [N, page_size, Hkv, D]."""
    rows = PAGE // fold
    parts = np.asarray(pages).reshape(pages.shape[0], rows, HKV, fold, D)
    return parts.transpose(0, 3, 1, 2, 4).reshape(pages.shape[0], PAGE, HKV, D)


def write(pages, new, slots):
    pages = pages.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            pages[slot // PAGE, slot % PAGE] = new[t]
    return pages


@pytest.mark.parametrize("name,fold", [("cpu", 1), ("pallas", 1), ("reference", 1),
                                       ("pallas", 2), ("reference", 2), ("cpu", 4)])
def test_a_step_of_every_kind_equals_numpy(name, fold):
    """Fresh prompts, a fresh prompt beside a decode row (one needing both pages, one only the
    first), a continued chunk beside a decode row, two continued chunks; three real rows,
    padding tokens and one padding row; a model of two layers, the first with a sliding
    window of 6 and the second without, scores capped at 1.5 (Gemma 2's layers). Earlier
    context is random K/V in
    the pages; the returned pages must hold the step's K/V at its slots. Pages of one token
    a row, and of `fold` tokens a row (TPU's layout where a device's kv heads fill less than
    128 lanes), written out here by hand."""
    rng = np.random.default_rng(0)
    tokens, q_lens = 32, [5, 17, 1]
    cu = np.array([0, 5, 22, 23, 23], np.int32)
    page_indices = np.array([[1, 2], [3, 4], [5, 6], [0, 0]], np.int32)
    cache = rng.normal(size=(2, 8, PAGE, HKV, D)).astype(np.float32)
    k_new, v_new = rng.normal(size=(2, tokens, HKV, D)).astype(np.float32)
    q = rng.normal(size=(tokens, HQ, D)).astype(np.float32)
    windows, soft_cap = (6, None), 1.5
    backend = make_backend(name, windows, soft_cap)

    @functools.partial(jax.jit, static_argnums=0)
    def step(layer, batch, q, k_new, v_new, layer_cache):
        return backend.for_step(batch)(layer, q, k_new, v_new, layer_cache)

    for kv_lens in ([5, 17, 1, 0], [5, 17, 30, 0], [5, 17, 10, 0], [5, 27, 30, 0],
                    [9, 27, 1, 0]):
        kv_lens = np.array(kv_lens, np.int32)
        slots = np.full(tokens, -1, np.int32)
        for s, n in enumerate(q_lens):
            pos = np.arange(kv_lens[s] - n, kv_lens[s])
            slots[cu[s]:cu[s] + n] = page_indices[s][pos // PAGE] * PAGE + pos % PAGE
        batch = PagedBatch(slots, kv_lens, page_indices, cu, np.array([3], np.int32))
        want_k, want_v = write(cache[0], k_new, slots), write(cache[1], v_new, slots)
        for layer, window in enumerate(windows):
            out, (k_pages, v_pages) = step(layer, batch, q, k_new, v_new,
                                           (packed(cache[0], fold), packed(cache[1], fold)))
            np.testing.assert_array_equal(heads(k_pages, fold), want_k)
            np.testing.assert_array_equal(heads(v_pages, fold), want_v)
            want = numpy_attention(q, want_k, want_v, kv_lens, page_indices, cu, 3, window,
                                   soft_cap)
            np.testing.assert_allclose(np.asarray(out), want, atol=2e-5,
                                       err_msg=f"layer {layer}, kv_lens {kv_lens}")


@pytest.mark.parametrize("name, sliding_window, rows", [
    ("cpu", None, 4), ("cpu", 8, 4), ("cpu", None, 1), ("pallas", 8, 4), ("pallas", None, 1),
    ("reference", None, 4)])
def test_decode_loop_steps_equal_numpy(name, sliding_window, rows):
    """Six loop steps of three rows (one padding row), or of one row alone, whose tokens cross
    a page edge, run as the runner runs them: one token per row (`decode_only`: the Pallas
    backend's decode kernel), the pages carried from step to step. The pages from each row's
    start on hold random values that the loop overwrites, so attending to a stale copy would
    show."""
    rng = np.random.default_rng(1)
    page_indices = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [0, 0, 0, 0]],
                            np.int32)[:rows]
    start = np.array([5, 20, 30, 0], np.int32)[:rows]  # cached tokens before the loop
    live = np.array([True, True, True, False])[:rows]
    num_seqs = np.array([int(live.sum())], np.int32)
    cu = np.minimum(np.arange(rows + 1), num_seqs[0]).astype(np.int32)
    k_pages, v_pages = rng.normal(size=(2, 13, PAGE, HKV, D)).astype(np.float32)
    backend = make_backend(name, (sliding_window,))
    layer_cache = (packed(k_pages), packed(v_pages))

    @jax.jit
    def loop_step(batch, q, k_new, v_new, layer_cache):
        return backend.for_step(batch)(0, q, k_new, v_new, layer_cache)

    for step in range(6):
        position = start + step  # [S] the token fed this step
        slots = np.where(live, page_indices[np.arange(rows), position // PAGE] * PAGE
                         + position % PAGE, -1).astype(np.int32)
        kv_lens = np.where(live, position + 1, 0).astype(np.int32)
        q = rng.normal(size=(rows, HQ, D)).astype(np.float32)
        k_new, v_new = rng.normal(size=(2, rows, HKV, D)).astype(np.float32)
        batch = PagedBatch(slots, kv_lens, page_indices, cu, num_seqs, decode_only=True)
        out, layer_cache = loop_step(batch, q, k_new, v_new, layer_cache)
        k_pages, v_pages = write(k_pages, k_new, slots), write(v_pages, v_new, slots)
        want = numpy_attention(q, k_pages, v_pages, kv_lens, page_indices, cu, num_seqs[0],
                               sliding_window)
        np.testing.assert_allclose(np.asarray(out)[live], want[live], atol=2e-5,
                                   err_msg=f"step {step}")
    k_final, v_final = layer_cache
    np.testing.assert_array_equal(heads(k_final), k_pages)
    np.testing.assert_array_equal(heads(v_final), v_pages)


def test_stacked_layers_address_their_own_pages():
    """With `pages_per_layer`, the second layer of a stack (`StackedLayer` group 1) writes
    and reads pages [N, 2N) of the stack's pool."""
    rng = np.random.default_rng(2)
    pages_per_layer = 4
    pool = rng.normal(size=(2, 2 * pages_per_layer, PAGE, HKV, D)).astype(np.float32)
    q = rng.normal(size=(2, HQ, D)).astype(np.float32)
    k_new, v_new = rng.normal(size=(2, 2, HKV, D)).astype(np.float32)
    batch = PagedBatch(np.array([3, -1], np.int32), np.array([4, 0], np.int32),  # position 3
                       np.array([[0, 1], [0, 0]], np.int32), np.array([0, 1, 1], np.int32),
                       np.array([1], np.int32))
    for name in ("cpu", "pallas"):
        backend = BACKENDS[name](PAGE, pages_per_layer=pages_per_layer)
        out, (k_pages, v_pages) = jax.jit(
            lambda b, *a: backend.for_step(b)(StackedLayer(jnp.int32(1), 0, 1), *a))(
                batch, q, k_new, v_new,
                                                                (packed(pool[0]),
                                                                 packed(pool[1])))
        layer1_k, layer1_v = pool[0][pages_per_layer:], pool[1][pages_per_layer:]
        want_k = write(layer1_k, k_new, batch.slot_mapping)
        want_v = write(layer1_v, v_new, batch.slot_mapping)
        np.testing.assert_array_equal(heads(k_pages)[pages_per_layer:], want_k)
        np.testing.assert_array_equal(heads(k_pages)[:pages_per_layer], pool[0][:4])
        want = numpy_attention(q, want_k, want_v, np.array([4, 0]), batch.page_indices,
                               batch.cu_q_lens, 1, None)
        np.testing.assert_allclose(np.asarray(out)[:1], want[:1], atol=2e-5, err_msg=name)
