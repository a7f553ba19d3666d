"""No compiled program copies a weight (`jaxserve.engine.weight_layouts`).

A program that reads a weight in a layout other than the one it is handed copies the whole
array at every call; for a stack of layers XLA hoists the copies out of the decode loop, so
all of them are alive at once (XLA:TPU did this for Qwen3-30B-A3B's experts on v6e-8: 36 GiB
of temporaries). The audit must find a hand-built relayout, and find none in the default
engine's programs on CPU (dense and a mixture of experts), bucket by bucket. TPU programs,
where the runner pins the weights' layouts, are checked in tests/aot/test_plan.py."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.layout import Format, Layout

from jaxserve import LLM
from jaxserve.default_model import DEFAULT_MODEL_DIR
from jaxserve.engine.weight_layouts import weight_copies
from tiny_models import SMALL_ENGINE, build_model


def _loop_over(weight):
    """A decode-like loop multiplying by `weight` (`[256, 512]`) four times."""
    rows = jax.ShapeDtypeStruct((8, 256), jnp.float32, sharding=weight.sharding)
    loop = jax.jit(lambda w, x: jax.lax.fori_loop(
        0, 4, lambda _, h: jnp.tanh(h @ w)[:, :256], x))
    return loop.lower(weight, rows).compile()


def test_the_audit_finds_a_weight_read_in_another_layout():
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    weight = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=device)
    column_major = jax.ShapeDtypeStruct(weight.shape, weight.dtype,
                                        sharding=Format(Layout((1, 0)), device))
    assert weight_copies(_loop_over(weight).as_text(), [weight]) == 0
    assert weight_copies(_loop_over(column_major).as_text(), [weight]) == 1


@pytest.mark.parametrize("model", ["default", "moe"])
def test_no_program_of_the_cpu_engine_copies_a_weight(model, tmp_path):
    folder = DEFAULT_MODEL_DIR
    if model == "moe":
        folder = tmp_path / "moe"
        build_model("qwen3_moe", folder)
    llm = LLM(str(folder), **SMALL_ENGINE)
    runner = llm.engine.replicas[0].runner
    assert runner.weight_layouts() == []  # CPU: the default layouts, nothing pinned
    weights = runner.program_inputs("step", *runner.bucket_programs()[0][1:])[1][0]
    for bucket in runner.bucket_programs():
        assert weight_copies(runner.program(*bucket).as_text(), weights) == 0, bucket
