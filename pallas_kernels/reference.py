"""Pure-jnp reference implementations: the oracle for every kernel test.

Same signatures and semantics as the public kernels (minus backend selection).
They gather each sequence's pages into a contiguous K/V, build the causal /
sliding-window / length mask explicitly and take a float32 softmax, trading
memory (O(tokens x context)) for obviousness. Rows that attend to no key
(kv_len 0, padding tokens, padding sequences) come out as zeros. Attention sinks (gpt-oss,
`sinks` [Hq]) are taken as transformers takes them: one more logit per head, after the keys'
(scaled, capped and masked) scores, in the softmax, whose weight is then dropped. Pages `[N,
page_size / f, f * Hkv * D]` are viewed as `[N, page_size, Hkv, D]` and quantized ones
(`kv_quant`) are dequantized whole, to q's dtype, before anything else: the kernels
dequantize each tile they load with the same rounding.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant, validation

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# float32 products at full precision: XLA:GPU's default for float32 is TF32 (errors ~1e-3), which
# would make the oracle, not the kernel, the inexact side.
EXACT = jax.lax.Precision.HIGHEST


def _attend(q, k, v, q_pos, kv_len, sm_scale, soft_cap, sliding_window, sinks):
    """Masked softmax attention of tokens against their own sequence's keys.

    q [T, Hq, D]; k, v [T, L, Hkv, D] (per-token copy of its sequence's keys);
    q_pos int32[T] (position of each query; -1 or less attends to nothing);
    kv_len int32[T]; sinks [Hq] or None. Returns [T, Hq, D] float32.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)  # [T, Hkv, G, D]
    logits = jnp.einsum("thgd,tkhd->thgk", qg, k.astype(jnp.float32),
                        precision=EXACT) * sm_scale  # [T, Hkv, G, L]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    key_pos = jnp.arange(num_keys)[None, :]  # [1, L]
    mask = (key_pos <= q_pos[:, None]) & (key_pos < kv_len[:, None])  # [T, L]
    if sliding_window is not None:
        mask &= q_pos[:, None] - key_pos < sliding_window
    mask = mask[:, None, None, :]  # [T, 1, 1, L]
    logits = jnp.where(mask, logits, MASK_VALUE)
    if sinks is not None:  # the sink as one more key, always visible: [T, Hkv, G, L + 1]
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1),
                                (num_tokens, num_kv_heads, group, 1))
        logits = jnp.concatenate([logits, sink], axis=-1)
        mask = jnp.concatenate([jnp.broadcast_to(mask, sink.shape[:3] + (num_keys,)),
                                jnp.ones_like(sink, bool)], axis=-1)
    # [T, Hkv, G, L (+ 1)]
    weights = jnp.where(mask, jnp.exp(logits - logits.max(-1, keepdims=True)), 0.0)
    denom = weights.sum(-1, keepdims=True)  # [T, Hkv, G, 1]
    weights = weights / jnp.where(denom == 0, 1.0, denom)
    if sinks is not None:
        weights = weights[..., :num_keys]  # the sink's weight has no value
    out = jnp.einsum("thgk,tkhd->thgd", weights, v.astype(jnp.float32),
                     precision=EXACT)  # [T, Hkv, G, D]
    return out.reshape(num_tokens, num_q_heads, head_dim)


def _gather_seq(pages, page_indices):
    """pages [N, page_size, Hkv, D], page_indices [S, P] -> [S, P * page_size, Hkv, D]."""
    num_seqs, pages_per_seq = page_indices.shape
    _, page_size, num_kv_heads, head_dim = pages.shape
    return pages[page_indices].reshape(
        num_seqs, pages_per_seq * page_size, num_kv_heads, head_dim
    )


def _dequantize(q, k_pages, v_pages, k_scales, v_scales, page_size):
    """The page pools `[N, page_size / f, f * Hkv * D]` as q.dtype values `[N, page_size,
    Hkv, D]` (`kv_quant.dequantize_pages`); pages in q's dtype as they are."""
    head_dim = q.shape[-1]
    return (kv_quant.dequantize_pages(k_pages, head_dim, k_scales, q.dtype, page_size),
            kv_quant.dequantize_pages(v_pages, head_dim, v_scales, q.dtype, page_size))


