"""LoRA on the device: the adapter slots' stacked weights and the per-token delta.

The engine holds `max_loras` slots; each of a layer's seven projections has, per layer and
slot, `A [in, R]` and `B [R, out]` (`R = max_lora_rank`, zero-padded; B carries the
adapter's scaling). Every token names a slot or none (-1), and a projection's output gains

    delta[t] = (x[t] @ A[slot[t]]) @ B[slot[t]]

computed for all slots at once and masked by the token's one-hot slot row:
`x [T, in] @ A [S, in, R] -> [T, S, R]`, times `one_hot [T, S]`, then contracted with
`B [S, R, out]`. That is a matmul S·R columns wide beside the base projection's `out`
columns (4 slots of rank 16: 64 columns beside 4,096), with no gather of per-token weights
and no sorting, so every step keeps its shapes whatever the mix of adapters, and a token
without an adapter gets exactly zero. Grouped matmuls over rows sorted by slot cost T·R
instead of T·S·R, which matters only when S·R nears the projection's width.

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """What one forward needs of the adapters: each module's slot stacks (`[L, S, ...]` for
    the model, one layer's `[S, ...]` inside a layer) and each token's slot as a one-hot row
    `[..., S]` in the compute dtype (all zeros: no adapter)."""

    stacks: dict[str, tuple[jax.Array, jax.Array]]
    one_hot: jax.Array

    @classmethod
    def of(cls, stacks, token_slots: jax.Array, dtype) -> "LoRABatch":
        """`token_slots [...]` int32, -1 for a token without an adapter."""
        slots = next(iter(stacks.values()))[0].shape[1]
        return cls(stacks, jax.nn.one_hot(token_slots, slots, dtype=dtype))

    def layer(self, index) -> "LoRABatch":
        """This batch with one layer's stacks (`index` a Python int)."""
        return LoRABatch(jax.tree.map(lambda w: w[index], self.stacks), self.one_hot)

    def delta(self, module: str, x: jax.Array) -> jax.Array:
        """One layer's adapter output for `module`: x `[..., in]` -> `[..., out]`."""
        a, b = self.stacks[module]  # [S, in, R], [S, R, out]
        down = jnp.einsum("...i,sir->...sr", x, a.astype(x.dtype))  # [..., S, R]
        down = down * self.one_hot[..., None].astype(x.dtype)
        return jnp.einsum("...sr,sro->...o", down, b.astype(x.dtype))  # [..., out]


def add_delta(lora: LoRABatch | None, module: str, x: jax.Array, out: jax.Array
              ) -> jax.Array:
    """`out` (a projection of `x`, any trailing shape) plus its adapter delta, if any."""
    if lora is None:
        return out
    return out + lora.delta(module, x).reshape(out.shape).astype(out.dtype)
