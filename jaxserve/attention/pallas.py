"""The Pallas backend: `pallas_kernels.ragged_paged_attention`, the Mosaic kernel on TPU and
the Triton kernel on GPU (picked when the program is lowered for its platform; elsewhere the
Triton kernel in interpret mode, slow but exact). It reads the pages in place, so the decode
loop carries nothing but the cache and stacked layers need only the page offsets."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pallas_kernels
from jaxserve.attention.backend import AttentionBackend


@dataclasses.dataclass(frozen=True)
class PallasBackend(AttentionBackend):
    name: ClassVar[str] = "pallas"

    def attend(self, q, k, v, layer_cache, slots, page_indices, batch, metadata):
        k_pages, v_pages = pallas_kernels.write_kv(*layer_cache, k, v, slots)
        out = pallas_kernels.ragged_paged_attention(
            q, k_pages, v_pages, batch.kv_lens, page_indices, batch.cu_q_lens, batch.num_seqs,
            sliding_window=self.sliding_window)
        return out, (k_pages, v_pages)
