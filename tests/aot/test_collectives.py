"""`jaxserve.aot.collectives` against hand-counted programs: a psum over 4 CPU devices of a
`[8, 16]` float32 block is one all-reduce of 512 bytes; a gather of a `[4, 6]` int32 array
split over the devices is one all-gather of 96 bytes; a program without collectives
has none."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import sharding
from jaxserve.aot.collectives import collectives

pytestmark = pytest.mark.quick


def compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_collectives_are_counted_with_their_bytes():
    mesh = sharding.make_mesh(tensor_parallel_size=4)
    summed = jax.shard_map(lambda x: jax.lax.psum(x * 2, "model"), mesh=mesh,
                           in_specs=P(), out_specs=P(), check_vma=False)
    assert collectives(compiled_text(summed, jnp.ones((8, 16), jnp.float32))) == {
        "all-reduce": {"count": 1, "bytes": 8 * 16 * 4}}

    gathered = jax.shard_map(lambda x: jax.lax.all_gather(x, "model", tiled=True), mesh=mesh,
                             in_specs=P("model"), out_specs=P(), check_vma=False)
    assert collectives(compiled_text(gathered, jnp.ones((4, 6), jnp.int32))) == {
        "all-gather": {"count": 1, "bytes": 4 * 6 * 4}}

    assert collectives(compiled_text(lambda x: x + 1, jnp.ones(3))) == {}
