"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) against `transformers`.

The reference is `log_softmax` of transformers' float32 logits on the same folder: entry p
of a prompt must hold prompt token p's log-probability given tokens 0..p-1, and the most
likely tokens there. Checked through chunked prefill (a 32-token budget cuts a 71-token
prompt into three chunks, batched beside another request), after the prompt's pages were
cached by an earlier request (a prefix-cache hit must not lose the entries of the cached
pages), and with max_tokens 0 (the prompt scored, nothing generated), with no compile after
warm-up.
"""

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from tiny_models import SMALL_ENGINE, build_model

TOP = 5
LONG = [0] + list(range(5, 75))  # 71 tokens: three chunks of a 32-token budget
SHORT = [0, 9, 4, 33, 2, 18]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf_model = build_model("llama", folder)
    engine = {**SMALL_ENGINE, "max_num_batched_tokens": 32, "token_buckets": (16, 32),
              "strict_compile": True}
    return hf_model, LLM(str(folder), dtype="float32", progress=False, **engine)


def reference(hf_model, prompt: list[int]) -> np.ndarray:
    """`[L, V]` float64 log-probabilities of the token after each position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def check_entries(entries, prompt: list[int], expected: np.ndarray) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        entry = entries[p]
        assert entry[prompt[p]] == pytest.approx(expected[p - 1, prompt[p]], abs=1e-4)
        top = np.argsort(-expected[p - 1])[:TOP]
        assert set(top) <= set(entry) and len(entry) <= TOP + 1
        for token in top:
            assert entry[token] == pytest.approx(expected[p - 1, token], abs=1e-4)


def test_chunked_prefill_entries_equal_transformers(models):
    hf_model, llm = models
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP)
    long, short = llm.generate([{"prompt_token_ids": LONG}, {"prompt_token_ids": SHORT}],
                               params)
    check_entries(long.prompt_logprobs, LONG, reference(hf_model, LONG))
    check_entries(short.prompt_logprobs, SHORT, reference(hf_model, SHORT))
    assert len(long.outputs[0].token_ids) == 3
    assert llm.engine.stats().compiles_after_warmup == 0


def test_cached_prefix_still_returns_every_entry(models):
    hf_model, llm = models
    prompt = LONG[:40] + [99, 98, 97]
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([{"prompt_token_ids": LONG}], plain)  # caches LONG's first pages
    hits_before = llm.engine.stats().prefix_cache_hits
    again = llm.generate([{"prompt_token_ids": prompt}], plain)[0]
    assert llm.engine.stats().prefix_cache_hits > hits_before  # others do read the cache
    scored = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP))[0]
    check_entries(scored.prompt_logprobs, prompt, reference(hf_model, prompt))
    assert scored.outputs[0].token_ids == again.outputs[0].token_ids


def test_max_tokens_zero_scores_the_prompt_only(models):
    hf_model, llm = models
    out = llm.generate([{"prompt_token_ids": SHORT}],
                       SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    assert out.outputs[0].finish_reason == "length"
    expected = reference(hf_model, SHORT)
    for p in range(1, len(SHORT)):
        assert out.prompt_logprobs[p][SHORT[p]] == pytest.approx(expected[p - 1, SHORT[p]],
                                                                 abs=1e-4)
    assert llm.engine.stats().num_running == 0 and llm.engine.stats().num_waiting == 0


@pytest.mark.parametrize("params, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
])
def test_bad_values_name_the_field(params, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**params)
    assert info.value.field == field
