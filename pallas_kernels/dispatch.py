"""The kernels' entry points and the choice of kernel per platform (the package docstring,
`pallas_kernels/__init__.py`, describes the API and the backends; it re-exports these)."""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import (gpu_decode, gpu_prefill, reference, tpu_decode, tpu_prefill,
                            validation)
from pallas_kernels import batch_rows
from pallas_kernels.kv_write import write_kv

__all__ = ["paged_attention", "ragged_paged_attention", "write_kv", "reference"]

BACKENDS = ("tpu", "gpu", "reference")
# The kernels run in interpret mode off TPU and GPU: the Triton ones, fewer and larger steps.
INTERPRET_BACKEND = "gpu"


def _platform_kernel(modules, backend, interpret, call):
    """The kernel `call(module, interpret)` of the module chosen by backend / interpret.

    modules: {"tpu": module, "gpu": module}. No backend and no interpret: picked when lowered
    (Mosaic on TPU, Triton on CUDA, INTERPRET_BACKEND interpreted elsewhere). A
    `pltpu.InterpretParams` is TPU interpret mode, so it implies (and needs) the TPU kernel.
    """
    tpu_params = not isinstance(interpret, bool) and interpret is not None
    if backend is None and not interpret:
        def dispatch(*args):
            return jax.lax.platform_dependent(
                *args, tpu=call(modules["tpu"], False), cuda=call(modules["gpu"], False),
                default=call(modules[INTERPRET_BACKEND], True))
        return dispatch
    if backend is None:
        backend = "tpu" if tpu_params else INTERPRET_BACKEND
    if tpu_params and backend != "tpu":
        raise ValueError(f"interpret={interpret!r} is TPU interpret mode; backend {backend!r} "
                         "takes interpret=True")
    return call(modules[backend], interpret or False)


def _prefill_fn(backend, interpret, **options):
    """Returns f(q [T, Hq, D], k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
    chunk_len, k_scales, v_scales, sinks) -> [T, Hq, D] for the prefill kernel (rows of no
    chunk: zeros; scales None unless the pages are int8; sinks [Hq] float or None)."""
    def call(module, run_interpret):
        return functools.partial(module.attention, interpret=run_interpret, **options)
    return _platform_kernel({"tpu": tpu_prefill, "gpu": gpu_prefill}, backend, interpret,
                            call)


def _decode_fn(backend, interpret, **options):
    """Returns f(q [B, Hkv, G, D], k_pages, v_pages, page_indices, key_lo, key_hi, k_scales,
    v_scales, sinks) -> [B, Hkv, G, D] for the decode kernel (scales None unless the pages
    are int8; sinks [Hq] float or None)."""
    def call(module, run_interpret):
        return functools.partial(module.attention, interpret=run_interpret, **options)
    return _platform_kernel({"tpu": tpu_decode, "gpu": gpu_decode}, backend, interpret, call)


def _decode(q, k_pages, v_pages, kv_lens, page_indices, dims, *, sm_scale, soft_cap,
            sliding_window, interpret, backend, k_scales, v_scales, sinks):
    """Decode kernel on q [B, Hq, D] (token b at kv_lens[b] - 1) -> [B, Hq, D]."""
    validation.check_table_covers(kv_lens, dims)
    kv_lens = jnp.minimum(kv_lens, dims.pages_per_seq * dims.page_size)  # [B]
    key_lo, key_hi = batch_rows.decode_key_ranges(kv_lens, sliding_window)  # [B] each
    kernel = _decode_fn(backend, interpret, sm_scale=sm_scale, soft_cap=soft_cap,
                        page_size=dims.page_size)
    batch = q.shape[0]
    q_packed = q.reshape(batch, dims.num_kv_heads, dims.group, dims.head_dim)  # [B, Hkv, G, D]
    out = kernel(q_packed, k_pages, v_pages, page_indices, key_lo, key_hi, k_scales, v_scales,
                 sinks)
    return out.reshape(q.shape)  # [B, Hq, D]


def _check_backend(backend):
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")


