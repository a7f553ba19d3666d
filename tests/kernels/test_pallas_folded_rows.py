"""TPU's lane-dense layouts: pages whose rows hold several tokens (`kv_quant.tokens_per_row`:
one kv head of 64 per device) and int8 scale pools whose heads' runs are padded
(`kv_quant.scale_stride`). The kernels, the writes and a kv-head split over devices read
and write them exactly as the same tokens stored one to a row with unpadded scales. Every
check compares with the reference on the plain layout (or with numpy), built from the same
values; scale padding holds NaN, so reading it would show."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import kv_quant, reference, tpu_copies

PAGE_TABLE = np.array([[3, 1, 4, -1], [5, 9, 2, 6], [-1, 99, -1, -1]], np.int32)  # [S, P]
NUM_PAGES = 10


def padded_scales(scales, stride):
    """Scales [N, page_size, Hkv] as a pool [N, Hkv * stride], each head's run padded with
    NaN."""
    by_head = jnp.swapaxes(scales, 1, 2)  # [N, Hkv, ps]
    padding = ((0, 0), (0, 0), (0, stride - by_head.shape[-1]))
    return jnp.pad(by_head, padding, constant_values=jnp.nan).reshape(scales.shape[0], -1)


def _pools(rng, page_size, num_kv_heads, head_dim, kind):
    """K and V as values [N, page_size, Hkv, D] float32, then as stored: unfolded and folded
    pages, with int8 scale pools (unpadded, padded as on TPU), else Nones."""
    values = rng.standard_normal((2, NUM_PAGES, page_size, num_kv_heads, head_dim))
    values = values.astype(np.float32)
    fold = kv_quant.tokens_per_row(page_size, num_kv_heads, head_dim)
    if kind == "int8":
        codes, scales = kv_quant.quantize_tokens(jnp.asarray(values), jnp.int8)
        stride = kv_quant.scale_stride(page_size, num_kv_heads)
        assert stride > page_size
        scales, padded = ([padded_scales(s, n) for s in scales] for n in (page_size, stride))
    else:
        codes, scales, padded = jnp.asarray(values).astype(kind), [None, None], [None, None]
    unfolded = [kv_quant.fold_heads(c, 1) for c in codes]
    folded = [kv_quant.fold_heads(c, fold) for c in codes]
    return unfolded, folded, scales, padded


def _scaled(scales):
    return {} if scales[0] is None else dict(k_scales=scales[0], v_scales=scales[1])


@pytest.mark.parametrize("num_kv_heads,head_dim,page_size,kind,interpret", [
    (1, 64, 16, jnp.float32, True),
    (1, 64, 32, jnp.bfloat16, pltpu.InterpretParams(detect_races=True)),
    (3, 64, 16, jnp.float32, True),  # 192 values: two tokens make 384 lanes
    (1, 64, 16, "int8", True),  # folded, scale runs of 128
    (2, 128, 16, "int8", pltpu.InterpretParams(detect_races=True)),  # runs of 64: head 1 at 64
])
def test_tpu_layouts_match_the_reference(num_kv_heads, head_dim, page_size, kind, interpret):
    """Folded pages and padded scale runs, both kernels of both platforms (the Triton ones
    in interpret mode, as on CPU by default), against the reference on the plain layout."""
    rng = np.random.default_rng(num_kv_heads * page_size)
    group = 2
    unfolded, folded, scales, padded = _pools(rng, page_size, num_kv_heads, head_dim, kind)
    q_dtype = jnp.float32 if kind == "int8" else kind
    tol = dict(atol=3e-2, rtol=3e-2) if q_dtype == jnp.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    table = jnp.asarray(PAGE_TABLE)
    kv_lens = jnp.array([3 * page_size - 5, 4 * page_size, 0], jnp.int32)  # one empty row
    q = jnp.asarray(rng.standard_normal((3, num_kv_heads * group, head_dim))).astype(q_dtype)
    want = reference.paged_attention(q, *unfolded, kv_lens, jnp.maximum(table, 0),
                                     **_scaled(scales))
    for options in (dict(backend="tpu", interpret=interpret), {}):  # TPU; default (Triton)
        got = pk.paged_attention(q, *folded, kv_lens, table, page_size=page_size,
                                 **_scaled(padded), **options)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   **tol)
    cu_q_lens = jnp.array([0, 7, 8, 8], jnp.int32)  # a prefill chunk, a decode row, nothing
    qr = jnp.asarray(rng.standard_normal((10, num_kv_heads * group, head_dim))).astype(q_dtype)
    want = reference.ragged_paged_attention(qr, *unfolded, kv_lens, jnp.maximum(table, 0),
                                            cu_q_lens, jnp.array([2], jnp.int32),
                                            **_scaled(scales))
    for options in (dict(backend="tpu", interpret=interpret), {}):
        got = pk.ragged_paged_attention(qr, *folded, kv_lens, table, cu_q_lens,
                                        jnp.array([2], jnp.int32), page_size=page_size,
                                        q_block=8, **_scaled(padded), **options)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   **tol)


@pytest.mark.parametrize("num_kv_heads,page_size", [(1, 16), (3, 32)])
def test_write_kv_into_folded_rows(num_kv_heads, page_size):
    """Each token lands in its page's slot as numpy places it in `[N, page_size, Hkv, D]`
    values; the other slots (the other tokens of the same rows) keep theirs."""
    rng = np.random.default_rng(7)
    head_dim = 64
    fold = kv_quant.tokens_per_row(page_size, num_kv_heads, head_dim)
    values = rng.standard_normal((NUM_PAGES, page_size, num_kv_heads, head_dim))
    values = values.astype(np.float32)
    slots = np.array([0, 1, page_size // 2, page_size - 1, -1, 5 * page_size + 3,
                      NUM_PAGES * page_size + 2], np.int32)  # a padding token, one past
    new = rng.standard_normal((2, len(slots), num_kv_heads, head_dim)).astype(np.float32)
    pages = kv_quant.fold_heads(jnp.asarray(values), fold)
    k_out, v_out = jax.jit(pk.write_kv, static_argnums=5)(pages, pages, new[0], new[1], slots,
                                                          page_size)
    for out, written in ((k_out, new[0]), (v_out, new[1])):
        want = values.copy()
        for t, slot in enumerate(slots):
            if 0 <= slot < NUM_PAGES * page_size:
                want[slot // page_size, slot % page_size] = written[t]
        np.testing.assert_array_equal(np.asarray(kv_quant.page_heads(out, head_dim, page_size)),
                                      want)


def test_folded_pages_split_over_devices():
    """2 kv heads of 64 over 2 devices: each device's 64-value row folds to 128 lanes, and
    the global row is head-major, so splitting it in two gives each device its own head's
    two parts. The write and the kernel under shard_map match the reference."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    rng = np.random.default_rng(3)
    num_kv_heads, head_dim, page_size = 2, 64, 16
    fold = kv_quant.tokens_per_row(page_size, num_kv_heads, head_dim, num_shards=2)
    assert fold == 2 and kv_quant.tokens_per_row(page_size, num_kv_heads, head_dim) == 1
    values = rng.standard_normal((2, NUM_PAGES, page_size, num_kv_heads, head_dim))
    values = jnp.asarray(values.astype(np.float32))
    folded = [kv_quant.fold_heads(x, fold) for x in values]  # [N, ps / 2, 2 * 2 * 64]
    unfolded = [kv_quant.fold_heads(x, 1) for x in values]
    slots = jnp.array([2 * page_size + 5, 7], jnp.int32)
    new = jnp.asarray(rng.standard_normal((2, 2, num_kv_heads, head_dim)).astype(np.float32))
    kv_lens = jnp.array([3 * page_size - 5, 4 * page_size, 0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 4, head_dim)).astype(np.float32))
    heads, pool, rep = P(None, "model", None), P(None, None, "model"), P()

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, out_specs=(heads, pool, pool),
                       in_specs=(heads, pool, pool, heads, heads, rep, rep, rep),
                       check_vma=False)
    def step(q, k_pages, v_pages, k_new, v_new, slots, kv_lens, table):
        k_pages, v_pages = pk.write_kv(k_pages, v_pages, k_new, v_new, slots, page_size)
        out = pk.paged_attention(q, k_pages, v_pages, kv_lens, table, page_size=page_size,
                                 backend="tpu", interpret=True)
        return out, k_pages, v_pages

    out, k_pages, v_pages = step(q, *folded, new[0], new[1], slots, kv_lens,
                                 jnp.asarray(PAGE_TABLE))
    k_want, v_want = reference.write_kv(*unfolded, new[0], new[1], slots)
    for got, want in ((k_pages, k_want), (v_pages, v_want)):
        np.testing.assert_array_equal(np.asarray(kv_quant.page_heads(got, head_dim, page_size)),
                                      np.asarray(kv_quant.page_heads(want, head_dim)))
    want = reference.paged_attention(q, k_want, v_want, kv_lens,
                                     jnp.maximum(jnp.asarray(PAGE_TABLE), 0))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_kv_heads,page_size,stride", [(1, 16, 128), (2, 16, 64)])
