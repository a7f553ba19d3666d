"""The kernels fully compile (not only lower) for real TPU and GPU targets, on this CPU host.

Compile-only devices (`jaxserve.aot.targets`, the `aot` extra) let Mosaic compile the TPU
kernel for v5e and v6e, and Triton + ptxas compile the GPU kernel for H100 and H200, over the
kernel test grid's shapes: head_dim 64/128/256, page sizes 16-128, 1-8 kv heads, float32 and
bfloat16, decode and ragged (A100 too, which the presets also name), one shape with attention
sinks. Each shape compiles on
one TPU generation and one GPU (`CASES` spreads the grid over the targets, so every target and
every shape is covered at a third of the compile time of the full product). A kernel that
lowers but that the real compiler rejects (a block shape Mosaic cannot tile, a Triton program
that needs more shared memory than the card has) fails here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import pallas_kernels as pk
from jaxserve.engine.cache_audit import PagePools, pool_instructions
from pallas_kernels import kv_quant
from jaxserve.aot import gpu_kernels
from jaxserve.aot.targets import Target, compile_only_devices
from sweeps import sweep

TARGETS = [Target("tpu", "v5e", 1), Target("tpu", "v6e", 1), Target("gpu", "a100-80g", 1),
           Target("gpu", "h100", 1), Target("gpu", "h200", 1)]
# (num_q_heads, num_kv_heads, head_dim, page_size, dtype, soft_cap, sliding_window, sinks)
GRID = [
    (8, 2, 128, 16, jnp.float32, None, None, False),
    (4, 4, 64, 32, jnp.bfloat16, None, None, False),
    (8, 1, 256, 64, jnp.float32, None, None, False),
    (6, 2, 128, 128, jnp.bfloat16, None, None, False),
    (16, 8, 128, 64, jnp.bfloat16, None, None, False),
    (8, 2, 64, 16, jnp.float32, 4.0, 21, True),  # on v6e and H200
]
NUM_SEQS, PAGES_PER_SEQ, NUM_PAGES, TOKENS = 8, 16, 160, 64
# every shape on one TPU (v5e or v6e, alternating) and one GPU (A100, H100, H200 in turn)
TPUS, GPUS = TARGETS[:2], TARGETS[2:]
CASES = [(target, shape) for i, shape in enumerate(GRID)
         for target in (TPUS[i % len(TPUS)], GPUS[i % len(GPUS)])]


def _structs(target, hq, hkv, d, ps, dtype, tokens):
    sh = NamedSharding(Mesh(np.array(compile_only_devices(target)), ("x",)), P())
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    pages = s((NUM_PAGES, ps, hkv * d), dtype)  # [N, page_size, Hkv * D]
    return dict(q=s((tokens, hq, d), dtype), pages=pages, kv_lens=s((NUM_SEQS,), jnp.int32),
                table=s((NUM_SEQS, PAGES_PER_SEQ), jnp.int32),
                cu_q_lens=s((NUM_SEQS + 1,), jnp.int32), num_seqs=s((1,), jnp.int32),
                sinks=s((hq,), jnp.float32))


def _compile(fn, target, *args, **kwargs):
    lowered = jax.jit(fn).trace(*args, **kwargs).lower(
        lowering_platforms=(target.lowering_platform,))
    compiled = lowered.compile()
    text = lowered.as_text()
    assert ("tpu_custom_call" if target.platform == "tpu" else "triton") in text
    return compiled


def pool_copies(compiled, pools) -> int:
    """Copy instructions of any of `pools` (arrays with shardings) in a compiled program."""
    return pool_instructions(compiled.as_text(), PagePools.exactly(pools)).count("copy")


@pytest.mark.parametrize("target,shape", CASES,
                         ids=[f"{t.accelerator}-{i // 2}" for i, (t, _) in enumerate(CASES)])
def test_kernels_compile(target, shape):
    hq, hkv, d, ps, dtype, soft_cap, window, sinks = shape
    opts = dict(soft_cap=soft_cap, sliding_window=window)
    a = _structs(target, hq, hkv, d, ps, dtype, NUM_SEQS)
    sinks = a["sinks"] if sinks else None  # [Hq] float32
    decode = _compile(lambda *x, sinks: pk.paged_attention(*x, sinks=sinks, **opts), target,
                      a["q"], a["pages"], a["pages"], a["kv_lens"], a["table"], sinks=sinks)
    # every grid row (kv heads x head_dim) is a multiple of 128: no relayout of the pool
    assert pool_copies(decode, [a["pages"]]) == 0
    # the output buffer is at least [B, Hq, D] (TPU tiling may pad it)
    assert decode.memory_analysis().output_size_in_bytes >= NUM_SEQS * hq * d * jnp.dtype(
        dtype).itemsize
    a = _structs(target, hq, hkv, d, ps, dtype, TOKENS)
    ragged = _compile(lambda *x, sinks: pk.ragged_paged_attention(*x, sinks=sinks, **opts),
                      target, a["q"], a["pages"], a["pages"], a["kv_lens"], a["table"],
                      a["cu_q_lens"], a["num_seqs"], sinks=sinks)
    assert pool_copies(ragged, [a["pages"]]) == 0


def test_gpu_decode_compiles_with_sinks_in_the_kernel():
    """A batch that fills the card runs the GPU decode kernel unsplit, which then adds the
    sinks itself (`gpu_decode`; split-K batches, as test_kernels_compile's, add them in the
    combine pass): gpt-oss's heads, 64 query heads of 64 on 8 kv heads, batch 64."""
    target = Target("gpu", "h100", 1)
    sh = NamedSharding(Mesh(np.array(compile_only_devices(target)), ("x",)), P())
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    pages = s((NUM_PAGES, 16, 8 * 64), jnp.bfloat16)
    lowered = jax.jit(lambda *x, sinks: pk.paged_attention(*x, sinks=sinks, sliding_window=128)
                      ).trace(s((64, 64, 64), jnp.bfloat16), pages, pages,
                              s((64,), jnp.int32), s((64, PAGES_PER_SEQ), jnp.int32),
                              sinks=s((64,), jnp.float32)).lower(lowering_platforms=("cuda",))
    lowered.compile()
    call = next(line for line in lowered.as_text().splitlines() if "gpu.triton" in line)
    assert "tensor<8x16xf32>" in call  # each kv head's 8 sinks, padded to 16 rows