def paged_attention(q, k_pages, v_pages, kv_lens, page_indices, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, interpret=None, backend=None,
                    k_scales=None, v_scales=None, page_size=None, sinks=None):
    """Decode attention: one query token per sequence, at position kv_lens[b] - 1.

    q [B, Hq, D]; k_pages, v_pages [N, page_size / f, f * Hkv * D] in q's dtype, int8 or
    float8_e4m3fn (page_size None: the pages' rows, f = 1; `kv_quant.tokens_per_row`);
    k_scales, v_scales [N, Hkv * S] float32 for int8 pages only;
    kv_lens int32[B]; page_indices int32[B, P]. Returns [B, Hq, D] in q's dtype (float32
    softmax).
    sm_scale defaults to 1/sqrt(D); soft_cap: logits = c * tanh(logits / c);
    sliding_window W: keys j with pos - j < W only. kv_lens 0 gives zeros.
    sinks [Hq] float (gpt-oss's attention sinks): query head h's softmax denominator gets
    exp(sinks[h]) more, compared with the final (scaled, capped) scores; None: no sink.
    """
    _check_backend(backend)
    if backend == "reference":
        return reference.paged_attention(q, k_pages, v_pages, kv_lens, page_indices,
                                         sm_scale=sm_scale, soft_cap=soft_cap,
                                         sliding_window=sliding_window, k_scales=k_scales,
                                         v_scales=v_scales, page_size=page_size, sinks=sinks)
    dims = validation.check_decode(q, k_pages, v_pages, kv_lens, page_indices,
                                   k_scales=k_scales, v_scales=v_scales, page_size=page_size,
                                   sinks=sinks)
    validation.check_options(sm_scale, soft_cap, sliding_window)
    return _decode(q, k_pages, v_pages, kv_lens, page_indices, dims,
                   sm_scale=float(dims.head_dim**-0.5 if sm_scale is None else sm_scale),
                   soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret,
                   backend=backend, k_scales=k_scales, v_scales=v_scales, sinks=sinks)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                           *, sm_scale=None, soft_cap=None, sliding_window=None,
                           interpret=None, backend=None, q_block=None, k_scales=None,
                           v_scales=None, page_size=None, sinks=None):
    """Attention for a flat batch of prefill chunks and decode tokens.

    q [T, Hq, D]; kv_lens int32[S] (total kv length incl. this step's tokens,
    already written to the pages); page_indices int32[S, P]; cu_q_lens int32[S+1];
    num_seqs int32[1]. Query i of sequence s sits at kv_lens[s] - q_len[s] + i and
    attends causally. Rows past cu_q_lens[num_seqs] and sequences >= num_seqs are
    padding: their output rows are zeros. Returns [T, Hq, D] in q's dtype.
    q_block: query tokens per tile of the prefill kernel (default: 128 on TPU,
    `gpu_prefill.default_q_block` on GPU: 128 query rows). Sequences with one new token go
    to the decode kernel instead. Pages, scales and sinks as for `paged_attention`.
    """
    _check_backend(backend)
    if backend == "reference":
        return reference.ragged_paged_attention(
            q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
            k_scales=k_scales, v_scales=v_scales, page_size=page_size, sinks=sinks)
    dims = validation.check_ragged(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                   num_seqs, k_scales=k_scales, v_scales=v_scales,
                                   page_size=page_size, sinks=sinks)
    validation.check_options(sm_scale, soft_cap, sliding_window)
    if q_block is not None and q_block < 1:
        raise ValueError(f"q_block must be positive, got {q_block}")
    validation.check_table_covers(kv_lens, dims)
    num_tokens = q.shape[0]
    sm_scale = float(dims.head_dim**-0.5 if sm_scale is None else sm_scale)
    kv_lens = jnp.minimum(kv_lens, dims.pages_per_seq * dims.page_size)  # [S]
    rows = batch_rows.split_rows(cu_q_lens, num_seqs)
    prefill = _prefill_fn(backend, interpret, sm_scale=sm_scale, soft_cap=soft_cap,
                          sliding_window=sliding_window, q_block=q_block,
                          page_size=dims.page_size)
    out = prefill(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, rows.chunk_len,
                  k_scales, v_scales, sinks)  # [T, Hq, D], decode rows 0
    decode_token = jnp.minimum(cu_q_lens[:-1], num_tokens - 1)  # [S]
    decoded = _decode(q[decode_token], k_pages, v_pages,
                      jnp.where(rows.is_decode, kv_lens, 0), page_indices, dims,
                      sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                      interpret=interpret, backend=backend, k_scales=k_scales,
                      v_scales=v_scales, sinks=sinks)  # [S, Hq, D]
    return out.at[jnp.where(rows.is_decode, decode_token, num_tokens)].set(
        decoded, mode="drop")
