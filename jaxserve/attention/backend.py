"""The attention backend interface: what the runner asks of a backend, and the callable the
model receives.

A backend is built once per runner (`jaxserve.attention.make_backend`). Inside a traced
program the runner hands it the step's `PagedBatch` and gets back a `PagedAttention`, the
model's `AttentionFn`; every layer calls it with its q, k, v and layer cache. The common part
lives here: the stacked-layer page offsets and the `shard_map` over the "model" axis (each
device attends its own heads; the kernels never see the mesh). A backend supplies
- `step_metadata(batch)`: its per-step pytree, built once per step rather than per layer;
- `attend(...)`: write this step's K/V into the pages and attend, on one device's heads,
  with the layer's sliding window (`window_of`: layers may differ, as in Gemma), the
  model's score cap (`soft_cap`, Gemma 2) and the layer's attention sinks (gpt-oss: a
  logit per query head that joins the softmax's denominator; the model passes them).
The decode loop calls `for_step` once per loop step, with one token per row.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import sharding
from jaxserve.model.llama import StackedLayer, layer_position
from pallas_kernels import kv_quant


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedBatch:
    """What attention needs of a step: a flat ragged batch of T tokens from S sequences."""

    slot_mapping: jax.Array  # [T] int32 page * page_size + offset, -1 for padding tokens
    kv_lens: jax.Array  # [S] int32 cached tokens after this step (0: padding row)
    page_indices: jax.Array  # [S, P] int32 each row's page table
    cu_q_lens: jax.Array  # [S + 1] int32 row s's tokens are [cu_q_lens[s], cu_q_lens[s+1])
    num_seqs: jax.Array  # [1] int32 real rows
    # Known when the program is traced: token s is row s's one new token (T = S), as in the
    # decode loop, so a backend may use a decode kernel without looking at cu_q_lens.
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # hybrid KV memory (`jaxserve.engine.window_pages`): the window layers' slots [T] and
    # page tables [S, P] into their own pool; None without it
    window_slot_mapping: jax.Array | None = None
    window_page_indices: jax.Array | None = None

    @property
    def real_tokens(self) -> jax.Array:
        """`[T]` bool: the step's tokens that are not padding (what expert load counts).
        Padding tokens have slot -1, except warm-up's, which all write page 0 but lie past
        the real rows' tokens."""
        real = jnp.arange(self.slot_mapping.shape[0]) < self.cu_q_lens[self.num_seqs[0]]
        return real & (self.slot_mapping >= 0)