ENGINE_TARGETS = [Target("tpu", "v5e", 1), Target("tpu", "v6e", 1), Target("gpu", "h200", 1)]


@pytest.mark.parametrize("target", ENGINE_TARGETS, ids=lambda t: t.accelerator)
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (4, 1, 128), (8, 2, 64), (32, 8, 64)])
def test_decode_compiles_at_engine_shapes_without_copying_the_cache(target, hq, hkv, d):
    """Batch 64, a table as wide as max_model_len 32k (2048 pages of 16), bfloat16: head_dim
    128 with 8 kv heads or 1 (an 8B model on 1 or 8 devices), head_dim 64 with 2 or 8 (a 1B
    model on 4 devices or 1). The decode kernel compiles, and the program's temporaries stay
    far below the cache: no relayout copy of the pages (XLA:TPU laid the former `[N,
    page_size, Hkv, 64]` pools out pages-minor and copied them whole on every call)."""
    batch, pages_per_seq, num_pages = 64, 2048, 8193
    sh = NamedSharding(Mesh(np.array(compile_only_devices(target)), ("x",)), P())
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    pages = s((num_pages, 16, hkv * d), jnp.bfloat16)
    compiled = _compile(pk.paged_attention, target, s((batch, hq, d), jnp.bfloat16), pages,
                        pages, s((batch,), jnp.int32), s((batch, pages_per_seq), jnp.int32))
    cache_bytes = 2 * num_pages * 16 * hkv * d * 2
    assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes // 16
    assert pool_copies(compiled, [pages]) == 0  # no relayout


@pytest.mark.parametrize("batch,decode_grid,combine_grid", [
    (1, [1, 8, 32], [1, 8, 4]), (64, [64, 8, 1], None)])
