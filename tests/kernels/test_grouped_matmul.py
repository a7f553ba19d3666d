"""The grouped matmul of mixture-of-experts layers on TPU (`pallas_kernels.grouped_matmul`,
megablox `gmm`, interpret mode here) against `jax.lax.ragged_dot`, and the per-device
experts (`jaxserve.model.expert_placement.experts_per_device`) over 4 CPU devices, each expert's
width split or whole experts split (expert parallelism), against the same mixture with
ragged_dot on one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from jaxserve.model.expert_placement import experts_per_device
from jaxserve.model.expert_mixtures import ExpertKernels, default_mixture, mix_experts
from jaxserve.model.quantization import quantize
from pallas_kernels.grouped_matmul import grouped_matmul

pytestmark = pytest.mark.quick


def random_sizes(rng, rows: int, groups: int) -> np.ndarray:
    cuts = np.sort(rng.integers(0, rows + 1, groups - 1))
    return np.diff(np.concatenate([[0], cuts, [rows]])).astype(np.int32)


@pytest.mark.parametrize("rows, k, n, groups, case", [
    (37, 64, 96, 6, "random"),  # rows off the 128 tile, n not a multiple of 128
    (200, 128, 256, 4, "one_group"),  # every row in group 1, the others empty
    (64, 256, 96, 128, "random"),  # decode-sized: more groups than rows
])
def test_grouped_matmul_equals_ragged_dot(rows, k, n, groups, case):
    rng = np.random.default_rng(rows)
    lhs = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(groups, k, n)), jnp.float32)
    sizes = random_sizes(rng, rows, groups)
    if case == "one_group":
        sizes = np.zeros(groups, np.int32)
        sizes[1] = rows
    got = jax.jit(grouped_matmul, static_argnames="interpret")(lhs, rhs, jnp.asarray(sizes),
                                                               interpret=True)
    want = jax.lax.ragged_dot(lhs, rhs, jnp.asarray(sizes))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("local", ["gmm", "default"])
@pytest.mark.parametrize("expert_parallel, method", [(False, None), (True, None),
                                                     (False, "int8"), (True, "fp8")])
def test_experts_per_device_over_four_devices_equal_one_device(expert_parallel, method, local):
    """Tensor-parallel experts (each device 16 of every expert's 64 columns) and expert
    parallelism (each device 2 whole experts of 8), with one expert taking most tokens and
    one none, against the mixture on one device; quantized (`method`): codes and scales per
    expert and output channel on the devices, against the float weights they stand for.
    Each device runs megablox `gmm` (TPU's) or `default_mixture` (CPU's and GPU's)."""
    mesh = sharding.make_mesh(tensor_parallel_size=4)
    rng = np.random.default_rng(0)
    tokens, k, e, i, x = 24, 2, 32, 64, 8
    experts = np.stack([rng.integers(0, x, tokens), np.full(tokens, 5)], axis=1)
    experts[:, 0] = np.where(experts[:, 0] == 5, 3, experts[:, 0])
    experts[experts == 6] = 7  # expert 6 gets no token
    weights = jnp.asarray(rng.uniform(size=(tokens, k)), jnp.float32)
    args = [jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
            for shape in ((tokens, e), (x, e, i), (x, e, i), (x, i, e))]
    routing = (args[0], weights, jnp.asarray(experts, jnp.int32))
    held, width = ("expert_shards", "expert_mlp") if expert_parallel else ("experts", "mlp")
    axes = ((held, "embed", width),) * 2 + ((held, width, "embed"),)
    kernels = args[1:]
    if method is not None:  # codes [X, in, out], scales [X, out]; the float weight they mean
        kernels = [quantize(w, method, (1,), xp=jnp) for w in kernels]
        args[1:] = [codes.astype(jnp.float32) * scale[:, None, :] for codes, scale in kernels]
        kernels = [codes for codes, _ in kernels] + [scale for _, scale in kernels]
        axes += tuple((a[0], a[2]) for a in axes)
    want = default_mixture(*routing, ExpertKernels(*args[1:]))
    placed = [jax.device_put(a, sharding.named_sharding(names, a.shape, mesh))
              for a, names in zip(kernels, axes)]
    assert tuple(placed[0].sharding.spec) == (
        ("model", None, None) if expert_parallel else (None, None, "model"))
    gmm = functools.partial(grouped_matmul, interpret=True)
    on_device = functools.partial(mix_experts, gmm) if local == "gmm" else default_mixture
    mixture = experts_per_device(on_device, mesh, expert_parallel)
    got = jax.jit(mixture)(*routing, ExpertKernels(*placed))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
