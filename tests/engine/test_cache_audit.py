"""The KV cache guard (`jaxserve.engine.cache_audit`): no compiled program copies a page pool
or computes a whole one beyond its in-place write, so a step's cost cannot grow with the pool.

A one-row decode loop once computed its one-token write twice, each on a copy of every pool
(batch 1 at 5 tokens/s beside 110 at batch 2); the hand-built program below has that shape,
and the guard must find it there and pass its fixed form. The default engine (the shipped
model, the CPU preset) is then audited bucket by bucket, decode loops included; the same
audit runs on TPU and GPU programs in `jaxserve plan` (tests/aot/test_plan.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve import LLM
from jaxserve.default_model import DEFAULT_MODEL_DIR
from jaxserve.engine.cache_audit import PagePools, audit, memory_problem
from sweeps import sweep
from tiny_models import SMALL_ENGINE

NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM = 300, 16, 4, 64


def _one_row_decode_loop(view_inside_branches: bool):
    """A loop writing one token a step into a pool `[N, ps, Hkv * D]` and reading three pages
    of its heads-apart view `[N, ps, Hkv, D]` in a `lax.switch`, as the CPU backend's decode
    rows do. The view built before the switch is the shape that made XLA:CPU copy the pool."""
    heads = lambda pool: pool.reshape(NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)  # noqa: E731

    def body(carry):
        step, pool, total = carry
        slot = jnp.where(step < 5, step * 3, -1)[None]  # [1], -1: a finished row
        page = jnp.where(slot < 0, NUM_PAGES, slot // PAGE_SIZE)
        pool = pool.at[page, slot % PAGE_SIZE].set(
            jnp.full((1, KV_HEADS * HEAD_DIM), step, jnp.float32), mode="drop")
        read = lambda pages: lambda p: (heads(p) if view_inside_branches else p)[  # noqa: E731
            jnp.array(pages)].sum()
        operand = pool if view_inside_branches else heads(pool)
        part = jax.lax.switch(step % 3, [read([1, 2, 3]), read([4, 5]), lambda p: 0.0],
                              operand)
        return step + 1, pool, total + part

    return jax.jit(lambda pool: jax.lax.while_loop(lambda c: c[0] < 8, body, (0, pool, 0.0)),
                   donate_argnums=0)


@pytest.mark.parametrize("view_inside_branches", [False, True])
def test_the_guard_finds_a_write_computed_on_copies_of_the_pool(view_inside_branches):
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), P())
    pool = jax.ShapeDtypeStruct((NUM_PAGES, PAGE_SIZE, KV_HEADS * HEAD_DIM), jnp.float32,
                                sharding=sharding)
    compiled = _one_row_decode_loop(view_inside_branches).lower(pool).compile()
    found = audit(compiled, PagePools.exactly([pool]), NUM_PAGES * PAGE_SIZE * 256 * 4)
    assert found.donated
    if view_inside_branches:
        assert found.ok and found.opcodes.count("copy") == 0
    else:
        assert found.copies > 0 and found.whole_pool_ops > 0 and not found.ok
        assert "copy instruction" in found.problem()


@pytest.mark.parametrize("engine", sweep(["tiny", "shipped_default"], keep={0}))
def test_every_program_of_an_engine_updates_the_cache_in_place(engine, folder):
    """Every step and decode program of the tests' usual tiny engine (main suite: the
    programs most tests share), and of the shipped model's default engine (slow step: its
    whole ladder of programs)."""
    llm = (LLM(str(folder), dtype="float32", progress=False, **SMALL_ENGINE)
           if engine == "tiny" else LLM(str(DEFAULT_MODEL_DIR), progress=False))
    runner = llm.engine.runner
    assert {kind for kind, _, _ in runner.bucket_programs()} == {"step", "decode"}
    audits = runner.cache_audits()
    assert set(audits) == set(runner.bucket_programs())  # every bucket, decode loops too
    pools = len(jax.tree.leaves(runner.caches))
    for bucket, found in audits.items():
        assert found.ok, (bucket, found.problem())
        assert len(found.opcodes) == pools, (bucket, found.opcodes)  # each pool's one write


@pytest.mark.parametrize("donate", [True, False])
def test_a_program_that_would_exhaust_the_device_is_named_before_it_runs(donate):
    """`memory_problem`, the start-up check `Runner.check_device_memory` makes on TPU/GPU, on
    hand-sized programs: a cache of 1,000 x 256 float32 (1,024,000 bytes) written in place
    with a 64 MiB temporary beside it. Without donation the output is a second cache."""
    cache = jnp.zeros((1000, 256), jnp.float32)

    def step(cache, x):  # x [4096, 4096]: its square is a 64 MiB temporary
        return cache.at[0].add((x @ x)[0, :256]), x.sum()

    jitted = jax.jit(step, donate_argnums=0 if donate else ())
    compiled = jitted.lower(cache, jnp.ones((4096, 4096), jnp.float32)).compile()
    temporary = compiled.memory_analysis().temp_size_in_bytes
    if not donate:
        assert "does not update the KV cache in place" in memory_problem(
            compiled, cache.nbytes, 2**40)
        return
    assert temporary >= 4096 * 4096 * 4
    assert memory_problem(compiled, cache.nbytes, temporary + 2**20) is None
    problem = memory_problem(compiled, cache.nbytes, temporary // 2)
    assert "for its outputs and temporaries" in problem
    assert "kv_cache_memory_fraction" in problem
