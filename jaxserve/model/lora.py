"""LoRA on the device: the adapter slots' stacked weights and the per-token delta.

The engine holds `max_loras` slots; each of a layer's seven projections has, per layer and
slot, `A [in, R]` and `B [R, out]` (`R = max_lora_rank`, zero-padded; B carries the
adapter's scaling). Every token names a slot or none (-1), and a projection's output gains

    delta[t] = (x[t] @ A[slot[t]]) @ B[slot[t]]

computed one of two ways, chosen per program by its token count (a static shape, so nothing
compiles after warm-up whatever the mix of adapters; a token without an adapter gets exactly
zero either way):
- masked, for every program of more than one token: all slots at once, each token keeping
  only its own slot's column: `x [T, in] @ A [S, in, R] -> [T, S, R]`, the other slots'
  columns selected away (`jnp.where`, not multiplied by a one-hot row: inf x 0 is NaN),
  then contracted with `B [S, R, out]`. A matmul S·R columns wide beside the base
  projection's `out` (8 slots of rank 16: 128 columns beside 4,096), with no gather and no
  sort.
- gathered, for a one-token program (a single request's decode step): that token's A and B
  alone. Every slot's product would read S times the weights it needs.

One adapter cannot change another row's output: a token without an adapter gets its delta
selected to exactly zero whatever the slots hold, and an adapter whose `x @ A` overflows
(huge but finite weights pass the load checks) reaches only its own tokens. The masked
contraction still multiplies the other slots' B by zeros, so the slots must hold finite
values: the slot write (`jaxserve.lora.stacks.write_slot`) is their only writer and zeroes
anything non-finite, and the loader refuses non-finite adapters (`jaxserve.lora.adapter`).
`jaxserve bench lora-products` measures these two and a grouped matmul over rows sorted by
slot, on CPU and compile-only TPU/GPU targets (docs/lora.md has the figures and why).

The slot stacks shard like their base projection (`LORA_AXES`): B of q/k/v/gate/up splits
its output columns, A of o/down its input rows, the rank and slot axes stay whole.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.model.config import ModelConfig

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# module -> (logical axis of its input, of its output), as its base kernel's
_IO_AXES = {"q_proj": ("embed", "heads"), "k_proj": ("embed", "kv_heads"),
            "v_proj": ("embed", "kv_heads"), "o_proj": ("heads", "embed"),
            "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"),
            "down_proj": ("mlp", "embed")}


def module_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection, heads flattened with their head_dim."""
    e, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    return {"q_proj": (e, q), "k_proj": (e, kv), "v_proj": (e, kv), "o_proj": (q, e),
            "gate_proj": (e, i), "up_proj": (e, i), "down_proj": (i, e)}


def lora_axes(module: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Logical axes of a module's slot stacks: A `[L, S, in, R]`, B `[L, S, R, out]`."""
    axis_in, axis_out = _IO_AXES[module]
    return (("layers", "lora_slots", axis_in, "lora_rank"),
            ("layers", "lora_slots", "lora_rank", axis_out))


def slot_shapes(cfg: ModelConfig, max_loras: int, max_lora_rank: int
                ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Shapes of every module's (A, B) slot stacks."""
    layers = cfg.num_layers
    return {m: ((layers, max_loras, size_in, max_lora_rank),
                (layers, max_loras, max_lora_rank, size_out))
            for m, (size_in, size_out) in module_sizes(cfg).items()}


GATHER_MAX_TOKENS = 1  # programs of at most this many tokens gather each token's A and B


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """What one forward needs of the adapters: each module's slot stacks (`[L, S, ...]` for
    the model, one layer's `[S, ...]` inside a layer) and each token's slot `[...]` int32
    (-1: no adapter)."""

    stacks: dict[str, tuple[jax.Array, jax.Array]]
    slots: jax.Array

    @classmethod
    def of(cls, stacks, token_slots: jax.Array) -> "LoRABatch":
        """`token_slots [...]` int32, -1 for a token without an adapter."""
        return cls(stacks, token_slots)

    def with_stacks(self, stacks) -> "LoRABatch":
        """This batch's tokens with other stacks (one layer's, inside a scan)."""
        return dataclasses.replace(self, stacks=stacks)

    def layer(self, index) -> "LoRABatch":
        """This batch with one layer's stacks (`index` a Python int)."""
        return self.with_stacks(jax.tree.map(lambda w: w[index], self.stacks))

    def delta(self, module: str, x: jax.Array) -> jax.Array:
        """One layer's adapter output for `module`: x `[..., in]` -> `[..., out]`."""
        a, b = self.stacks[module]  # [S, in, R], [S, R, out]
        a, b = a.astype(x.dtype), b.astype(x.dtype)
        if x.size // x.shape[-1] <= GATHER_MAX_TOKENS:
            return gathered_delta(x, a, b, self.slots)
        return masked_delta(x, a, b, self.slots)


def masked_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """x `[..., in]`, A `[S, in, R]`, B `[S, R, out]`, slots `[...]` (-1: none) ->
    `[..., out]`: every slot's product, each token keeping its own slot's."""
    own = slots[..., None] == jnp.arange(a.shape[0])  # [..., S] bool
    down = jnp.einsum("...i,sir->...sr", x, a)  # [..., S, R]
    down = jnp.where(own[..., None], down, 0)  # the other slots' columns: exactly zero
    delta = jnp.einsum("...sr,sro->...o", down, b)  # [..., out]
    return jnp.where((slots >= 0)[..., None], delta, 0)


def gathered_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """x `[..., in]`, A `[S, in, R]`, B `[S, R, out]`, slots `[...]` (-1: none) ->
    `[..., out]`: each token's own A and B (slot 0's for a token without one, whose delta
    is then selected away)."""
    index = jnp.maximum(slots, 0)  # [...]
    down = jnp.einsum("...i,...ir->...r", x, a[index])  # [..., R]
    delta = jnp.einsum("...r,...ro->...o", down, b[index])  # [..., out]
    return jnp.where((slots >= 0)[..., None], delta, 0)


def add_delta(lora: LoRABatch | None, module: str, x: jax.Array, out: jax.Array
              ) -> jax.Array:
    """`out` (a projection of `x`, any trailing shape) plus its adapter delta, if any."""
    if lora is None:
        return out
    return out + lora.delta(module, x).reshape(out.shape).astype(out.dtype)
