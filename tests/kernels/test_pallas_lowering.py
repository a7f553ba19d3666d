"""Each kernel lowers for TPU (Mosaic) and CUDA (Triton) from this CPU machine via jax.export."""

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk

TRITON_CALL = "__gpu$xla.gpu.triton"
CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": TRITON_CALL}
OTHER_CALL = {"tpu": TRITON_CALL, "cuda": "tpu_custom_call"}
# Triton custom calls carry no export compatibility guarantee; allow them explicitly.
DISABLED = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]

HQ, HKV, D, PS, PAGES, MAX_SEQS, PPS = 32, 8, 128, 16, 256, 8, 16


def cache_structs(dtype):
    kv = jax.ShapeDtypeStruct((PAGES, PS, HKV * D), dtype)  # heads packed (kv_quant)
    table = jax.ShapeDtypeStruct((MAX_SEQS, PPS), jnp.int32)
    return kv, kv, jax.ShapeDtypeStruct((MAX_SEQS,), jnp.int32), table


def export_text(fn, platform):
    """Returns structs -> MLIR text of fn exported for `platform`."""
    export_fn = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=DISABLED)
    return lambda *structs: export_fn(*structs).mlir_module()


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_lowers(platform, dtype):
    q = jax.ShapeDtypeStruct((MAX_SEQS, HQ, D), dtype)
    text = export_text(lambda *a: pk.paged_attention(*a, soft_cap=30.0, sliding_window=64),
                       platform)(q, *cache_structs(dtype))
    assert CUSTOM_CALL[platform] in text
    assert OTHER_CALL[platform] not in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_lowers(platform, dtype):
    q = jax.ShapeDtypeStruct((64, HQ, D), dtype)
    cu_q_lens = jax.ShapeDtypeStruct((MAX_SEQS + 1,), jnp.int32)
    num_seqs = jax.ShapeDtypeStruct((1,), jnp.int32)
    text = export_text(pk.ragged_paged_attention, platform)(
        q, *cache_structs(dtype), cu_q_lens, num_seqs)
    assert CUSTOM_CALL[platform] in text
    assert OTHER_CALL[platform] not in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_write_kv_lowers_in_place(platform):
    k, v, _, _ = cache_structs(jnp.bfloat16)
    new = jax.ShapeDtypeStruct((64, HKV, D), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((64,), jnp.int32)
    exported = jax.export.export(jax.jit(pk.write_kv, donate_argnums=(0, 1)),
                                 platforms=[platform])(k, v, new, new, slots)
    text = exported.mlir_module()
    assert "stablehlo.scatter" in text
    assert "tf.aliasing_output" in text  # the donated caches alias the outputs


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_pages_reach_the_kernels_as_stored(platform, kind):
    """int8 pages (with their scales) and fp8 pages go into the kernels as they are stored
    (fp8 on CUDA: as its bytes, a bitcast): no dequantized copy of a pool in q's dtype."""
    page_dtype = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
    k, v, kv_lens, table = cache_structs(page_dtype)
    scales = jax.ShapeDtypeStruct((PAGES, HKV * PS), jnp.float32)
    q = jax.ShapeDtypeStruct((64, HQ, D), jnp.bfloat16)
    cu_q_lens = jax.ShapeDtypeStruct((MAX_SEQS + 1,), jnp.int32)
    num_seqs = jax.ShapeDtypeStruct((1,), jnp.int32)

    def attend(q, k, v, kv_lens, table, cu_q_lens, num_seqs, *pools):
        return pk.ragged_paged_attention(q, k, v, kv_lens, table, cu_q_lens, num_seqs,
                                         **dict(zip(("k_scales", "v_scales"), pools)))

    text = export_text(attend, platform)(q, k, v, kv_lens, table, cu_q_lens, num_seqs,
                                         *([scales] * 2 if kind == "int8" else []))
    # the stored pool, or its [N, page_size, Hkv, D] view (the GPU kernels' reshape)
    pools = (f"tensor<{PAGES}x{PS}x{HKV * D}x", f"tensor<{PAGES}x{PS}x{HKV}x{D}x")
    stored = {"int8": "i8>", "fp8": "ui8>" if platform == "cuda" else "f8E4M3FN>"}[kind]
    assert CUSTOM_CALL[platform] in text
    assert any(pool + stored in text for pool in pools)
    assert not any(pool + dtype in text for pool in pools for dtype in ("bf16>", "f32>"))
