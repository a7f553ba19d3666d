"""The CPU backend: attention in plain jnp shaped for XLA:CPU (heads-major dots, a few rows'
pages gathered at a time), because Pallas interpret mode is far too slow to serve from.

A step's metadata is `cpu_step.plan_step` (which token is what, the masks), built once per
step. The decode loop gathers its rows' context once at the start and carries it
(`cpu_loop`), when the loop's rows' context fits `cpu_loop.MAX_CONTEXT_BYTES` and the layers
are a list; otherwise each loop step is a one-token-per-row step. Everything CPU-specific in
jaxserve lives in this backend.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pallas_kernels
from jaxserve.attention import cpu_loop, cpu_step
from jaxserve.attention.backend import AttentionBackend, PagedAttention, PagedBatch


@dataclasses.dataclass(frozen=True)
class CpuBackend(AttentionBackend):
    """`context_bytes_per_token`: one token's K and V of all layers on one device."""

    context_bytes_per_token: int = 0
    name: ClassVar[str] = "cpu"

    def step_metadata(self, batch: PagedBatch) -> cpu_step.StepPlan:
        return cpu_step.plan_step(batch.slot_mapping.shape[0], batch.kv_lens,
                                  batch.page_indices, batch.cu_q_lens, batch.num_seqs,
                                  self.page_size, self.sliding_window)

    def attend(self, q, k, v, layer_cache, slots, page_indices, batch, metadata):
        if isinstance(metadata, cpu_loop.LoopStep):
            return cpu_loop.attend(q, k, v, layer_cache, slots, metadata)
        k_pages, v_pages = pallas_kernels.write_kv(*layer_cache, k, v, slots)
        out = cpu_step.ragged_attention(q, k, v, k_pages, v_pages, page_indices, metadata)
        return out, (k_pages, v_pages)

    def cache_head_axes(self, layer_cache) -> tuple[int, ...]:
        return (2, 2, 1, 1)[:len(layer_cache)]  # pages, then the loop's context

    def _carries_context(self, page_indices) -> bool:
        rows, pages_per_seq = page_indices.shape
        context = rows * pages_per_seq * self.page_size * self.context_bytes_per_token
        return self.pages_per_layer is None and context <= cpu_loop.MAX_CONTEXT_BYTES

    def begin_loop(self, caches, page_indices):
        if not self._carries_context(page_indices):
            return caches
        context = cpu_loop.gather_context(caches, page_indices, self.mesh)
        return [(*pages, *keys_values) for pages, keys_values in zip(caches, context)]

    def loop_step(self, batch: PagedBatch) -> PagedAttention:
        if not self._carries_context(batch.page_indices):
            return self.for_step(batch)
        width = batch.page_indices.shape[1] * self.page_size
        return PagedAttention(batch, cpu_loop.LoopStep.of(batch.kv_lens, width,
                                                          self.sliding_window), self)

    def end_loop(self, caches):
        if isinstance(caches, list) and len(caches[0]) == 4:  # drop the carried context
            return [layer_cache[:2] for layer_cache in caches]
        return caches