def test_decode_launches_at_llama_8b_heads(batch, decode_grid, combine_grid):
    """An H100 compile of one decode call (32 query heads over 8 kv heads of 128, pages of
    16): batch 1 runs 32 splits per kv head (256 programs for 132 SMs) and one combine
    kernel over the 4 query heads of each kv head, 4 launches in all (the key ranges, q's
    pad, the two kernels; the former combine in XLA fusions made 6); batch 64 fills the card
    unsplit, with no combine."""
    launches = gpu_kernels.decode_launches("h100", batch, 32, 8, 128, 16, 32768)
    grids = {k["name"]: k["grid"] for k in launches}
    assert grids["decode_attention_triton"] == decode_grid
    assert grids.get("decode_combine_triton") == combine_grid
    assert len(launches) == 4


# Rows under 128 lanes on TPU (one kv head of 64 per device; 3 heads of 64): stored one token a
# row, XLA lays the pool out pages-minor and copies it on every call; two tokens a row
# (`kv_quant.tokens_per_row`) make the row lane-dense and the kernels read it in place.
FOLD_CASES = [  # (generation, page dtype, Hq, Hkv, page_size)
    ("v6e", jnp.bfloat16, 4, 1, 64),
    ("v5e", jnp.bfloat16, 4, 1, 16),
    ("v5e", jnp.bfloat16, 6, 3, 64),
    ("v6e", jnp.int8, 4, 1, 64),
    ("v6e", jnp.int8, 4, 1, 16),  # [8, 128] int8 pages: fewer rows than an int8 tile's 32
    ("v5e", jnp.float8_e4m3fn, 4, 1, 16),
]


@pytest.mark.parametrize("generation,dtype,hq,hkv,page_size", FOLD_CASES,
                         ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-hkv{c[3]}-ps{c[4]}"
                              for c in FOLD_CASES])
def test_folded_rows_compile_without_copying_the_cache(generation, dtype, hq, hkv, page_size):
    target = Target("tpu", generation, 1)
    sh = NamedSharding(Mesh(np.array(compile_only_devices(target)), ("x",)), P())
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    d, q_dtype = 64, jnp.bfloat16
    stride = kv_quant.scale_stride(page_size, hkv)
    scales = [s((QUANT_PAGES, hkv * stride), jnp.float32)] * 2 if dtype == jnp.int8 else []
    copies = {}
    for fold in (1, kv_quant.tokens_per_row(page_size, hkv, d)):
        pages = s(kv_quant.page_shape(QUANT_PAGES, page_size, hkv, d, fold), dtype)
        compiled = _compile(
            lambda q, k, v, lens, t, cu, n, *x: pk.ragged_paged_attention(
                q, k, v, lens, t, cu, n, page_size=page_size,
                **dict(zip(("k_scales", "v_scales"), x))),
            target, s((TOKENS, hq, d), q_dtype), pages, pages, s((NUM_SEQS,), jnp.int32),
            s((NUM_SEQS, PAGES_PER_SEQ), jnp.int32), s((NUM_SEQS + 1,), jnp.int32),
            s((1,), jnp.int32), *scales)
        copies[fold] = pool_copies(compiled, [pages])
    assert copies == {1: 2, 2: 0}  # K and V copied one token a row; neither folded


def test_int8_scale_runs_padded_on_tpu_are_not_copied():
    """One kv head of 128 with pages of 64: a 64-float scale row is laid out pages-minor and
    both scale pools are copied per call (a copy memory_analysis counts as no temporaries);
    the run padded to 128 floats (`kv_quant.scale_stride`) is read in place."""
    target = Target("tpu", "v6e", 1)
    sh = NamedSharding(Mesh(np.array(compile_only_devices(target)), ("x",)), P())
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    page_size, d = 64, 128
    pages = s(kv_quant.page_shape(QUANT_PAGES, page_size, 1, d), jnp.int8)
    copies = {}
    for stride in (page_size, kv_quant.scale_stride(page_size, 1)):
        scales = s((QUANT_PAGES, stride), jnp.float32)
        compiled = _compile(lambda q, k, v, lens, t, ks, vs: pk.paged_attention(
            q, k, v, lens, t, k_scales=ks, v_scales=vs), target,
            s((NUM_SEQS, 4, d), jnp.bfloat16), pages, pages, s((NUM_SEQS,), jnp.int32),
            s((NUM_SEQS, PAGES_PER_SEQ), jnp.int32), scales, scales)
        copies[stride] = pool_copies(compiled, [scales])
    assert copies == {64: 2, 128: 0}


