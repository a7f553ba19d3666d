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


def test_pinned_layouts_serve_and_a_restart_reads_the_probe_from_the_store(tmp_path,
                                                                          monkeypatch):
    """The TPU path, on CPU: with the platform's layouts left to XLA (`PINNED_PLATFORMS`),
    a serving engine probes them from live weights (a probe lowered against the live arrays
    failed, so a TPU server pinned nothing), places the weights in them and gives
    transformers' greedy tokens. XLA:CPU, left free, lays the shipped model's 2-D weights out
    column-major, so the pinning is not a no-op. A second start on the same executable store
    reads the layouts kept beside the programs instead of compiling the probe again (here
    the probe is made to fail, which would pin nothing)."""
    import torch
    import transformers

    from jaxserve import SamplingParams
    from jaxserve.engine import weight_layouts as layouts_module
    from tiny_models import transformers_greedy

    monkeypatch.setattr(layouts_module, "PINNED_PLATFORMS", ("tpu", "cpu"))
    prompts = [[3, 17, 250, 9, 41], [5, 6]]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR,
                                                                 dtype=torch.float32)
    expected = [transformers_greedy(hf_model, p, 8) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = {**SMALL_ENGINE, "compilation_cache_dir": str(tmp_path)}

    def start() -> tuple[list, list]:
        llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", progress=False, **options)
        chosen = llm.engine.replicas[0].runner.weight_layouts()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return chosen, [o.outputs[0].token_ids for o in outputs]

    chosen, tokens = start()
    assert tokens == expected
    assert any(layout is not None and layout.major_to_minor == (0, 1) for layout in chosen)
    assert len(list(tmp_path.rglob("*.json"))) == 1  # the probe's layouts, kept

    def no_probe(*_, **__):
        raise AssertionError("a warm start compiled the layout probe")

    monkeypatch.setattr(layouts_module, "chosen_layouts", no_probe)
    again, tokens = start()
    assert again == chosen and tokens == expected
