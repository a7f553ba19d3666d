"""The GPU decode kernel's split-K (flash-decoding) path, chosen for small batches: each split
of a sequence's keys writes a partial (max, sum, weighted sum) and a combine kernel merges
them. In interpret mode against the jnp reference (`pallas_kernels.reference`), over
contexts placed against the split length (MIN_SPLIT_KEYS keys, 4 pages of 16): shorter than
one split, exactly one, not a multiple of it, and long enough that the splits outgrow the
minimum (pages not a multiple of the splits), with a sliding window, a soft cap, sinks and
quantized pages. The rule that picks the splits and the page runs each split walks are
checked against hand-computed values.
"""

import numpy as np
import pytest
from test_pallas_decode import PAGE, check, denan, poisoned_case
from test_pallas_quantized import QuantCase

import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels import gpu_decode, reference

SPLIT = gpu_decode.MIN_SPLIT_KEYS  # 64 keys: 4 pages of 16
# kv lengths of one batch (16 splits): under one split (1, 63), exactly one, one and a bit,
# 140 pages (15 splits of 9 pages, the last of 5), 131 pages with a partial last page.
CONTEXTS = (1, SPLIT - 1, SPLIT, SPLIT + 17, 140 * PAGE, 130 * PAGE + 9)


@pytest.mark.quick
@pytest.mark.parametrize("batch,kv_heads,splits", [
    (1, 8, 32), (1, 1, 32), (4, 8, 8), (8, 8, 4), (32, 8, 2), (33, 8, 1), (256, 8, 1),
    (64, 1, 4)])
def test_default_splits_fill_the_card_and_leave_large_batches_alone(batch, kv_heads, splits):
    """Hand-computed: the power of two nearest below ceil(264 / (batch x kv heads)) (264: two
    programs per SM of a 132-SM H100), at most 32; one split once the batch fills the card."""
    assert gpu_decode.default_splits(batch, kv_heads) == splits


def runs(key_lo, key_hi, splits, page_size=PAGE):
    """The [lo, hi) page runs of each split, as `split_pages` gives them (the kernel's rule)."""
    return [tuple(int(x) for x in gpu_decode.split_pages(
        jnp.int32(key_lo), jnp.int32(key_hi), jnp.int32(s), splits, page_size,
        gpu_decode.min_split_pages(page_size))) for s in range(splits)]


@pytest.mark.quick
def test_batch_one_at_2048_keys_gives_every_split_four_pages():
    """The issue's row: 2,048 keys of pages of 16 over 32 splits, 4 pages each (all 32 x 8
    kv heads = 256 programs at work; with splits of 256 keys only 8 splits would be); 640
    keys: 10 splits of the minimum 4 pages, the rest empty."""
    assert runs(0, 2048, 32) == [(4 * s, 4 * s + 4) for s in range(32)]
    assert runs(0, 640, 32) == [(min(4 * s, 40), min(4 * s + 4, 40)) for s in range(32)]
    assert runs(0, 2048, 32, page_size=32) == [(2 * s, 2 * s + 2) for s in range(32)]


@pytest.mark.quick
@pytest.mark.parametrize("key_lo,key_hi", [(0, 0), (0, 1), (5, 6), (0, 63), (30, 2240),
                                           (100, 2089), (2000, 2048)])
