"""The Python API users call: prompts, stops, seeds, chat, errors, and no recompiles."""

import pytest

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.engine.runner import CompileAfterWarmupError
from tiny_models import SMALL_ENGINE, build_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_model("llama", folder)
    return LLM(str(folder), dtype="float32", progress=False,
               **{**SMALL_ENGINE, "max_model_len": 64, "strict_compile": True})


def test_string_prompts_equal_their_token_ids(llm):
    text = "Once upon a time"
    by_text = llm.generate(text, GREEDY)[0]
    ids = llm.tokenizer.encode(text)
    by_ids = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0]
    assert by_text.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.tokenizer.decode(by_ids.outputs[0].token_ids)


def test_results_come_back_in_order_beyond_max_num_seqs(llm):
    prompts = [{"prompt_token_ids": [0, i + 2, i + 3]} for i in range(11)]
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts[:3]]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert len(together) == 11 and together[:3] == alone


def test_stop_token_ids_and_eos_finish_with_stop(llm):
    free = llm.generate([{"prompt_token_ids": [0, 5, 6]}], GREEDY)[0].outputs[0]
    stop_at = free.token_ids[3]
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                            ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [0, 5, 6]}], params)[0].outputs[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 12


def test_stop_string_cuts_text_before_it(llm):
    free = llm.generate("The fox", GREEDY)[0].outputs[0]
    stop = free.text[5:8]
    assert len(stop) == 3
    params = SamplingParams(temperature=0, max_tokens=12, stop=stop, ignore_eos=True)
    out = llm.generate("The fox", params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index(stop)]
    assert out.token_ids == free.token_ids[:len(out.token_ids)]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": [0, 9, 8]}], seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [0, 4 + i]} for i in range(3)]
    mixed = llm.generate([{"prompt_token_ids": [0, 9, 8]}] + others,
                         [seeded] + [SamplingParams(temperature=0.7, max_tokens=5)] * 3)
    assert mixed[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": [0, 9, 8]}], other_seed
                        )[0].outputs[0].token_ids != alone


def test_generation_is_capped_by_max_model_len(llm):
    prompt = {"prompt_token_ids": list(range(2, 62))}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "Hello"}]
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(messages)
    assert len(out.outputs[0].token_ids) == 12


def test_nothing_compiles_after_warm_up(llm):
    """strict_compile is on: serving any mix of requests must stay within warmed buckets."""
    llm.generate([{"prompt_token_ids": list(range(2, 2 + n))} for n in (1, 15, 40, 63)],
                 [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7), GREEDY,
                  SamplingParams(temperature=0, max_tokens=1), GREEDY])
    assert llm.engine.runner.compiles_after_warmup == 0
    with pytest.raises(CompileAfterWarmupError):
        llm.engine.runner.program("step", 48, 2)  # a shape no ladder has


@pytest.mark.parametrize("prompt, message", [
    ("", r"prompts\[0\] is empty"),
    ({"prompt_token_ids": []}, r"prompts\[0\]: prompt has no tokens"),
    ({"prompt_token_ids": list(range(64))}, "max_model_len"),
    ({"prompt_token_ids": [5, 100000]}, r"prompts\[0\]: .*outside"),
    (42, "must be a str or a dict"),
])
def test_bad_prompts_are_clear_errors(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY)


def test_a_lora_request_needs_enable_lora(llm, tmp_path):
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(["Hello"], GREEDY, lora_request=LoRARequest("sql", 1, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_request has 2 entries for 1 prompts"):
        llm.generate(["Hello"], GREEDY, lora_request=[None, None])


def test_bad_construction_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        LLM(str(tmp_path / "nope"))
    build_model("llama", tmp_path)
    with pytest.raises(ValueError, match="unknown engine option.*page_sise"):
        LLM(str(tmp_path), page_sise=16)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tmp_path), dtype="float8")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tmp_path), max_model_len=10_000)
    with pytest.raises(ValueError, match="page_size"):
        LLM(str(tmp_path), page_size=24)


@pytest.mark.quick
def test_the_python_api_probes_only_this_hosts_platforms():
    """`from jaxserve import LLM` on a CPU machine with the `aot` extra (libtpu, the CUDA
    plugin) installed, as the README's test command installs it: JAX starts its CPU backend
    without probing the plugins, so nothing is printed (it printed 26 lines of TPU and cuDNN
    failures when only the command line chose the platform)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-c", "from jaxserve import LLM\nimport jax\n"
                           "print(jax.devices()[0].platform)"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu"
    assert done.stderr == "", done.stderr
