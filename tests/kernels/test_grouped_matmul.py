"""The grouped matmul of mixture-of-experts layers on TPU (`pallas_kernels.grouped_matmul`,
megablox `gmm`, interpret mode here) against `jax.lax.ragged_dot`, and the per-device
expert SwiGLU (`jaxserve.attention.backend.expert_ffn_per_device`) over 4 CPU devices with
each expert's width split, against the same SwiGLU with ragged_dot on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from jaxserve.attention.backend import expert_ffn_per_device
from jaxserve.model.moe import ragged_expert_ffn
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


def test_expert_ffn_per_device_over_four_devices_equals_one_device():
    mesh = sharding.make_mesh(tensor_parallel_size=4)
    rng = np.random.default_rng(0)
    rows, e, i, x = 48, 32, 64, 6  # each device: 16 of every expert's 64 columns
    sizes = jnp.asarray(random_sizes(rng, rows, x))
    args = [jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
            for shape in ((rows, e), (x, e, i), (x, e, i), (x, i, e))]
    want = ragged_expert_ffn(args[0], sizes, *args[1:])
    placed = [jax.device_put(a, sharding.named_sharding(axes, a.shape, mesh)) for a, axes in
              zip(args[1:], (("experts", "embed", "mlp"),) * 2 + (("experts", "mlp", "embed"),))]
    assert placed[0].sharding.spec[2] == "model"
    ffn = expert_ffn_per_device(lambda a, b, c: grouped_matmul(a, b, c, interpret=True), mesh)
    got = jax.jit(ffn)(args[0], sizes, *placed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
