"""The KV cache sized after compiling (`jaxserve.engine.memory_budget`): the arithmetic on
hand-computed cases, the claim it rests on (a donated program's temporaries do not grow with
the pool), and an engine on CPU given nothing but a device limit."""

import jax
import numpy as np
import pytest
from flax import nnx

import sharding
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.memory_budget import (MemoryBudget, abstract_module, largest_buckets,
                                           pages_after_compiling, program_temporaries)
from jaxserve.engine.runner import Runner
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.loading.weights import load_weights, shard_model
from jaxserve.model.hf_config import load_config
from tiny_models import SMALL_ENGINE

GIB = 2**30
EOS = 1
SIZED = {**SMALL_ENGINE, "num_pages": None, "gpu_memory_utilization": 0.5}


@pytest.mark.quick
def test_the_pool_is_the_share_less_weights_temporaries_and_margin():
    budget = MemoryBudget.of(80 * GIB, 0.9, 16 * GIB, 0, {"step": 1 * GIB, "decode": 3 * GIB})
    assert budget.temp_program == "decode" and budget.temp_bytes == 3 * GIB
    assert budget.margin_bytes == int(0.02 * 80 * GIB)  # 1.6 GiB
    assert budget.kv_cache_bytes == int(72 * GIB) - 16 * GIB - 3 * GIB - int(1.6 * GIB)
    assert "80.00 GiB x gpu_memory_utilization 0.9 - 16.00 GiB weights - 3.00 GiB the " \
           "temporaries of the decode program - 1.60 GiB the margin = 51.40 GiB" \
           in budget.arithmetic()
    assert budget.problem(51 * GIB) is None
    # others hold 20 GiB: only 60 of the 72 allowed are left
    shared = MemoryBudget.of(80 * GIB, 0.9, 16 * GIB, 20 * GIB, {"step": 3 * GIB})
    assert shared.kv_cache_bytes == 60 * GIB - 16 * GIB - 3 * GIB - int(1.6 * GIB)  # 39.4


@pytest.mark.quick
@pytest.mark.parametrize("weights, temp, others, named", [
    (70, 1, 0, "weights (70.00 GiB)"),
    (10, 65, 0, "the temporaries of the spec program (65.00 GiB)"),
    (10, 1, 70, "memory in use by others (70.00 GiB)"),
])
def test_a_budget_that_cannot_hold_a_sequence_names_the_term_too_big(weights, temp, others,
                                                                     named):
    budget = MemoryBudget.of(80 * GIB, 0.9, weights * GIB, others * GIB, {"spec": temp * GIB})
    problem = budget.problem(1 * GIB)
    assert f"the largest term is {named}" in problem
    assert "gpu_memory_utilization" in problem


@pytest.fixture(scope="module")
def model(folder):
    return load_weights(folder, load_config(folder), progress=False)


def test_a_donated_programs_temporaries_do_not_grow_with_the_pool(model):
    """The largest program of each kind: its temporaries and unaliased outputs, compiled by
    XLA:CPU for a 9-page and a 900-page pool (8 KiB a page here: 7 MiB apart), are the
    same bytes."""
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    config = EngineConfig(**SMALL_ENGINE)
    needs = []
    for pages in (9, 900):
        runner = Runner(abstract_module(shard_model(model, mesh), mesh), config, pages, mesh)
        needs.append({b: program_temporaries(runner.program(*b))  # those the budget reads
                      for b in largest_buckets(runner.bucket_programs())})
    assert needs[0] == needs[1]
    assert all(need > 0 for need in needs[0].values())


def test_an_engine_given_a_device_limit_sizes_its_pool_after_compiling(model, folder):
    """64 MiB allowed, half of it to this engine: the pool is 32 MiB less the weights (their
    numpy bytes), the largest program's needs (read from the engine's own programs, compiled
    for the real pool) and 2% of 64 MiB, in pages of 2 layers x K/V x 16 tokens x 2 kv heads
    x 16 dims x 4 bytes."""
    limit = 64 << 20
    engine = Engine(model, EngineConfig(**SIZED), Tokenizer(folder), [EOS], progress=False,
                    device_bytes_limit=limit)
    weights = sum(np.asarray(a).nbytes for a in jax.tree.leaves(nnx.state(model)))
    temporaries = max(program_temporaries(c) for c in engine.runner._compiled.values())
    page = 2 * 2 * 16 * 2 * 16 * 4
    margin = int(0.02 * limit)
    assert engine.num_pages == (limit // 2 - weights - temporaries - margin) // page
    assert engine.memory_budget.weights_bytes == weights
    assert engine.runner.caches[0][0].shape[0] == engine.num_pages
    with pytest.raises(ValueError, match=r"the KV cache needs at least 0.00 GiB .* the "
                                         r"largest term is weights"):
        Engine(model, EngineConfig(**SIZED), Tokenizer(folder), [EOS], progress=False,
               device_bytes_limit=3 << 19)  # 0.75 MiB of 1.5: not even the weights fit


@pytest.mark.quick
def test_a_cpu_without_a_limit_is_sized_as_before(model):
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    assert pages_after_compiling(model, EngineConfig(**SIZED), np.float32, mesh,
                                 jax.devices()[0]) is None


@pytest.mark.quick
def test_the_probe_compiles_the_largest_bucket_of_each_kind():
    buckets = [("step", 64, 8), ("step", 128, 8), ("step", 128, 16), ("step", 64, 16),
               ("decode", 8, 8), ("decode", 16, 16), ("spec", 4, 4)]
    assert largest_buckets(buckets) == [("step", 128, 16), ("decode", 16, 16),
                                        ("spec", 4, 4)]
