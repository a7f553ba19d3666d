"""Faults inside engine steps, injected through the runner's public launch methods: a failed
step fails only its own requests (finish reason "error"), frees their pages and the engine
goes on; a lost KV cache is rebuilt (the prefix cache emptied with it); a failure that keeps
coming makes the engine give up for good. Outputs after a fault are checked against
transformers."""

import jax
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.engine.step_results import MAX_CONSECUTIVE_FAILURES, EngineFailedError
from tiny_models import SMALL_ENGINE, build_model

PROMPT = list(range(3, 40))  # two full pages: a prefix-cache entry once it has run
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_and_llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf_model = build_model("llama", folder)
    return hf_model, LLM(str(folder), dtype="float32", progress=False, **SMALL_ENGINE)


def transformers_greedy(hf_model, prompt) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class Faults:
    """Makes the next `count` launches of `runner` raise (optionally deleting the KV cache
    first, as a program that failed on device after its inputs were donated would)."""

    def __init__(self, runner, monkeypatch):
        self.runner, self.count, self.lose_cache = runner, 0, False
        for name in ("launch_step", "launch_decode"):
            monkeypatch.setattr(runner, name, self._wrap(getattr(runner, name)))

    def _wrap(self, launch):
        def maybe_failing(*args):
            if self.count > 0:
                self.count -= 1
                if self.lose_cache:
                    for array in jax.tree.leaves(self.runner.caches):
                        array.delete()
                raise RuntimeError("injected fault")
            return launch(*args)
        return maybe_failing


def run(llm, prompt) -> tuple[list[int], str]:
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0]
    return out.token_ids, out.finish_reason


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(hf_and_llm, monkeypatch):
    hf_model, llm = hf_and_llm
    faults = Faults(llm.engine.runner, monkeypatch)
    faults.count = 1
    _, reason = run(llm, PROMPT)
    assert reason == "error"
    assert llm.engine.stats().kv_cache_usage == 0.0 and llm.engine.stats().num_running == 0
    assert run(llm, PROMPT) == (transformers_greedy(hf_model, PROMPT), "length")


def test_a_lost_kv_cache_is_rebuilt_and_the_prefix_cache_emptied(hf_and_llm, monkeypatch):
    hf_model, llm = hf_and_llm
    expected = transformers_greedy(hf_model, PROMPT)
    assert run(llm, PROMPT) == (expected, "length")  # its pages now key the prefix cache
    faults = Faults(llm.engine.runner, monkeypatch)
    faults.count, faults.lose_cache = 1, True
    other = [5, 6, 7]
    assert run(llm, other)[1] == "error"
    assert llm.engine.runner.caches_usable()
    # a stale prefix-cache hit would read the rebuilt, zeroed pages and answer wrongly
    assert run(llm, PROMPT) == (expected, "length")
    assert run(llm, other) == (transformers_greedy(hf_model, other), "length")


def test_a_failure_that_keeps_coming_makes_the_engine_give_up(tmp_path, monkeypatch):
    build_model("llama", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", progress=False, **SMALL_ENGINE)
    faults = Faults(llm.engine.runner, monkeypatch)
    faults.count = 10**6
    for i in range(MAX_CONSECUTIVE_FAILURES - 1):
        assert run(llm, [0, i + 2])[1] == "error"
    with pytest.raises(EngineFailedError, match="in a row"):
        run(llm, [0, 9])
    assert llm.engine.failure is not None
    with pytest.raises(EngineFailedError):
        llm.engine.step()
