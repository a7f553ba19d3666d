"""Prefix-cache namespaces: a request's `cache_salt` and its LoRA adapter are separate fields
of the root key its pages chain from (`page_allocator.root_key`). They were once joined into
one string, `f"{salt}\\0lora:{adapter key}"`, so a base-model request whose salt spelled that
string found the adapter's pages and was answered with the adapter's K/V (the same bug is
open in vLLM, vllm-project/vllm#44701)."""

import pytest

from jaxserve import LLM, LoRARequest, SamplingParams
from peft_adapters import ADAPTERS, reference_tokens, write_adapter
from tiny_models import SMALL_ENGINE, build_model

MAX_TOKENS = 6
PROMPT = [5 + (7 * i) % 300 for i in range(40)]  # two full pages of 16, then 8 tokens
CACHED = 32  # the two full pages


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("namespaces")
    build_model("llama", root / "base")
    write_adapter(root / "base", root / "attn", 0, **ADAPTERS["attn"])
    llm = LLM(str(root / "base"), dtype="float32", progress=False, enable_lora=True,
              max_loras=1, max_lora_rank=8, **SMALL_ENGINE)
    adapter = llm.engine.load_lora(LoRARequest("attn", 1, str(root / "attn")))
    expected = reference_tokens(root / "base", None, [PROMPT], MAX_TOKENS)[0]
    return llm.engine, adapter, expected


def run(engine, request_id: str, salt=None, lora=None):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seq = engine.make_sequence(request_id, PROMPT, params, cache_salt=salt, lora=lora)
    engine.enqueue(seq)
    while engine.has_unfinished():
        engine.step()
    return seq


def test_a_salt_spelling_an_adapters_namespace_gets_no_hit(setup):
    engine, adapter, expected = setup
    run(engine, "adapter", lora=adapter)
    assert run(engine, "adapter-again", lora=adapter).num_cached_tokens == CACHED
    forged = run(engine, "forged", salt=f"\0lora:{adapter.key}")  # the old scheme's string
    assert forged.num_cached_tokens == 0
    assert forged.output_token_ids == expected  # the base model's tokens (transformers)
    salted = run(engine, "salted-adapter", salt="t", lora=adapter)
    assert salted.num_cached_tokens == 0  # a salt also separates an adapter's requests
    assert run(engine, "forged-salted", salt=f"t\0lora:{adapter.key}").num_cached_tokens == 0
