"""The adapter slots on the device: every module's (A, B) stacks, placed like the base
projection they adapt, and the program that writes one slot."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import sharding
from jaxserve.model.config import ModelConfig
from jaxserve.model.lora import lora_axes, slot_shapes


def slot_stacks(cfg: ModelConfig, max_loras: int, max_lora_rank: int, mesh: Mesh, dtype,
                abstract: bool) -> dict[str, tuple]:
    """`{module: (A [L, S, in, R], B [L, S, R, out])}` of zeros, each placed with the
    sharding its logical axes give on `mesh`; `jax.ShapeDtypeStruct`s when `abstract` (a
    compile-only runner, `jaxserve plan`)."""
    stacks = {}
    for module, shapes in slot_shapes(cfg, max_loras, max_lora_rank).items():
        pair = []
        for shape, axes in zip(shapes, lora_axes(module)):
            placed = sharding.named_sharding(axes, shape, mesh)
            if abstract:
                pair.append(jax.ShapeDtypeStruct(shape, dtype, sharding=placed))
            else:
                pair.append(jax.jit(lambda shape=shape: jnp.zeros(shape, dtype),
                                    out_shardings=placed)())
        stacks[module] = tuple(pair)
    return stacks


def write_slot(stacks: list[jax.Array], slot: jax.Array, new: list[jax.Array]
               ) -> list[jax.Array]:
    """`stacks` (each `[L, S, ...]`) with slot `slot` replaced by `new` (each `[L, ...]`);
    jitted with the stacks donated, so the write is in place.

    Anything non-finite after the cast to the stacks' dtype is written as zero: the masked
    product multiplies every slot's B by the other tokens' zeros (`jaxserve.model.lora`),
    and 0 x NaN would reach them. The loader refuses such adapters; this keeps the slots
    finite whatever writes them (a float32 value beyond float16's range included)."""
    written = []
    for stack, value in zip(stacks, new):
        value = value.astype(stack.dtype)  # [L, ...]
        written.append(stack.at[:, slot].set(jnp.where(jnp.isfinite(value), value, 0)))
    return written


def slot_stack_bytes(cfg: ModelConfig, max_loras: int, max_lora_rank: int, mesh: Mesh,
                     dtype) -> int:
    """Bytes the slot stacks take on one device of `mesh` (what the KV cache must leave)."""
    total = 0
    for module, shapes in slot_shapes(cfg, max_loras, max_lora_rank).items():
        for shape, axes in zip(shapes, lora_axes(module)):
            per_device = sharding.named_sharding(axes, shape, mesh).shard_shape(shape)
            total += math.prod(per_device) * jnp.dtype(dtype).itemsize
    return total
