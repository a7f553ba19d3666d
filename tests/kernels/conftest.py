"""Shared helpers for the pallas_kernels tests (CPU, Pallas interpret mode).

Test files are named test_pallas_* so their basenames cannot clash with tests/test_*
(no __init__.py: pytest imports test modules by basename).
"""

import numpy as np
import pytest


class Case:
    """A random paged KV cache plus page tables, as numpy arrays."""

    def __init__(self, seed, *, num_q_heads, num_kv_heads, head_dim, page_size, num_seqs,
                 pages_per_seq, dtype=np.float32, spare_pages=3):
        rng = np.random.default_rng(seed)
        self.rng = rng
        num_pages = num_seqs * pages_per_seq + spare_pages
        shape = (num_pages, page_size, num_kv_heads * head_dim)  # heads packed (kv_quant)
        self.k_pages = rng.standard_normal(shape).astype(dtype)  # [N, page_size, Hkv * D]
        self.v_pages = rng.standard_normal(shape).astype(dtype)  # [N, page_size, Hkv * D]
        # Page 0 stays a padding page: real tables use distinct pages 1..N-1.
        perm = rng.permutation(np.arange(1, num_pages))[: num_seqs * pages_per_seq]
        self.page_indices = perm.reshape(num_seqs, pages_per_seq).astype(np.int32)  # [S, P]
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim, self.dtype = head_dim, dtype

    @property
    def tol(self):
        """assert_allclose tolerances vs the float32-softmax reference."""
        if np.dtype(self.dtype) == np.float32:
            return dict(atol=2e-5, rtol=2e-5)
        return dict(atol=3e-2, rtol=3e-2)

    def queries(self, num_tokens):
        q = self.rng.standard_normal((num_tokens, self.num_q_heads, self.head_dim))
        return q.astype(self.dtype)  # [T, Hq, D]

    def sinks(self):
        """Attention sinks [Hq] float32 around the largest scores (q.k / sqrt(D) of standard
        normal q and k is about N(0, 1): 2 to 3 at most over tens of keys), so each takes a
        good share of its head's weight (sum_j exp(s_j) is about 1.6 per key), except the
        last head's, 30, which takes nearly all (its outputs are about e^-27 of its values)."""
        sinks = self.rng.uniform(1.0, 4.0, self.num_q_heads).astype(np.float32)
        sinks[-1] = 30.0
        return sinks  # [Hq]


@pytest.fixture
def make_case():
    return Case