def test_int8_write_into_padded_scale_runs(num_kv_heads, page_size, stride):
    """`kv_quant.write` puts token p's scale of head h at h * S + p (S the padded run) and
    leaves the padding alone; the codes and scales match absmax / 127 quantization
    (hand-computed: head 0 a row of 381s, scale 3; head 1 (if any) one -2, scale 2/127)."""
    head_dim = 64
    assert kv_quant.scale_stride(page_size, num_kv_heads) == stride
    fold = kv_quant.tokens_per_row(page_size, num_kv_heads, head_dim)
    shape = kv_quant.page_shape(4, page_size, num_kv_heads, head_dim, fold)
    pages = jnp.zeros(shape, jnp.int8)
    scales = jnp.full((4, num_kv_heads * stride), jnp.nan, jnp.float32)
    new = np.zeros((2, num_kv_heads, head_dim), np.float32)
    new[:, 0] = 127.0 * 3  # head 0: scale 3, codes 127
    if num_kv_heads == 2:
        new[:, 1, 5] = -2.0  # head 1: scale 2/127, code -127 at lane 5
    slots = jnp.array([2 * page_size + 9, 1 * page_size + 0], jnp.int32)
    k_pages, _, k_scales, _ = kv_quant.write((pages, pages, scales, scales), jnp.asarray(new),
                                             jnp.asarray(new), slots, page_size)
    got = np.asarray(k_scales)
    written = np.zeros_like(got, bool)
    for page, offset in ((2, 9), (1, 0)):
        assert got[page, offset] == 3.0
        written[page, offset] = True
        if num_kv_heads == 2:
            assert np.isclose(got[page, stride + offset], 2.0 / 127)
            written[page, stride + offset] = True
    assert np.isnan(got[~written]).all()  # the rest untouched
    codes = np.asarray(kv_quant.page_heads(k_pages, head_dim, page_size))
    for page, offset in ((2, 9), (1, 0)):
        assert (codes[page, offset, 0] == 127).all()
        assert num_kv_heads == 1 or codes[page, offset, 1, 5] == -127
    assert np.count_nonzero(codes) == 2 * (head_dim + (num_kv_heads == 2))


