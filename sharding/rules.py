"""Partition rules: which logical axis of a parameter or cache goes to which mesh axis.

Megatron-style tensor parallelism on the "model" axis:
- q/k/v and gate/up are split by output column ("heads", "kv_heads", "mlp"): every device
  computes whole heads / a slice of the MLP hidden with no communication;
- o_proj and down_proj are split by input row (their "heads" / "mlp" axis): each device
  holds a partial sum, and XLA inserts the all-reduce over "model" at the einsum;
- embedding and lm_head are vocab-parallel ("vocab");
- norms, biases of the residual stream and "embed"/"head_dim" axes are replicated;
- mixture-of-experts weights `[X, ...]` are split like the dense MLP (a slice of every
  expert's width), or with expert parallelism by whole experts ("expert_shards").
The KV cache `[N, page_size / f, f * Hkv * D]` is split on its kv-heads axis like k/v
projections (a row holds f tokens' heads head-major, so the split is by whole heads).

A vocabulary (or MLP hidden) that does not divide by the "model" size is kept replicated on
that axis rather than padded; head counts must divide (checked by `kv_head_repeats`).
Nothing in the rules mentions "data": every data-parallel replica holds whole weights.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "embed": None,
    "head_dim": None,
    "norm": None,
    "layers": None,  # the stacked-layers axis (`scan_layers`): every device holds all layers
    "experts": None,  # mixture of experts: every device holds a slice of every expert
    "expert_shards": "model",  # ... or, with expert parallelism, whole experts split
    "expert_mlp": None,  # among the devices (an expert's width stays whole)
    "lora_slots": None,  # LoRA adapter slots and ranks: whole on every device (their
    "lora_rank": None,  # A/B split like the base projection's in/out axes)
}


def partition_spec(logical_axes: tuple[str, ...], shape: tuple[int, ...],
                   mesh: Mesh, replicate: tuple[str, ...] = ()) -> P:
    """The PartitionSpec for an array with these logical axes (one name per dimension);
    axes named in `replicate` stay whole on every device."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical_axes {logical_axes} do not match shape {shape}")
    spec = []
    for name, size in zip(logical_axes, shape):
        if name not in LOGICAL_AXIS_RULES:
            raise ValueError(f"no sharding rule for logical axis {name!r}; known: "
                             f"{sorted(LOGICAL_AXIS_RULES)}")
        axis = None if name in replicate else LOGICAL_AXIS_RULES[name]
        spec.append(axis if axis is not None and size % mesh.shape[axis] == 0 else None)
    return P(*spec)


def named_sharding(logical_axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh,
                   replicate: tuple[str, ...] = ()) -> NamedSharding:
    """`partition_spec` on `mesh`."""
    return NamedSharding(mesh, partition_spec(logical_axes, shape, mesh, replicate))


def replicated(mesh: Mesh) -> NamedSharding:
    """Whole on every device of `mesh` (step inputs, sampled tokens)."""
    return NamedSharding(mesh, P())


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """Pages `[N, page_size / f, f * Hkv * D]` (kv heads packed along axis 2, head-major when
    f tokens share a row: `pallas_kernels.kv_quant`): every page on every device, axis 2
    split into whole kv heads like the k/v projections (the split is even in heads because
    tensor parallelism divides Hkv, or repeats it: `kv_head_repeats`)."""
    return NamedSharding(mesh, P(None, None, LOGICAL_AXIS_RULES["kv_heads"]))


def kv_scale_sharding(mesh: Mesh) -> NamedSharding:
    """int8 pages' scale pools `[N, Hkv * S]` (`pallas_kernels.kv_quant`): rows
    split into whole heads like the pages (each device's part is its heads' runs)."""
    return NamedSharding(mesh, P(None, LOGICAL_AXIS_RULES["kv_heads"]))


def tensor_parallel_size(mesh: Mesh) -> int:
    """Devices the heads are split over."""
    return mesh.shape[LOGICAL_AXIS_RULES["heads"]]


def kv_head_repeats(num_kv_heads: int, num_heads: int, tensor_parallel_size: int) -> int:
    """How many copies of each kv head the k/v projections and the KV cache hold.

    With tp <= Hkv every device holds Hkv/tp whole kv heads (1 copy). With tp > Hkv each kv
    head is stored r = tp/Hkv times, consecutively (head h becomes heads h*r .. h*r+r-1), so
    device j holds exactly one kv head, original head j // r — the one its Hq/tp query heads
    use under grouped-query attention. Memory for k/v and the cache grows r-fold; the
    kernels never see a head split across devices.
    """
    tp = tensor_parallel_size
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide num_attention_heads "
                         f"({num_heads})")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide num_key_value_heads "
                             f"({num_kv_heads})")
        return 1
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of "
                         f"num_key_value_heads ({num_kv_heads}) when larger than it, so kv "
                         "heads can be replicated whole")
    return tp // num_kv_heads


def repeat_kv_heads(array: jax.Array, repeats: int, axis: int,
                    target: NamedSharding) -> jax.Array:
    """Each kv head of `array` (on `axis`) stored `repeats` times, consecutively (as
    `kv_head_repeats` describes), placed with `target`."""
    if repeats == 1:
        return jax.device_put(array, target)
    return jax.jit(lambda a: jnp.repeat(a, repeats, axis=axis), out_shardings=target)(array)


def repeated_kv_slice(array: np.ndarray, index: tuple[slice, ...], axis: int | None,
                      repeats: int) -> np.ndarray:
    """`repeat_kv_heads` on the host for one device's slice `index`: `np.repeat(array,
    repeats, axis)[index]` without building the repeated array (axis None: no kv heads)."""
    if axis is None or repeats == 1:
        return array[index]
    heads = np.arange(array.shape[axis] * repeats)[index[axis]] // repeats
    return np.take(array, heads, axis=axis)[index[:axis] + (slice(None),) + index[axis + 1:]]


def shard_loader(array_fn: Callable[[tuple[slice, ...]], np.ndarray], shape: tuple[int, ...],
                 sharding: NamedSharding) -> jax.Array:
    """A global array whose every addressable shard is `array_fn(index)`: the host only ever
    materialises one device's slice at a time (e.g. of a memory-mapped tensor), and each
    process only its own devices' slices."""
    return jax.make_array_from_callback(shape, sharding, lambda index: array_fn(index))


def restrict_to(array: jax.Array, mesh: Mesh) -> jax.Array:
    """`array` (NamedSharding on a larger mesh, replicated across "data") viewed on the
    sub-mesh `mesh`, reusing its device buffers (no copy)."""
    devices = set(mesh.devices.flat)
    shards = [s.data for s in array.addressable_shards if s.device in devices]
    return jax.make_array_from_single_device_arrays(
        array.shape, NamedSharding(mesh, array.sharding.spec), shards)
