"""How a mixture-of-experts layer's experts run on a mesh and a platform: the
`ExpertMixture` the runner hands the model in its `StepContext` (`expert_mixture`), and the
per-device mixture it is built from (`experts_per_device`).

XLA's `default_mixture` partitioned by XLA everywhere, except with expert parallelism on a
mesh (each device runs `default_mixture` on its own experts) and, with the Pallas kernels on
TPU, megablox `gmm` on each device (`pallas_kernels.grouped_matmul`; GPU has no grouped-matmul
kernel here yet, so it keeps XLA's).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import Mesh, PartitionSpec as P

import sharding
from jaxserve.model.contract import ExpertMixture
from jaxserve.model.expert_mixtures import (ExpertKernels, LocalMixture, default_mixture,
                                            mix_experts)
from pallas_kernels.grouped_matmul import grouped_matmul


def expert_mixture(mesh: Mesh | None, pallas_kernels: bool) -> ExpertMixture:
    """The experts of the programs on `mesh`; `pallas_kernels`: the engine runs the Pallas
    kernels (attention backend "pallas"), so TPU gets megablox `gmm`."""

    def with_xla(x, weights, experts, kernels: ExpertKernels, expert_parallel=False):
        if expert_parallel and mesh is not None:
            return experts_per_device(default_mixture, mesh, True)(x, weights, experts, kernels)
        return default_mixture(x, weights, experts, kernels)

    def with_kernels(x, weights, experts, kernels: ExpertKernels, expert_parallel=False):
        gmm = functools.partial(grouped_matmul, interpret=False)
        on_tpu = experts_per_device(functools.partial(mix_experts, gmm), mesh,
                                    expert_parallel)
        return jax.lax.platform_dependent(
            x, weights, experts, kernels, tpu=on_tpu,
            default=functools.partial(with_xla, expert_parallel=expert_parallel))

    return with_kernels if pallas_kernels else with_xla


def experts_per_device(local_mixture: LocalMixture, mesh: Mesh | None, expert_parallel: bool):
    """An `ExpertMixture` running `local_mixture` (`jaxserve.model.expert_mixtures`) on each
    device of `mesh`'s "model" axis, tokens and routing replicated (as tensor-parallel
    attention leaves them):
    - tensor-parallel experts: each device holds a slice of every expert's width (the "mlp"
      axis, when the sharding rules split it) and computes every pair's partial output;
    - `expert_parallel`: each device holds X / tp whole experts and computes only the pairs
      routed to them; the others add nothing there.
    Either way the per-token sums `[T, E]` are added over "model": one all-reduce of the
    same size as the dense MLP's, and no all-to-all, because every device already holds
    every token."""
    if mesh is None:
        return local_mixture

    def on_mesh(x, weights, experts, kernels: ExpertKernels):
        replicated = P()
        if expert_parallel:
            axis = sharding.LOGICAL_AXIS_RULES["expert_shards"]
            gate_spec, down_spec = P(axis, None, None), P(axis, None, None)
            gate_scale_spec, down_scale_spec = P(axis, None), P(axis, None)
        else:
            gate_spec = sharding.partition_spec(("experts", "embed", "mlp"),
                                                kernels.gate.shape, mesh)
            axis = gate_spec[2]
            down_spec = P(None, axis, None)
            gate_scale_spec, down_scale_spec = P(None, axis), P(None, None)
        per_column = {"gate": gate_spec, "up": gate_spec, "down": down_spec,
                      "gate_scale": gate_scale_spec, "up_scale": gate_scale_spec,
                      "down_scale": down_scale_spec, "gate_bias": gate_scale_spec,
                      "up_bias": gate_scale_spec}
        specs = dataclasses.replace(kernels, **{
            name: None if getattr(kernels, name) is None else spec
            for name, spec in per_column.items()})
        shards = mesh.shape[axis] if expert_parallel else 1
        per_device = kernels.num_experts // shards

        def body(x, weights, experts, kernels):
            first = jax.lax.axis_index(axis) * per_device if expert_parallel else 0
            out = local_mixture(x, weights, experts, kernels, first, shards)  # [T, E]
            return out if axis is None else jax.lax.psum(out, axis)

        return jax.shard_map(body, mesh=mesh, in_specs=(replicated,) * 3 + (specs,),
                             out_specs=replicated, check_vma=False)(x, weights, experts, kernels)

    return on_mesh
