"""What a forward gives the model and what it returns (`LlamaModel.__call__`), as two named
objects rather than keyword flags and a tuple whose length varies.

`StepContext` is everything a step hands the model besides tokens, positions and the cache:
the attention to call once per layer, how mixture-of-experts layers run their experts, which
tokens are real (for the expert load), and the LoRA batch. The dense reference path and
training pass only an attention; the runner's programs pass all four.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jaxserve.model.lora import LoRABatch

# attention(layer_index, q, k, v, layer_cache, sinks=None) -> (out, layer_cache)
AttentionFn = Callable[..., tuple[jax.Array, Any]]
# mixture(x [T, E], weights [T, K], experts [T, K], kernels: ExpertKernels,
#         expert_parallel) -> [T, E]: each token's experts' outputs, summed with their
#         weights (`jaxserve.model.expert_placement` builds it for a mesh and platform)
ExpertMixture = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What one forward gives the model besides tokens, positions and the KV cache."""

    attention: AttentionFn  # called by every layer
    experts: ExpertMixture | None = None  # MoE layers' mixture (None: `default_mixture`)
    real_tokens: jax.Array | None = None  # [T] bool, tokens the expert load counts (None: all)
    lora: LoRABatch | None = None  # the adapter slots' stacks and each token's slot


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelOutput:
    """What a forward returns."""

    hidden: jax.Array  # [..., E] final hidden states (after the final norm)
    kv_cache: Any  # the cache, written
    aux: jax.Array | None = None  # [..., n E] the inputs of the `aux_layers` asked for
    expert_load: jax.Array | None = None  # [L, X] int32 (token, expert) pairs, if counted