def test_split_runs_tile_the_keys_pages_once(key_lo, key_hi):
    """Every page holding one of the keys [key_lo, key_hi) is in exactly one split's run, and
    no other page is (the pages enumerated here one by one)."""
    walked = [p for lo, hi in runs(key_lo, key_hi, 32) for p in range(lo, hi)]
    wanted = sorted({k // PAGE for k in range(key_lo, key_hi)})
    assert walked == wanted


@pytest.mark.parametrize("window,soft_cap,sinks", [(None, None, False), (300, None, True),
                                                   (None, 5.0, False)])
def test_split_decode_matches_reference(make_case, window, soft_cap, sinks):
    """Batch 6, 2 kv heads: `default_splits` gives 16, each row's keys spread over them."""
    assert gpu_decode.default_splits(len(CONTEXTS), 2) == 16
    case, kv_lens, table, clean = poisoned_case(make_case, 57, hq=8, hkv=2, head_dim=64,
                                                pages_per_seq=140, kv_lens=CONTEXTS)
    q = case.queries(len(kv_lens))
    opts = dict(sliding_window=window, soft_cap=soft_cap,
                sinks=case.sinks() if sinks else None)
    want = reference.paged_attention(q, denan(case.k_pages), denan(case.v_pages), kv_lens,
                                     clean, **opts)
    out = pk.paged_attention(q, case.k_pages, case.v_pages, kv_lens, table, backend="gpu",
                             interpret=True, **opts)
    check(out, want, case)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_split_decode_of_quantized_pages(make_case, kind):
    """The same contexts on int8 (scaled) and fp8 pages, bf16 q, against the reference on
    the pages as numpy dequantizes them (`QuantCase`)."""
    case = make_case(58, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=PAGE,
                     num_seqs=len(CONTEXTS), pages_per_seq=140, dtype=np.dtype("float32"))
    quant = QuantCase(case, kind)
    kv_lens = np.array(CONTEXTS, np.int32)
    q = case.queries(len(kv_lens))
    out = pk.paged_attention(q, quant.k_codes, quant.v_codes, kv_lens, case.page_indices,
                             backend="gpu", interpret=True, **quant.scales)
    want = reference.paged_attention(q, quant.k_float, quant.v_float, kv_lens,
                                     case.page_indices)
    check(out, want, case)


@pytest.mark.parametrize("sinks", [False, True])
def test_combine_kernel_equals_one_softmax_over_all_splits(sinks):
    """The Pallas combine (the device's, here in interpret mode) on partials made in numpy
    from scores cut into 8 splits of 5 keys, some with no key (max MASK_VALUE, sum 0):
    the softmax over all the keys at once, with each head's sink in its denominator."""
    rng = np.random.default_rng(4)
    batch, hkv, rows, group, splits, keys, d = 2, 2, 16, 4, 8, 5, 64
    scores = rng.normal(0, 3, (batch, hkv, rows, splits, keys))  # spread maxima per split
    seen = rng.random((batch, hkv, 1, splits, keys)) < 0.7
    seen[0, 0, :, 1:] = False  # one row's keys all in its first split
    seen[1, 1, :, ::2] = False  # every other split empty
    values = rng.normal(size=(batch, hkv, splits, keys, d))
    masked = np.where(seen, scores, -np.inf)
    m = masked.max(axis=-1)  # [B, Hkv, G', S]
    weights = np.where(seen, np.exp(masked - np.where(np.isfinite(m), m, 0)[..., None]), 0)
    acc = np.einsum("bhgsk,bhskd->bhsgd", weights, values)  # [B, Hkv, S, G', D]
    m = np.where(np.isfinite(m), m, reference.MASK_VALUE).swapaxes(2, 3)  # [B, Hkv, S, G']
    sums = weights.sum(axis=-1).swapaxes(2, 3)  # [B, Hkv, S, G']
    sink = rng.uniform(-1, 2, (hkv, rows)) if sinks else None  # [Hkv, G']
    flat = masked.reshape(batch, hkv, rows, -1)  # [B, Hkv, G', S * keys]
    top = flat.max(axis=-1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink[None, :, :, None])
    p = np.exp(flat - top)
    denominator = p.sum(axis=-1) + (0 if sink is None else np.exp(sink[None] - top[..., 0]))
    want = np.einsum("bhgn,bhnd->bhgd", p, values.reshape(batch, hkv, -1, d)) / denominator[
        ..., None]  # [B, Hkv, G', D]
    got = gpu_decode.combine(*(jnp.asarray(x, jnp.float32) for x in (acc, m, sums)),
                             None if sink is None else jnp.asarray(sink, jnp.float32), group,
                             jnp.float32, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want[:, :, :group], rtol=1e-5, atol=1e-5)
