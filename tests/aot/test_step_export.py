"""The whole serving step, not only the attention kernels, lowers for TPU and for CUDA.

CI has no accelerator, so this is where it proves that a bucket's programs still compile for
one: a `Runner` is built as the engine builds it (Pallas backend, i.e. the kernels pick
Mosaic or Triton at lowering time; the model placed on a one-device mesh) but not warmed up,
and the programs it would compile (`runner.program_inputs`: the "step" forward of one bucket and
the "decode" loop, with their donation and output shardings) are exported with `jax.export`
for each platform from this CPU machine. The exported module must carry that platform's
kernel call and not the other platform's, and keep every layer's K and V cache donated.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxserve.model.hf_config import load_config
from jaxserve.engine.engine_setup import engine_mesh
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.runner import Runner
from jaxserve.loading.weights import load_weights, shard_model
from tiny_models import SMALL_ENGINE, build_model

TRITON_CALL = "__gpu$xla.gpu.triton"
CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": TRITON_CALL}
OTHER_CALL = {"tpu": TRITON_CALL, "cuda": "tpu_custom_call"}
# Triton custom calls carry no export compatibility guarantee; allow them explicitly.
DISABLED = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
TOKENS, ROWS = 16, 2  # the step bucket exported; the decode loop uses ROWS


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_d64")
    build_model("llama", path, head_dim=64)  # the kernels take head_dim 64, 128 or 256
    return path


def make_runner(folder, dtype):
    """A runner on the engine's one-device mesh with the Pallas backend, not warmed up."""
    config = EngineConfig(**{**SMALL_ENGINE, "attention_backend": "pallas"})
    mesh = engine_mesh(config)
    model = shard_model(load_weights(folder, load_config(folder), dtype, progress=False), mesh)
    runner = Runner(model, config, config.num_pages, mesh)
    assert runner.attention.name == "pallas"  # platform dispatch, not the jnp paths
    return runner


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", ["step", "decode"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_program_lowers(folder, platform, kind, dtype):
    runner = make_runner(folder, dtype)
    jitted, args = runner.program_inputs(kind, TOKENS if kind == "step" else ROWS, ROWS)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        args)
    exported = jax.export.export(jitted, platforms=[platform], disabled_checks=DISABLED)(*args)
    text = exported.mlir_module()
    assert CUSTOM_CALL[platform] in text
    assert OTHER_CALL[platform] not in text
    assert text.count("tf.aliasing_output") == len(jax.tree.leaves(runner.caches))  # donated