# Quantized pages at engine-like shapes: bfloat16 q, head_dim 128, pages of 64 on TPU (8 kv
# heads and 1: int8 scale rows of 512 and of 64 floats) and of 16 on GPU. Each kind on each
# TPU generation and on two GPUs (A100 has no fp8 conversions: the GPU kernels decode fp8
# bytes with integer ops).
QUANT_CASES = [  # (target, kind, Hq, Hkv, page_size, head_dim)
    (Target("tpu", "v5e", 1), "int8", 32, 8, 64, 128),
    (Target("tpu", "v6e", 1), "int8", 4, 1, 64, 128),
    (Target("tpu", "v6e", 1), "fp8", 32, 8, 64, 128),
    (Target("tpu", "v5e", 1), "fp8", 4, 1, 64, 128),
    (Target("tpu", "v6e", 1), "int8", 8, 2, 64, 128),  # 2 heads: once laid out heads-minor
    (Target("tpu", "v5e", 1), "int8", 8, 2, 64, 64),  # head_dim 64: lanes 64-127 sliced
    (Target("gpu", "h200", 1), "int8", 32, 8, 16, 128),
    (Target("gpu", "h100", 1), "fp8", 32, 8, 16, 128),
    (Target("gpu", "a100-80g", 1), "fp8", 32, 8, 16, 128),
]
QUANT_PAGES = 4096  # a pool large enough that a copy of it would show in the temporaries


@pytest.mark.parametrize("target,kind,hq,hkv,page_size,d",
                         sweep(QUANT_CASES, keep={1, 3, 4, 5, 6, 7, 8}),  # hkv 8 on TPU: slow
                         ids=[f"{c[0].accelerator}-{c[1]}-hkv{c[3]}-d{c[5]}" for c in QUANT_CASES])
def test_quantized_pages_compile(target, kind, hq, hkv, page_size, d):
    """int8 pages with their scales and fp8 pages: both kernels compile, and their
    temporaries stay far below the cache: no dequantized or relaid-out copy of the pages,
    nor of the int8 scale pools (whose heads' runs are padded on TPU where a row would be
    under 128 floats, `kv_quant.scale_stride`: one kv head with pages of 64)."""
    sh = NamedSharding(Mesh(np.array(compile_only_devices(target)), ("x",)), P())
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    pages = s((QUANT_PAGES, page_size, hkv * d), jnp.int8 if kind == "int8" else
              jnp.float8_e4m3fn)
    stride = kv_quant.scale_stride(page_size, hkv, platform=target.platform)
    scales = [s((QUANT_PAGES, hkv * stride), jnp.float32)] * 2 if kind == "int8" else []
    table = s((NUM_SEQS, PAGES_PER_SEQ), jnp.int32)
    kv_lens = s((NUM_SEQS,), jnp.int32)
    cache_bytes = 2 * QUANT_PAGES * page_size * hkv * d

    def keywords(pools):
        return dict(zip(("k_scales", "v_scales"), pools))

    decode = _compile(lambda q, k, v, lens, t, *x: pk.paged_attention(q, k, v, lens, t,
                                                                       **keywords(x)),
                      target, s((NUM_SEQS, hq, d), jnp.bfloat16), pages, pages, kv_lens,
                      table, *scales)
    ragged = _compile(lambda q, k, v, lens, t, cu, n, *x: pk.ragged_paged_attention(
                          q, k, v, lens, t, cu, n, **keywords(x)),
                      target, s((TOKENS, hq, d), jnp.bfloat16), pages, pages, kv_lens, table,
                      s((NUM_SEQS + 1,), jnp.int32), s((1,), jnp.int32), *scales)
    for compiled in (decode, ragged):
        assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes // 16
        assert pool_copies(compiled, [pages]) == 0  # no relayout of pages
        assert pool_copies(compiled, scales) == 0  # nor scales
