"""Device mesh, logical-axis partition rules and shard_map wrappers (imports only jax/numpy).

The model speaks in logical axis names; this package alone maps them to the mesh axes
`("data", "model")`:

  make_mesh(tensor_parallel_size, data_parallel_size, devices=None) -> Mesh
  replica_meshes(mesh) -> list[Mesh]            one (1, tp) sub-mesh per data-parallel replica
  partition_spec(logical_axes, shape, mesh)     logical names → PartitionSpec
  named_sharding(logical_axes, shape, mesh)     ... → NamedSharding
  replicated(mesh), kv_cache_sharding(mesh)     step inputs; the paged KV cache
  kv_scale_sharding(mesh)                       int8 pages' scale pools
  tensor_parallel_size(mesh)                    devices the heads are split over
  kv_head_repeats(num_kv_heads, num_heads, tp)  how often each kv head is stored
  repeat_kv_heads, repeated_kv_slice            that repetition, on device / per host slice
  shard_loader(array_fn, shape, sharding)       an array built shard by shard from host data
  restrict_to(array, mesh)                      the same shards, viewed as an array on a sub-mesh
  shard_over_heads(fn, mesh, ...)               run `fn` per device on its heads (shard_map)
"""

from sharding.mesh import make_mesh, replica_meshes
from sharding.rules import (LOGICAL_AXIS_RULES, kv_cache_sharding, kv_head_repeats,
                            kv_scale_sharding, named_sharding, partition_spec, repeat_kv_heads,
                            repeated_kv_slice, replicated, restrict_to, shard_loader,
                            tensor_parallel_size)
from sharding.shard_map import shard_over_heads

__all__ = ["make_mesh", "replica_meshes", "LOGICAL_AXIS_RULES", "partition_spec",
           "named_sharding", "replicated", "kv_cache_sharding", "kv_scale_sharding",
           "tensor_parallel_size",
           "kv_head_repeats", "repeat_kv_heads", "repeated_kv_slice", "shard_loader",
           "restrict_to", "shard_over_heads"]