def layer_window(windows: tuple[int | None, ...], layer_index) -> int | None:
    """Layer `layer_index`'s window among `windows` (one per layer, or one for all); a
    `StackedLayer` has its stack's."""
    if len(set(windows)) == 1:
        return windows[0]
    return windows[layer_position(layer_index)]


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One way to attend over the paged cache (subclasses: pallas, cpu, reference).

    `windows`: each layer's sliding window (None: the whole context); one entry stands for
    every layer. `soft_cap`: scores become `soft_cap * tanh(score / soft_cap)` (None: as
    they are). `pages_per_layer`: with stacked layers (`StackedLayer`) each stack's cache
    is one pool of its layers' pages, group g's at `[g * pages_per_layer, (g + 1) *
    pages_per_layer)`; None: per-layer caches only. `window_layers`: the layers whose pages
    are in the window pool (hybrid KV memory, `jaxserve.engine.window_pages`), addressed by
    the batch's window tables; a stack of them has `window_pages_per_layer` a layer.
    `fixed_order` (`enable_deterministic_inference`): each token's sums in an order that
    nothing else in the step changes.
    """

    page_size: int
    windows: tuple[int | None, ...] = (None,)
    soft_cap: float | None = None
    mesh: Mesh | None = None
    pages_per_layer: int | None = None
    window_layers: tuple[int, ...] = ()
    window_pages_per_layer: int | None = None
    fixed_order: bool = False  # deterministic inference: batch-invariant sums (cpu only)
    name: ClassVar[str] = ""

    # ---- what a backend provides ---------------------------------------------------------
    def step_metadata(self, batch: PagedBatch) -> Any:
        """Per-step arrays shared by every layer (traced); None if the backend needs none."""
        return None

    def attend(self, q, k, v, layer_cache, slots, page_indices, batch: PagedBatch, metadata,
               sinks, window: int | None):
        """With sliding window `window` and sinks `[Hq]` float32 (or None), on one device's
        heads: q `[T, Hq, D]`, k/v
        `[T, Hkv, D]`, layer_cache `(k_pages, v_pages)` `[N, page_size / f, f * Hkv * D]`
        (f tokens a row on TPU, `kv_quant.tokens_per_row`; `page_size` says f), with
        `(k_scales, v_scales)` `[N, Hkv * S]` after them for int8 pages
        (`pallas_kernels.kv_quant`); `slots [T]` and `page_indices [S, P]` already address
        this layer's pages → (out `[T, Hq, D]`,
        new layer cache)."""
        raise NotImplementedError

    # ---- common ---------------------------------------------------------------------------
    @property
    def distinct_windows(self) -> tuple[int | None, ...]:
        """The windows layers use, each once, in order of first use."""
        return tuple(dict.fromkeys(self.windows))

    def window_of(self, layer_index) -> int | None:
        return layer_window(self.windows, layer_index)

    def for_step(self, batch: PagedBatch) -> "PagedAttention":
        return PagedAttention(batch, self.step_metadata(batch), self)

    def layer_pages(self, layer_index, batch: PagedBatch):
        """Slots `[T]` and page tables `[S, P]` addressing layer `layer_index`'s pages."""
        slot_mapping, page_indices = batch.slot_mapping, batch.page_indices
        in_window_pool = layer_position(layer_index) in self.window_layers
        if in_window_pool:
            slot_mapping, page_indices = batch.window_slot_mapping, batch.window_page_indices
        if not isinstance(layer_index, StackedLayer):
            return slot_mapping, page_indices
        pages = self.window_pages_per_layer if in_window_pool else self.pages_per_layer
        first_page = layer_index.group * pages
        slots = jnp.where(slot_mapping < 0, -1, slot_mapping + first_page * self.page_size)
        return slots, page_indices + first_page


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedAttention:
    """The model's `AttentionFn` for one step: `(layer_index, q, k, v, layer_cache,
    sinks=None) -> (out, layer_cache)`, tokens a flat ragged batch `[T]`."""

    batch: PagedBatch
    metadata: Any
    backend: AttentionBackend = dataclasses.field(metadata=dict(static=True))

    def __call__(self, layer_index, q, k, v, layer_cache, sinks=None):
        if kv_quant.has_head_scales(layer_cache[0].dtype):
            return self._head_scaled(layer_index, q, k, v, layer_cache, sinks)
        return self._attend(layer_index, q, k, v, layer_cache, sinks)

    def _attend(self, layer_index, q, k, v, layer_cache, sinks=None):
        backend = self.backend
        slots, page_indices = backend.layer_pages(layer_index, self.batch)
        local = functools.partial(backend.attend, window=backend.window_of(layer_index))
        if backend.mesh is not None:
            cache_dims = (2, 2, 1, 1)[:len(layer_cache)]  # pages: heads on 2; scales on 1
            #            q  k  v  cache       slots, page tables, batch, metadata, sinks
            head_dims = (1, 1, 1, cache_dims, None, None, None, None, 0)
            local = sharding.shard_over_heads(local, backend.mesh, head_dims, (1, cache_dims))
        return local(q, k, v, tuple(layer_cache), slots, page_indices, self.batch,
                     self.metadata, sinks)  # out [T, Hq, D]

    def _head_scaled(self, layer_index, q, k, v, layer_cache, sinks=None):
        """fp8 pages with a scale per kv head (`kv_quant`): calibrated here if not yet, then
        applied around the backend's attention, which sees plain fp8 pages."""
        k_pages, v_pages, k_scales, v_scales = layer_cache
        stacked = isinstance(layer_index, StackedLayer)  # scales [groups, Hkv]
        group = layer_index.group if stacked else None
        valid = self.batch.real_tokens  # [T]
        k_scale, v_scale = (kv_quant.calibrate(s[group] if stacked else s, x, valid)
                            for s, x in ((k_scales, k), (v_scales, v)))  # [Hkv] each
        out, (k_pages, v_pages) = kv_quant.head_scaled_attention(
            lambda *qkv: self._attend(layer_index, *qkv, (k_pages, v_pages), sinks), q, k, v,
            k_scale, v_scale)
        if stacked:
            k_scale = k_scales.at[group].set(k_scale)
            v_scale = v_scales.at[group].set(v_scale)
        return out, (k_pages, v_pages, k_scale, v_scale)
