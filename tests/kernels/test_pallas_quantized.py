"""Quantized KV pages (int8 with per-token, per-head scales; float8_e4m3fn unscaled) read by
the kernels in interpret mode, against an independent oracle: the pages are quantized and
dequantized here in numpy, and `reference` runs on the dequantized float pages (in q's
dtype). The kernels dequantize each tile they load with the same rounding, so they match it
as closely as they match the reference on float pages."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels as pk
from pallas_kernels import reference

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
PAGE = 16
# (backend, interpret): the Triton kernels, and the TPU kernels in TPU interpret mode, which
# raises on any out-of-bounds read and detects DMA races (the scale copies included).
MODES = [("gpu", True), ("tpu", pltpu.InterpretParams(detect_races=True))]
MODE_IDS = ["gpu", "tpu-races"]
# Decode shapes: (num_q_heads, num_kv_heads, head_dim, dtype, soft_cap, sliding_window).
GQA_F32 = (8, 2, 128, np.float32, None, None)
ONE_KV_HEAD_BF16 = (4, 1, 64, BF16, 5.0, 21)  # rows of one head, cap + window


def quantize(x, kind, num_kv_heads):
    """x [N, page_size, Hkv * D] float32 -> (codes [N, page_size, Hkv * D], scales
    [N, page_size, Hkv] float32 or None): int8 codes round(x / s) with s = absmax over each
    head's D values / 127 (1 for an all-zero head), or fp8 (x clipped to ±448, unscaled)."""
    if kind == "fp8":
        return np.clip(x, -448, 448).astype(FP8), None
    heads = x.reshape(*x.shape[:2], num_kv_heads, -1)  # [N, page_size, Hkv, D]
    absmax = np.abs(heads).max(axis=-1)  # [N, page_size, Hkv]
    scales = np.where(absmax > 0, absmax / np.float32(127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.round(heads / scales[..., None]), -127, 127).astype(np.int8)
    return codes.reshape(x.shape), scales


def dequantize(codes, scales, dtype):
    """What the pages [N, page_size, Hkv * D] hold, as dtype: codes * scales [N, page_size,
    Hkv] in float32, then rounded to dtype."""
    values = codes.astype(np.float32)
    if scales is not None:
        heads = values.reshape(*scales.shape, -1)  # [N, page_size, Hkv, D]
        values = (heads * scales[..., None]).reshape(codes.shape)
    return values.astype(dtype)


class QuantCase:
    """A case's float pages quantized (`kind` "int8" or "fp8"), with the float pages the
    oracle reads: the dequantized values in q's dtype."""

    def __init__(self, case, kind):
        self.case, self.kind = case, kind
        spread = np.float32(3.0) if kind == "fp8" else np.float32(1.0)  # fp8: more exponents
        k = case.k_pages.astype(np.float32) * spread  # [N, page_size, Hkv * D]
        v = case.v_pages.astype(np.float32) * spread  # [N, page_size, Hkv * D]
        if kind == "fp8":
            k[0, 0, :2] = [1000.0, -3e-3]  # clipped to 448; a subnormal
        self.k_codes, self.k_scales = quantize(k, kind, case.num_kv_heads)
        self.v_codes, self.v_scales = quantize(v, kind, case.num_kv_heads)
        self.k_float = dequantize(self.k_codes, self.k_scales, case.dtype)
        self.v_float = dequantize(self.v_codes, self.v_scales, case.dtype)

    @property
    def scales(self):
        """The kernels' k_scales / v_scales keywords (none for fp8): the scale pools
        [N, Hkv * page_size], page n's row holding head 0's page_size scales, then head 1's..."""
        if self.k_scales is None:
            return {}
        return {name: pool_rows(scales) for name, scales in
                (("k_scales", self.k_scales), ("v_scales", self.v_scales))}


def pool_rows(scales):
    """scales [N, page_size, Hkv] → the pool layout [N, Hkv * page_size] (head-major rows)."""
    return np.ascontiguousarray(scales.transpose(0, 2, 1)).reshape(scales.shape[0], -1)


def check(out, want, case):
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, **case.tol)


# Each kind on each kernel, each shape on each kernel (a quarter of the product's time).
@pytest.mark.parametrize("kind,mode,shape", [
    ("int8", MODES[0], GQA_F32), ("int8", MODES[1], ONE_KV_HEAD_BF16),
    ("fp8", MODES[0], ONE_KV_HEAD_BF16), ("fp8", MODES[1], GQA_F32),
], ids=["int8-gpu-gqa", "int8-tpu-races-one-kv-head", "fp8-gpu-one-kv-head",
        "fp8-tpu-races-gqa"])
