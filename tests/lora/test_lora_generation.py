"""LoRA generation (`LLM(enable_lora=True)`, `generate(lora_request=...)`) against
transformers + peft: one batch mixing the base model and two adapters of different ranks,
target modules and scalings, token for token.

The prompts are the same for every adapter and longer than two pages, and the token budget
admits one prompt per step, so a later request would find the earlier ones' pages in the
prefix cache if the cache did not key pages by adapter. The two adapters share steps in two
slots, at tp 2 and 4: the stacks split like the base weights; at 4 the two kv heads are
repeated, the adapters' k/v columns with them. Adapters taking turns in too few slots are
tested over HTTP (tests/server/test_lora_server.py: one slot)."""

import pytest

from jaxserve import LLM, LoRARequest, SamplingParams
from peft_adapters import ADAPTERS, reference_tokens, write_adapter
from tiny_models import SMALL_ENGINE, build_model, put_on_grid

MAX_TOKENS = 12
PROMPTS = [[5 + (7 * i + 3 * p) % 300 for i in range(40 + p)] for p in range(2)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base folder, {adapter name: folder}, {None or adapter name: reference tokens})."""
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    build_model("llama", base)
    adapters = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        adapters[name] = root / name
        write_adapter(base, adapters[name], seed, **config)
    expected = {name: reference_tokens(base, adapters.get(name), PROMPTS, MAX_TOKENS)
                for name in (None, *ADAPTERS)}
    return base, adapters, expected


@pytest.mark.slow  # the main suite's LoRA parity runs over HTTP (test_lora_server.py)
@pytest.mark.parametrize("tp", [2, 4])  # 2: kv heads split as they are; 4: repeated
def test_a_batch_mixing_adapters_equals_transformers_and_peft(models, tp, max_loras=2):
    base, adapters, expected = models
    assert expected["attn"] != expected[None] != expected["everything"]  # each one matters
    llm = LLM(str(base), dtype="float32", progress=False, enable_lora=True,
              max_loras=max_loras, max_lora_rank=8, tensor_parallel_size=tp,
              **{**SMALL_ENGINE, "max_num_batched_tokens": 48, "token_buckets": (48,)})
    requests = {name: LoRARequest(name, i + 1, str(folder))
                for i, (name, folder) in enumerate(adapters.items())}
    order = [None, "attn", "everything", "attn", None, "everything"]
    prompts = [{"prompt_token_ids": PROMPTS[i % 2]} for i in range(len(order))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True),
                           lora_request=[requests.get(name) for name in order])
    for i, (name, output) in enumerate(zip(order, outputs)):
        assert output.outputs[0].token_ids == expected[name][i % 2], (i, name)
    assert llm.engine.runner.compiles_after_warmup == 0



@pytest.mark.slow  # CI's slow step
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_float_adapters_on_quantized_base_weights(tmp_path, method):
    """int8 / fp8 base weights with float adapters: on weights the method stores exactly,
    the tokens are transformers + peft's on the float weights."""
    hf = build_model("llama", tmp_path / "base")
    put_on_grid(hf, method)
    hf.save_pretrained(tmp_path / "base")
    write_adapter(tmp_path / "base", tmp_path / "adapter", 0, **ADAPTERS["everything"])
    expected = reference_tokens(tmp_path / "base", tmp_path / "adapter", PROMPTS, MAX_TOKENS)
    llm = LLM(str(tmp_path / "base"), dtype="float32", progress=False, quantization=method,
              enable_lora=True, max_lora_rank=8, **SMALL_ENGINE)
    stored = llm.model.layers[0].attn.q_proj[...].dtype
    assert stored.name == {"int8": "int8", "fp8": "float8_e4m3fn"}[method]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                          ignore_eos=True),
                           lora_request=LoRARequest("everything", 1, str(tmp_path / "adapter")))
    assert [o.outputs[0].token_ids for o in outputs] == expected
