"""The Pallas backend: the kernels of `pallas_kernels`, Mosaic on TPU and Triton on GPU (picked
when the program is lowered for its platform; elsewhere the Triton kernels in interpret mode,
slow but exact). The decode loop's steps (`PagedBatch.decode_only`) go straight to the decode
kernel (`paged_attention`); other steps to `ragged_paged_attention`, which itself sends their
one-token rows to the decode kernel. The kernels read the pages in place, so the decode loop
carries nothing but the cache and stacked layers need only the page offsets. Quantized
pages (`pallas_kernels.kv_quant`) are read as stored and dequantized inside the kernels.
The pages' rows may hold several tokens (TPU, `kv_quant.tokens_per_row`), so the write and
the kernels are told the page size. (Mixture-of-experts layers get TPU's grouped matmul
with this backend: `jaxserve.model.expert_placement`.)"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pallas_kernels
from jaxserve.attention.backend import AttentionBackend
from pallas_kernels import kv_quant


@dataclasses.dataclass(frozen=True)
class PallasBackend(AttentionBackend):
    name: ClassVar[str] = "pallas"

    def attend(self, q, k, v, layer_cache, slots, page_indices, batch, metadata, sinks,
               window):
        layer_cache = kv_quant.write(layer_cache, k, v, slots, self.page_size)
        k_pages, v_pages, *scales = layer_cache
        scaled = dict(zip(("k_scales", "v_scales"), scales),  # int8 pages only
                      page_size=self.page_size, soft_cap=self.soft_cap, sliding_window=window,
                      sinks=sinks)
        if batch.decode_only:
            out = pallas_kernels.paged_attention(
                q, k_pages, v_pages, batch.kv_lens, page_indices, **scaled)  # [S, Hq, D]
        else:
            out = pallas_kernels.ragged_paged_attention(
                q, k_pages, v_pages, batch.kv_lens, page_indices, batch.cu_q_lens,
                batch.num_seqs, **scaled)  # [T, Hq, D]
        return out, layer_cache
