"""Attention over the paged KV cache: one interface, three backends, chosen once.

    make_backend(engine_config, model_config, mesh, num_pages, scan_layers, platform)

picks the backend from `EngineConfig.attention_backend`:
- "pallas" (`pallas.py`): the Pallas kernels of `pallas_kernels` — Mosaic on TPU, Triton on
  GPU. What "auto" picks on TPU and GPU.
- "cpu" (`cpu.py`, with `cpu_step.py`): plain jnp shaped for XLA:CPU.
  What "auto" picks on CPU; the only CPU-specific code in jaxserve.
- "reference" (`reference.py`): the pure-jnp oracle the others are tested against.

The runner builds a backend's `PagedAttention` for each traced step and each decode-loop step
(`for_step`) and passes it to the model, which calls it once per layer:
`attention(layer_index, q, k, v, layer_cache) -> (out, layer_cache)`. `backend.py` holds the
interface and what every backend shares (stacked-layer page offsets, the `shard_map` over
heads). The attention of the dense reference generator, with a contiguous cache and no
pages, is `jaxserve.reference.dense_attention`.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from jaxserve.attention.backend import AttentionBackend, PagedAttention, PagedBatch
from jaxserve.attention.cpu import CpuBackend
from jaxserve.attention.pallas import PallasBackend
from jaxserve.attention.reference import ReferenceBackend
from jaxserve.config.engine import EngineConfig
from jaxserve.config.window import WindowLayout
from jaxserve.model.config import ModelConfig

BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend for backend in (PallasBackend, CpuBackend, ReferenceBackend)}

__all__ = ["AttentionBackend", "PagedAttention", "PagedBatch", "BACKENDS", "backend_name",
           "make_backend"]


def backend_name(choice: str, platform: str) -> str:
    """The backend `choice` ("auto" or a name) means on `platform` ("cpu", "tpu", "gpu")."""
    if choice == "auto":
        return "cpu" if platform == "cpu" else "pallas"
    if choice not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {list(BACKENDS)}, got "
                         f"{choice!r}")
    return choice


def make_backend(config: EngineConfig, model: ModelConfig, mesh: Mesh, num_pages: int,
                 scan_layers: bool, platform: str | None = None,
                 window: WindowLayout | None = None) -> AttentionBackend:
    """The configured backend for a runner on `mesh`. `model` is the config as stored (kv
    heads maybe repeated); `platform`: where the programs will run (default: JAX's default
    backend); `window`: the window pool of hybrid KV memory, if any."""
    platform = platform or jax.default_backend()
    name = backend_name(config.attention_backend, platform)
    if config.enable_deterministic_inference and name != "cpu":
        raise ValueError("enable_deterministic_inference needs the cpu attention backend "
                         f"(attention_backend 'auto' on CPU, or 'cpu'); got {name!r} on "
                         f"{platform}: the Pallas kernels have no fixed-order mode yet")
    soft_cap = None if model.gemma is None else model.gemma.attn_logit_softcap
    return BACKENDS[name](page_size=config.page_size, windows=model.layer_windows,
                          soft_cap=soft_cap, mesh=mesh,
                          pages_per_layer=num_pages if scan_layers else None,
                          window_layers=() if window is None else window.layers,
                          fixed_order=config.enable_deterministic_inference,
                          window_pages_per_layer=(window.num_pages if scan_layers and window
                                                  else None))