def test_decode_quantized_pages(make_case, kind, mode, shape):
    (backend, interpret), (hq, hkv, d, dtype, soft_cap, window) = mode, shape
    case = make_case(hq + d, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=PAGE,
                     num_seqs=5, pages_per_seq=3, dtype=dtype)
    quant = QuantCase(case, kind)
    kv_lens = np.array([0, 1, PAGE, 2 * PAGE + 1, 3 * PAGE], np.int32)
    q = case.queries(5)
    opts = dict(soft_cap=soft_cap, sliding_window=window)
    out = pk.paged_attention(q, quant.k_codes, quant.v_codes, kv_lens, case.page_indices,
                             backend=backend, interpret=interpret, **quant.scales, **opts)
    want = reference.paged_attention(q, quant.k_float, quant.v_float, kv_lens,
                                     case.page_indices, **opts)
    assert out.dtype == q.dtype
    check(out, want, case)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # kv_len 0


def ragged_inputs(case, q_lens, kv_extra, num_tokens):
    """q [num_tokens, Hq, D], kv_lens, cu_q_lens for q_lens new tokens after kv_extra."""
    kv_lens = (np.asarray(q_lens) + np.asarray(kv_extra)).astype(np.int32)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return case.queries(num_tokens), kv_lens, cu_q_lens


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("backend,interpret", MODES, ids=MODE_IDS)
def test_ragged_quantized_pages(make_case, kind, backend, interpret):
    """Prefill chunks (one across tiles, one after a prefix), a decode row and a padding
    sequence, bf16 q over 2 kv heads with a sliding window."""
    case = make_case(7, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=PAGE,
                     num_seqs=4, pages_per_seq=4, dtype=BF16)
    quant = QuantCase(case, kind)
    q, kv_lens, cu_q_lens = ragged_inputs(case, [19, 1, 6, 2], [0, 40, 27, 3], 30)
    num_seqs = np.array([3], np.int32)
    out = pk.ragged_paged_attention(q, quant.k_codes, quant.v_codes, kv_lens,
                                    case.page_indices, cu_q_lens, num_seqs, backend=backend,
                                    interpret=interpret, q_block=8, sliding_window=24,
                                    **quant.scales)
    want = reference.ragged_paged_attention(q, quant.k_float, quant.v_float, kv_lens,
                                            case.page_indices, cu_q_lens, num_seqs,
                                            sliding_window=24)
    check(out, want, case)
    np.testing.assert_array_equal(np.asarray(out[26:], np.float32), 0.0)  # padding rows


