"""The block step both TPU kernels share: one copied K/V block folded into every kv head's
online softmax (float32 running max, sum and weighted sum in VMEM scratch)."""

import jax
import jax.numpy as jnp

from pallas_kernels.reference import MASK_VALUE


def attend_block(q_ref, k_buf, v_buf, slot, mask, key_valid, m_ref, l_ref, acc_ref, *,
                 sm_scale, soft_cap):
    """Folds K/V block `slot` into the running softmax of every kv head.

    q_ref [Hkv, R, D]; k_buf, v_buf [2, pages_per_block, page_size, (Hkv,) D] (no head axis:
    one kv head); mask [R or 1, KB] the keys each row sees; key_valid [KB, 1] keys in range
    (V rows outside it are zeroed: stale VMEM may hold anything); m_ref, l_ref [Hkv, R, 1],
    acc_ref [Hkv, R, D] float32.
    """
    squeezed = len(k_buf.shape) == 4
    block_keys = k_buf.shape[1] * k_buf.shape[2]
    for h in range(q_ref.shape[0]):
        if squeezed:
            k = k_buf[slot].reshape(block_keys, -1)  # [KB, D]
            v = v_buf[slot].reshape(block_keys, -1)  # [KB, D]
        else:
            k = k_buf[slot, :, :, h, :].reshape(block_keys, -1)  # [KB, D]
            v = v_buf[slot, :, :, h, :].reshape(block_keys, -1)  # [KB, D]
        v = jnp.where(key_valid, v, jnp.zeros_like(v))
        scores = jax.lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * sm_scale  # [R, KB]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(mask, scores, MASK_VALUE)
        m_prev = m_ref[h]  # [R, 1]
        m_new = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))  # [R, 1]
        p = jnp.where(mask, jnp.exp(scores - m_new), 0.0)  # [R, KB]
        alpha = jnp.exp(m_prev - m_new)  # [R, 1]
        l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
        acc_ref[h] = alpha * acc_ref[h] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32)  # [R, D]
        m_ref[h] = m_new
