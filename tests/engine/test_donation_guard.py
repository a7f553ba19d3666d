"""The start-up donation guard (`jaxserve.engine.donation_guard`): a cache placed otherwise than
the compiled program expects is refused before it runs, and a program that leaves its cache
input alive after its first run is refused after it. On the 8 forced CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxserve import LLM
from jaxserve.engine.donation_guard import check_donated, check_placement, with_layouts
from tiny_models import SMALL_ENGINE

SHAPE = (64, 16, 32)  # a page pool [N, page_size, Hkv * D]


def _program(sharding, donate: bool = True):
    """A step-like program writing one token into a pool, compiled for `sharding`."""
    jitted = jax.jit(lambda pool, x: pool.at[0, 0].set(x), donate_argnums=0 if donate else ())
    return jitted.lower(jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding),
                        jax.ShapeDtypeStruct((SHAPE[2],), jnp.float32)).compile()


def _mesh_sharding():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "model"))
    return NamedSharding(mesh, P(None, None, "model"))  # split on kv heads


@pytest.mark.quick
def test_a_pool_on_one_device_is_refused_where_the_program_expects_the_mesh():
    sharding = _mesh_sharding()
    compiled = _program(sharding)
    placed = jax.device_put(np.zeros(SHAPE, np.float32), sharding)
    check_placement("step", compiled, [(placed,)], {0: "caches"})  # as expected: no error
    alone = jax.device_put(np.zeros(SHAPE, np.float32), jax.devices()[0])
    with pytest.raises(RuntimeError, match=r"caches\[0\] is placed as SingleDeviceSharding.*"
                                           r"the step program expects NamedSharding"):
        check_placement("step", compiled, [(alone,)], {0: "caches"})


@pytest.mark.quick
def test_a_pool_in_another_layout_is_refused():
    sharding = SingleDeviceSharding(jax.devices()[0])
    compiled = _program(sharding)
    transposed = jax.device_put(np.zeros(SHAPE, np.float32),
                                Format(Layout(major_to_minor=(2, 1, 0)), sharding))
    assert transposed.format.layout.major_to_minor == (2, 1, 0)  # really another layout
    with pytest.raises(RuntimeError, match=r"pool has the layout .*\(2, 1, 0\).* the decode "
                                           r"program expects .*\(0, 1, 2\)"):
        check_placement("decode", compiled, [transposed], {0: "pool"})


@pytest.mark.quick
@pytest.mark.parametrize("donate", [True, False])
def test_a_program_that_keeps_its_cache_input_alive_is_refused(donate):
    sharding = _mesh_sharding()
    compiled = _program(sharding, donate)
    pool = jax.device_put(np.zeros(SHAPE, np.float32), sharding)
    results = []

    def run():
        results.append(jax.block_until_ready(compiled(pool, np.ones(SHAPE[2], np.float32))))

    if donate:
        check_donated("step", run, "caches", [pool])
        assert pool.is_deleted()
        return
    with pytest.raises(RuntimeError, match=r"the step program did not update caches in "
                                           r"place .* 1 of its 1 donated arrays .*caches\[0\]"):
        check_donated("step", run, "caches", [pool])


@pytest.mark.quick
def test_a_copy_of_the_cache_kept_beside_it_is_refused():
    """Donated, yet a second pool-sized array comes out of the run (what a program that
    copies the pool and returns the copy too would leave)."""
    sharding = _mesh_sharding()
    jitted = jax.jit(lambda pool: (pool.at[0, 0, 0].set(1.0), pool * 2), donate_argnums=0)
    pool = jax.device_put(np.zeros(SHAPE, np.float32), sharding)
    kept = []
    with pytest.raises(RuntimeError, match=r"131072 more bytes of arrays shaped like caches"):
        check_donated("spec", lambda: kept.append(jax.block_until_ready(jitted(pool))),
                      "caches", [pool])


def test_the_runner_refuses_a_cache_placed_off_its_mesh(folder):
    """A tensor-parallel engine starts (its programs pass both checks); its cache moved to
    one device is refused by the runner's first runs, naming the program and the pool."""
    llm = LLM(str(folder), dtype="float32", progress=False, tensor_parallel_size=2,
              **SMALL_ENGINE)
    runner = llm.engine.runner
    runner.caches = jax.tree.map(lambda a: jax.device_put(a, jax.devices()[0]), runner.caches)
    with pytest.raises(RuntimeError, match=r"caches\[0\]\[0\] is placed as SingleDevice"
                                           r"Sharding.* the (step|decode) \(\d+ tokens, "
                                           r"\d+ rows\) program"):
        runner.first_runs()


@pytest.mark.quick
def test_a_pool_is_moved_into_a_layout_the_program_chose():
    """A program taking its pool in a layout of its own (as XLA:TPU chose for expert weights
    96 columns wide): the default-layout pool is refused as it is, and moved into that
    layout by `with_layouts` (the old one donated), after which it runs and is donated."""
    sharding = SingleDeviceSharding(jax.devices()[0])
    chosen = Format(Layout(major_to_minor=(2, 1, 0)), sharding)
    jitted = jax.jit(lambda pool: pool.at[0, 0, 0].set(1.0), donate_argnums=0,
                     in_shardings=chosen, out_shardings=chosen)
    compiled = jitted.lower(jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)
                            ).compile()
    pool = jax.device_put(np.zeros(SHAPE, np.float32), sharding)
    with pytest.raises(RuntimeError, match=r"pool\[0\] has the layout"):
        check_placement("step", compiled, [[pool]], {0: "pool"})
    [moved] = with_layouts(compiled, 0, [pool])
    assert pool.is_deleted() and moved.format.layout.major_to_minor == (2, 1, 0)
    check_placement("step", compiled, [[moved]], {0: "pool"})
    out = []
    check_donated("step", lambda: out.append(jax.block_until_ready(compiled(moved))), "pool",
                  [moved])
    assert float(out[0][0, 0, 0]) == 1.0
