"""The reference backend: the pure-jnp oracle of `pallas_kernels.reference`, the definition
the kernels and the CPU backend are tested against. Every query token gathers its whole page
table, so it is slow; use it to check results, not to serve. Quantized pages are
dequantized whole before it reads them (by the oracle itself): the definition of what a
quantized cache holds."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pallas_kernels
from pallas_kernels import kv_quant
from jaxserve.attention.backend import AttentionBackend


@dataclasses.dataclass(frozen=True)
class ReferenceBackend(AttentionBackend):
    name: ClassVar[str] = "reference"

    def attend(self, q, k, v, layer_cache, slots, page_indices, batch, metadata, sinks,
               window):
        layer_cache = kv_quant.write(layer_cache, k, v, slots, self.page_size)
        k_pages, v_pages, *scales = layer_cache
        out = pallas_kernels.reference.ragged_paged_attention(
            q, k_pages, v_pages, batch.kv_lens, page_indices, batch.cu_q_lens, batch.num_seqs,
            sliding_window=window, soft_cap=self.soft_cap, page_size=self.page_size, sinks=sinks,
            **dict(zip(("k_scales", "v_scales"), scales)))  # int8 pages only
        return out, layer_cache