def paged_attention(q, k_pages, v_pages, kv_lens, page_indices, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, interpret=None, k_scales=None,
                    v_scales=None, page_size=None, sinks=None):
    """Decode reference. q [B, Hq, D] -> [B, Hq, D]; `interpret` is ignored. k_scales,
    v_scales [N, Hkv * S] float32: int8 pages' scales (`kv_quant`); sinks [Hq] float: each
    query head's attention sink (None: none)."""
    del interpret
    dims = validation.check_decode(q, k_pages, v_pages, kv_lens, page_indices,
                                   kernel_limits=False, k_scales=k_scales, v_scales=v_scales,
                                   page_size=page_size, sinks=sinks)
    validation.check_options(sm_scale, soft_cap, sliding_window)
    k_pages, v_pages = _dequantize(q, k_pages, v_pages, k_scales, v_scales, dims.page_size)
    sm_scale = dims.head_dim**-0.5 if sm_scale is None else sm_scale
    k = _gather_seq(k_pages, page_indices)  # [B, L, Hkv, D]
    v = _gather_seq(v_pages, page_indices)  # [B, L, Hkv, D]
    out = _attend(q, k, v, kv_lens - 1, kv_lens, sm_scale, soft_cap, sliding_window, sinks)
    return out.astype(q.dtype)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                           num_seqs, *, sm_scale=None, soft_cap=None,
                           sliding_window=None, interpret=None, k_scales=None, v_scales=None,
                           page_size=None, sinks=None):
    """Mixed prefill/decode reference. q [T, Hq, D] -> [T, Hq, D]; `interpret` is ignored.
    k_scales, v_scales [N, Hkv * S] float32: int8 pages' scales (`kv_quant`); sinks [Hq]
    float: each query head's attention sink (None: none)."""
    del interpret
    dims = validation.check_ragged(
        q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kernel_limits=False,
        k_scales=k_scales, v_scales=v_scales, page_size=page_size, sinks=sinks)
    validation.check_options(sm_scale, soft_cap, sliding_window)
    k_pages, v_pages = _dequantize(q, k_pages, v_pages, k_scales, v_scales, dims.page_size)
    sm_scale = dims.head_dim**-0.5 if sm_scale is None else sm_scale
    num_tokens = q.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    seq = jnp.searchsorted(cu_q_lens[1:], token, side="right").astype(jnp.int32)  # [T]
    valid = token < cu_q_lens[num_seqs[0]]  # [T]
    seq = jnp.where(valid, jnp.minimum(seq, kv_lens.shape[0] - 1), 0)  # [T]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]  # [T]
    q_pos = kv_lens[seq] - q_len + token - cu_q_lens[seq]  # [T]
    q_pos = jnp.where(valid, q_pos, -1)  # [T]
    k = _gather_seq(k_pages, page_indices)[seq]  # [T, L, Hkv, D]
    v = _gather_seq(v_pages, page_indices)[seq]  # [T, L, Hkv, D]
    out = _attend(q, k, v, q_pos, kv_lens[seq], sm_scale, soft_cap, sliding_window, sinks)
    return out.astype(q.dtype)


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, page_size=None):
    """Reference KV write: token t goes to flat slot slot_mapping[t]; slots < 0 are skipped.

    k_pages, v_pages [N, page_size / f, f * Hkv * D] (page_size None: f = 1); k_new, v_new
    [T, Hkv, D]; slot_mapping int32[T]. Returns the updated (k_pages, v_pages).
    """
    num_pages, rows, width = k_pages.shape
    page_size = rows if page_size is None else page_size
    head_dim = k_new.shape[-1]

    def write(pages, new):
        by_token = kv_quant.page_heads(jnp.asarray(pages), head_dim, page_size)
        flat = by_token.reshape(num_pages * page_size, *by_token.shape[2:])  # [N*ps, Hkv, D]
        for t in range(slot_mapping.shape[0]):
            slot = slot_mapping[t]
            idx = jnp.maximum(slot, 0)
            flat = flat.at[idx].set(jnp.where(slot >= 0, new[t].astype(flat.dtype), flat[idx]))
        return kv_quant.fold_heads(flat.reshape(by_token.shape), page_size // rows)

    return write(k_pages, k_new), write(v_pages, v_new)