def poison(case, quant, kv_lens, table):
    """Poisons table entries past each sequence's pages (-1 / past the pool) and every scale
    (int8) or page value (fp8) of a key no sequence owns (NaN). Returns (poisoned table,
    clean table for the oracle)."""
    num_pages = case.k_pages.shape[0]
    owned = np.zeros((num_pages, PAGE), bool)  # [N, page_size]
    table = table.copy()
    for s, kv_len in enumerate(kv_lens):
        pos = np.arange(kv_len)
        owned[table[s, pos // PAGE], pos % PAGE] = True
        table[s, -(-kv_len // PAGE):] = -1 if s % 2 else num_pages + 7
    for pool in ((quant.k_scales, quant.v_scales) if quant.kind == "int8"
                 else (quant.k_codes, quant.v_codes)):
        pool[~owned] = np.nan
    clean = np.where(table < 0, 0, np.minimum(table, num_pages - 1)).astype(np.int32)
    return table, clean


@pytest.mark.parametrize("kind,backend,interpret", [
    ("int8", *MODES[0]), ("int8", *MODES[1]), ("fp8", *MODES[1])],
    ids=["int8-gpu", "int8-tpu-races", "fp8-tpu-races"])
def test_quantized_pages_past_the_table_never_read(make_case, kind, backend, interpret):
    """A mixed batch over poisoned tables (decode rows through the decode kernel, chunks
    through the prefill kernel): no NaN reaches the output, and no read leaves the pool."""
    case = make_case(11, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=PAGE,
                     num_seqs=6, pages_per_seq=4)
    quant = QuantCase(case, kind)
    q, kv_lens, cu_q_lens = ragged_inputs(case, [20, 1, 1, 9, 1, 0],
                                          [0, 0, PAGE - 1, 24, 4 * PAGE - 1, 5], 40)
    table, clean = poison(case, quant, kv_lens, case.page_indices)
    num_seqs = np.array([5], np.int32)
    out = pk.ragged_paged_attention(q, quant.k_codes, quant.v_codes, kv_lens, table,
                                    cu_q_lens, num_seqs, backend=backend, interpret=interpret,
                                    q_block=8, **quant.scales)
    k_float, v_float = (np.nan_to_num(dequantize(codes, scales, np.float32)) for codes, scales
                        in ((quant.k_codes, quant.k_scales), (quant.v_codes, quant.v_scales)))
    want = reference.ragged_paged_attention(q, k_float, v_float, kv_lens, clean, cu_q_lens,
                                            num_seqs)
    check(out, want, case)


def test_reference_dequantizes_like_numpy(make_case):
    """The oracle's own quantized path: int8 pages with scales (and fp8 pages) give what the
    reference gives on the pages dequantized here."""
    case = make_case(3, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=PAGE,
                     num_seqs=2, pages_per_seq=2, dtype=BF16)
    kv_lens, q = np.array([5, 2 * PAGE], np.int32), case.queries(2)
    for kind in ("int8", "fp8"):
        quant = QuantCase(case, kind)
        out = pk.paged_attention(q, quant.k_codes, quant.v_codes, kv_lens, case.page_indices,
                                 backend="reference", **quant.scales)
        want = reference.paged_attention(q, quant.k_float, quant.v_float, kv_lens,
                                         case.page_indices)
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(want, np.float32))


def scale_args(pages_dtype=jnp.int8, scales_dtype=jnp.float32, scales_shape=(8, 2 * PAGE)):
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((8, PAGE, 2 * 64), pages_dtype)
    scales = jnp.zeros(scales_shape, scales_dtype)
    return (q, kv, kv, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 3), jnp.int32)), scales


@pytest.mark.parametrize("fn", ["paged", "ragged", "reference"])
@pytest.mark.parametrize("pages_dtype,scales,message", [
    (jnp.int8, {}, "int8 pages need k_scales and v_scales"),
    (jnp.int8, {"k_scales"}, "int8 pages need k_scales and v_scales"),
    (jnp.bfloat16, {"k_scales", "v_scales"}, "k_scales and v_scales given for bfloat16 pages"),
    (jnp.float8_e4m3fn, {"v_scales"}, "v_scales given for float8_e4m3fn pages"),
])
def test_scales_must_match_the_pages_dtype(fn, pages_dtype, scales, message):
    args, pool = scale_args(pages_dtype)
    kw = {name: pool for name in scales}
    with pytest.raises(ValueError, match=message):
        if fn == "ragged":
            cu_q_lens = jnp.array([0, 1, 2], jnp.int32)
            pk.ragged_paged_attention(*args, cu_q_lens, jnp.ones((1,), jnp.int32), **kw)
        else:
            pk.paged_attention(*args, backend="reference" if fn == "reference" else None,
                               **kw)


@pytest.mark.parametrize("scales_dtype,scales_shape", [
    (jnp.bfloat16, (8, 2 * PAGE)), (jnp.float32, (8, PAGE, 2)), (jnp.float32, (8, PAGE))])
def test_scales_must_be_float32_like_the_pages(scales_dtype, scales_shape):
    args, scales = scale_args(scales_dtype=scales_dtype, scales_shape=scales_shape)
    good = jnp.zeros((8, 2 * PAGE), jnp.float32)
    with pytest.raises(ValueError, match=r"k_scales must be float32\[8, 32\]"):
        pk.paged_attention(*args, k_scales=scales, v_scales=good)
    with pytest.raises(ValueError, match=r"v_scales must be float32\[8, 32\]"):
        pk.paged_attention(*args, k_scales=good, v_scales=scales)


def test_page_dtypes_must_be_q_or_quantized():
    (q, kv, _, kv_lens, table), scales = scale_args(jnp.int16)
    with pytest.raises(ValueError, match="k_pages dtype int16 must match q dtype bfloat16 or "
                                         "be int8 or float8_e4m3fn"):
        pk.paged_attention(q, kv, kv, kv_lens, table)
    with pytest.raises(ValueError, match="v_pages dtype float8_e4m3fn != k_pages dtype int8"):
        pk.paged_attention(q, kv.astype(jnp.int8), kv.astype(jnp.float8_e4m3fn), kv_lens,
                           table, k_scales=scales, v_scales=scales)
