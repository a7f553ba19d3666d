"""The device mesh: axes ("data", "model"), shape (data_parallel_size, tensor_parallel_size).

"model" carries tensor parallelism (weights and KV cache split on heads / MLP hidden /
vocab, collectives inside one program). "data" carries data parallelism as independent
engine replicas: `replica_meshes` cuts the mesh into one (1, tp) sub-mesh per replica, each
with its own weights view, KV cache, scheduler and compiled programs (see
`jaxserve.engine.engine` for why replicas rather than one batch split across "data").

Axes are `Auto` (the `Mesh` default): shardings are annotations XLA propagates, which is what
a model written without sharding needs. (`jax.make_mesh` defaults to Explicit axes.)
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "model")


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(data_parallel_size, tensor_parallel_size)` mesh over the first dp*tp `devices`
    (default: all devices of every process, `jax.devices()`).

    Neighbouring devices share a replica (the "model" axis is the fast one), so on a host
    with several accelerators the tensor-parallel collectives stay on the fastest links.
    """
    tp = _check_size("tensor_parallel_size", tensor_parallel_size)
    dp = _check_size("data_parallel_size", data_parallel_size)
    devices = list(jax.devices() if devices is None else devices)
    if tp * dp > len(devices):
        raise ValueError(
            f"tensor_parallel_size ({tp}) x data_parallel_size ({dp}) = {tp * dp} devices, "
            f"but only {len(devices)} {devices[0].platform if devices else ''} device(s) "
            "are present")
    return Mesh(np.array(devices[:tp * dp]).reshape(dp, tp), AXES)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One `(1, tp)` sub-mesh per row of the "data" axis, same axis names."""
    return [Mesh(mesh.devices[r:r + 1], AXES) for r in range(mesh.shape["data"])]