def test_tokens_per_row_and_scale_stride():
    """Hand-counted: rows of a multiple of 128 lanes stay one token; 64 values fold 2; 192
    (3 heads of 64) fold 2 into 384; off TPU nothing folds; a fold that does not divide the
    page stays 1."""
    assert kv_quant.tokens_per_row(64, 8, 128) == 1
    assert kv_quant.tokens_per_row(64, 2, 64) == 1
    assert kv_quant.tokens_per_row(64, 8, 64, num_shards=8) == 2
    assert kv_quant.tokens_per_row(64, 3, 64) == 2
    assert kv_quant.tokens_per_row(64, 1, 64, platform="gpu") == 1
    assert kv_quant.tokens_per_row(2, 1, 32) == 1  # would need 4 tokens a row
    assert kv_quant.page_shape(10, 64, 1, 64, fold=2) == (10, 32, 128)
    # scale runs: 8 heads of 64 fill 512 floats; one head of 64 pads to 128; 3 of 16 to 3 x 128
    assert kv_quant.scale_stride(64, 8) == 64 and kv_quant.scale_stride(64, 1) == 128
    assert kv_quant.scale_stride(16, 3) == 128 and kv_quant.scale_stride(64, 8, 8) == 128
    assert kv_quant.scale_stride(16, 1, platform="gpu") == 16


def test_copy_blocks_count_the_vmem_tiles_a_page_takes():
    """Hand-counted: a bfloat16 VMEM tile is 16 rows x 128 lanes (4 KiB). Pages of 16 tokens
    folded to [8, 128] still take one whole tile each (8 rows of padding), as do one-token
    rows of 64 values ([16, 64]: 64 lanes of padding), so a 64 KiB budget for K and V's two
    slots holds blocks of 64 KiB / (4 x 4 KiB) = 4 pages; [16, 256] pages take two tiles."""
    budget, wide_table = 64 << 10, 100
    assert tpu_copies.pages_per_block(8, 128, 16, 2, wide_table, budget) == 4
    assert tpu_copies.pages_per_block(16, 64, 16, 2, wide_table, budget) == 4
    assert tpu_copies.pages_per_block(16, 256, 16, 2, wide_table, budget) == 2
    assert tpu_copies.pages_per_block(8, 128, 16, 2, 3, budget) == 3  # the table's width
