"""Paged-attention kernels for jaxserve (imports only jax and numpy, and those only when a
kernel is used: `import pallas_kernels.limits` starts no jax).

Public API:
  paged_attention(q, k_pages, v_pages, kv_lens, page_indices, ...)      decode
  ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices,
                         cu_q_lens, num_seqs, ...)                       mixed prefill/decode
  write_kv(k_pages, v_pages, k_new, v_new, slot_mapping)                 cache update
  reference                                                              pure-jnp oracles

KV cache per layer: k_pages, v_pages [num_pages, page_size, num_kv_heads * head_dim] (a
token's kv heads packed along the last axis, lane-dense on TPU: `kv_quant.page_shape`; on TPU
f tokens may share a row, [num_pages, page_size / f, f * num_kv_heads * head_dim], and the
kernels then take `page_size=`: `kv_quant.tokens_per_row`), in q's dtype or quantized
(`kv_quant`): float8_e4m3fn, or int8 with k_scales, v_scales [num_pages, num_kv_heads * S]
float32 (each head's run S >= page_size floats: `kv_quant.scale_stride`). head_dim is q's.
Every kernel reads the stored bytes and dequantizes each K/V tile it loads (codes * scale,
rounded to q's dtype, as the reference).

Two kernels per platform: a decode kernel (`tpu_decode`, `gpu_decode`: one query token per
sequence, the G query heads of a kv head as one block) and a prefill kernel
(`tpu_prefill`, `gpu_prefill`: tiles of `q_block` consecutive tokens of the flat batch).
`paged_attention` is the decode kernel; `ragged_paged_attention` sends the rows with one new
token (decode rows, also a one-token prefill chunk) to the decode kernel and the longer
chunks to the prefill kernel, and merges the two by token (`batch_rows`).

Safety contract: page-table entries past a sequence's pages may hold anything (-1, ids past
the pool); no kernel reads them. A kv_len longer than the table covers
(P * page_size) is a ValueError when kv_lens is concrete at trace time; under jit it is
clamped to the table (the sequence attends to the keys its table holds).

Backend selection happens at lowering time through jax.lax.platform_dependent:
the Mosaic kernel on TPU, the Triton kernel on CUDA, and the Triton kernel in
Pallas interpret mode everywhere else (CPU). So `jax.export` for a platform
embeds that platform's kernel. Overrides: `interpret=True` runs the chosen
kernel in interpret mode on any platform; `backend="tpu" | "gpu"` forces that
kernel (compiled, unless interpret=True); `backend="reference"` uses the jnp
reference. interpret=False behaves like None (there is no compiled CPU kernel).
"""

import importlib

# the public API, defined in `dispatch` and imported on first use
_DISPATCH = ("paged_attention", "ragged_paged_attention", "write_kv", "BACKENDS",
             "INTERPRET_BACKEND")


def __getattr__(name: str):
    """`pallas_kernels.paged_attention` and friends, and submodules (`pk.reference`), imported
    when first asked for."""
    if name in _DISPATCH:
        return getattr(importlib.import_module("pallas_kernels.dispatch"), name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
