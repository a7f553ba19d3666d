"""Paged-attention kernels for jaxserve (imports only jax and numpy).

Public API:
  paged_attention(q, k_pages, v_pages, kv_lens, page_indices, ...)      decode
  ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices,
                         cu_q_lens, num_seqs, ...)                       mixed prefill/decode
  write_kv(k_pages, v_pages, k_new, v_new, slot_mapping)                 cache update
  reference                                                              pure-jnp oracles

KV cache per layer: k_pages, v_pages [num_pages, page_size, num_kv_heads, head_dim].

Backend selection happens at lowering time through jax.lax.platform_dependent:
the Mosaic kernel on TPU, the Triton kernel on CUDA, and the Triton kernel in
Pallas interpret mode everywhere else (CPU). So `jax.export` for a platform
embeds that platform's kernel. Overrides: `interpret=True` runs the chosen
kernel in interpret mode on any platform; `backend="tpu" | "gpu"` forces that
kernel (compiled, unless interpret=True); `backend="reference"` uses the jnp
reference. interpret=False behaves like None (there is no compiled CPU kernel).
"""

import jax

from pallas_kernels import gpu_paged_attention, reference, tpu_paged_attention, validation
from pallas_kernels import work_items as wi
from pallas_kernels.kv_write import write_kv

__all__ = ["paged_attention", "ragged_paged_attention", "write_kv", "reference"]

BACKENDS = ("tpu", "gpu", "reference")
INTERPRET_BACKEND = "gpu"  # In interpret mode ~2-5x faster than the TPU kernel (fewer grid steps).
DEFAULT_Q_BLOCK = 16  # Query tokens per work item in ragged batches (at most).
# A work item's packed query rows (q_block * G of head_dim) stay within this many bytes: the
# Triton kernel stages them in shared memory (A100: 163 KiB per block, with the K/V blocks).
QUERY_BLOCK_BYTES = 64 << 10


def default_q_block(group: int, head_dim: int, itemsize: int) -> int:
    """Query tokens per work item: DEFAULT_Q_BLOCK, halved while the item's rows
    (q_block * group of head_dim) exceed QUERY_BLOCK_BYTES."""
    q_block = DEFAULT_Q_BLOCK
    while q_block > 1 and q_block * group * head_dim * itemsize > QUERY_BLOCK_BYTES:
        q_block //= 2
    return q_block


def _kernel_fn(backend, interpret, **options):
    """Returns f(q [I, Hkv, R, D], k_pages, v_pages, page_indices, items) -> [I, Hkv, R, D]."""
    modules = {"tpu": tpu_paged_attention, "gpu": gpu_paged_attention}

    def run(name, run_interpret):
        def f(q, k_pages, v_pages, page_indices, items):
            return modules[name].attention(q, k_pages, v_pages, page_indices, items,
                                           interpret=run_interpret, **options)
        return f

    if backend is None and not interpret:
        def dispatch(*args):
            return jax.lax.platform_dependent(
                *args, tpu=run("tpu", False), cuda=run("gpu", False),
                default=run(INTERPRET_BACKEND, True))
        return dispatch
    return run(backend or INTERPRET_BACKEND, bool(interpret))


def _check_backend(backend):
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")


def paged_attention(q, k_pages, v_pages, kv_lens, page_indices, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, interpret=None, backend=None):
    """Decode attention: one query token per sequence, at position kv_lens[b] - 1.

    q [B, Hq, D]; k_pages, v_pages [N, page_size, Hkv, D]; kv_lens int32[B];
    page_indices int32[B, P]. Returns [B, Hq, D] in q's dtype (float32 softmax).
    sm_scale defaults to 1/sqrt(D); soft_cap: logits = c * tanh(logits / c);
    sliding_window W: keys j with pos - j < W only. kv_lens 0 gives zeros.
    """
    _check_backend(backend)
    if backend == "reference":
        return reference.paged_attention(q, k_pages, v_pages, kv_lens, page_indices,
                                         sm_scale=sm_scale, soft_cap=soft_cap,
                                         sliding_window=sliding_window)
    dims = validation.check_decode(q, k_pages, v_pages, kv_lens, page_indices)
    validation.check_options(sm_scale, soft_cap, sliding_window)
    batch = q.shape[0]
    kernel = _kernel_fn(
        backend, interpret, group=dims.group,
        sm_scale=float(dims.head_dim**-0.5 if sm_scale is None else sm_scale),
        soft_cap=soft_cap, sliding_window=sliding_window)
    q_packed = q.reshape(batch, dims.num_kv_heads, dims.group, dims.head_dim)  # [B, Hkv, G, D]
    items = wi.decode_items(kv_lens, sliding_window)
    out = kernel(q_packed, k_pages, v_pages, page_indices, items)  # [B, Hkv, G, D]
    return out.reshape(q.shape)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                           *, sm_scale=None, soft_cap=None, sliding_window=None,
                           interpret=None, backend=None, q_block=None):
    """Attention for a flat batch of prefill chunks and decode tokens.

    q [T, Hq, D]; kv_lens int32[S] (total kv length incl. this step's tokens,
    already written to the pages); page_indices int32[S, P]; cu_q_lens int32[S+1];
    num_seqs int32[1]. Query i of sequence s sits at kv_lens[s] - q_len[s] + i and
    attends causally. Rows past cu_q_lens[num_seqs] and sequences >= num_seqs are
    padding: their output rows are zeros. Returns [T, Hq, D] in q's dtype.
    q_block: query tokens per kernel work item (default: `default_q_block`).
    """
    _check_backend(backend)
    if backend == "reference":
        return reference.ragged_paged_attention(
            q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    dims = validation.check_ragged(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                   num_seqs)
    validation.check_options(sm_scale, soft_cap, sliding_window)
    if q_block is None:
        q_block = default_q_block(dims.group, dims.head_dim, q.dtype.itemsize)
    if q_block < 1:
        raise ValueError(f"q_block must be positive, got {q_block}")
    num_tokens = q.shape[0]
    kernel = _kernel_fn(
        backend, interpret, group=dims.group,
        sm_scale=float(dims.head_dim**-0.5 if sm_scale is None else sm_scale),
        soft_cap=soft_cap, sliding_window=sliding_window)
    items, row0, q_len = wi.ragged_items(kv_lens, cu_q_lens, num_seqs, num_tokens, q_block,
                                         sliding_window)
    q_packed, token = wi.pack_queries(q, row0, q_len, dims.num_kv_heads, q_block)
    out = kernel(q_packed, k_pages, v_pages, page_indices, items)  # [I, Hkv, q_block*G, D]
    return wi.unpack_outputs(out, token, num_tokens, q_block)
