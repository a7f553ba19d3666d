"""Deterministic inference (`enable_deterministic_inference`): one request's tokens,
log-probabilities and prompt log-probabilities are bitwise the same alone, in batches of
several sizes at several positions, with chunked prefill at two chunk sizes, after a
prefix-cache hit, after preemption and recompute, with greedy n-gram speculation, at
tensor-parallel size 2, and when it samples with its own seed; for a dense model and a
mixture of experts, in float32 and bfloat16.

Every comparison is `np.array_equal` on float32 log-probabilities. One engine per setting
and (model, dtype) is built once for the module (module fixtures), so the module compiles
about a dozen tiny engines.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import BATCH_INVARIANT_ENV, EngineConfig
from tiny_models import LADDERS, SMALL_ENGINE, build_model

DETERMINISTIC = dict(SMALL_ENGINE, **LADDERS, enable_deterministic_inference=True)
# Chunks of 16 tokens and a page pool too small for the batch below: prompts are split
# over steps and running requests are preempted and recomputed.
TIGHT = dict(DETERMINISTIC, max_num_batched_tokens=16, token_buckets=(16,),
             seq_buckets=(8,), num_pages=12)
SPECULATIVE = dict(DETERMINISTIC, speculative_config={"method": "ngram",
                                                      "num_speculative_tokens": 3})
MATRIX = [("llama", "float32"), ("llama", "bfloat16"), ("qwen3_moe", "float32"),
          ("qwen3_moe", "bfloat16")]

_rng = np.random.default_rng(61)
# the request watched: a pattern that repeats, so the n-gram drafter proposes from it
TARGET = [int(t) for t in _rng.integers(3, 300, 13)] * 2 + [int(t) for t in
                                                            _rng.integers(3, 300, 11)]
OTHERS = [[int(t) for t in _rng.integers(3, 300, n)] for n in (5, 50, 23, 9, 70, 3, 31)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=2,
                        ignore_eos=True)


@dataclasses.dataclass
class Result:
    tokens: list[int]
    logprobs: np.ndarray  # the generated tokens' and their top ones' log-probabilities
    prompt_logprobs: np.ndarray | None  # the prompt's likewise (None: not asked)

    def assert_same(self, other: "Result", what: str) -> None:
        assert self.tokens == other.tokens, what
        pairs = [(self.logprobs, other.logprobs)]
        if self.prompt_logprobs is not None and other.prompt_logprobs is not None:
            pairs.append((self.prompt_logprobs, other.prompt_logprobs))
        for mine, theirs in pairs:
            assert np.array_equal(mine, theirs), (
                f"{what}: max |d logprob| {np.abs(mine - theirs).max()}")


def _flat(per_token: list[dict[int, float]]) -> np.ndarray:
    return np.asarray([v for top in per_token for _, v in sorted(top.items())], np.float32)


def watched(llm: LLM, batch: list[list[int]], position: int, params=PARAMS) -> Result:
    """The outputs of `TARGET` generated at `position` among the prompts `batch`."""
    prompts = batch[:position] + [TARGET] + batch[position:]
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)[position]
    completion = out.outputs[0]
    prompt = None if out.prompt_logprobs is None else _flat(out.prompt_logprobs[1:])
    return Result(list(completion.token_ids), _flat(completion.logprobs), prompt)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    paths = {}
    for arch in ("llama", "qwen3_moe"):
        paths[arch] = tmp_path_factory.mktemp(arch)
        build_model(arch, paths[arch])
    return paths


@dataclasses.dataclass
class Case:
    folder: str
    dtype: str
    llm: LLM  # DETERMINISTIC
    alone: Result  # TARGET alone on `llm`, prefix cache empty

    def engine(self, **options) -> LLM:
        return LLM(self.folder, dtype=self.dtype, progress=False, **options)


@pytest.fixture(scope="module", params=MATRIX, ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, folders):
    arch, dtype = request.param
    llm = LLM(str(folders[arch]), dtype=dtype, progress=False, **DETERMINISTIC)
    return Case(str(folders[arch]), dtype, llm, watched(llm, [], 0))


def test_batch_sizes_and_positions(case):
    """Batches of 3 and 8 (other buckets of tokens and rows; with 8, prefill chunked at 64
    and mixed with decode rows), the request first, in the middle and last."""
    for size in (3, 8):
        others = OTHERS[:size - 1]
        for position in sorted({0, size // 2, size - 1}):
            watched(case.llm, others, position).assert_same(
                case.alone, f"batch of {size}, position {position}")


def test_prefix_cache_hit(case):
    """After a request that shares its first two pages, and after itself (all whole pages).
    A request asking for prompt log-probabilities computes its whole prompt, so these ask
    for the generated tokens' only."""
    params = dataclasses.replace(PARAMS, prompt_logprobs=None)
    before = case.llm.engine.stats().prefix_cache_hits
    case.llm.generate([{"prompt_token_ids": TARGET[:32] + [7, 8, 9]}], params)
    watched(case.llm, [], 0, params).assert_same(case.alone, "two pages from the cache")
    watched(case.llm, [], 0, params).assert_same(case.alone, "whole pages from the cache")
    assert case.llm.engine.stats().prefix_cache_hits - before >= 64


def test_chunked_prefill_and_preemption(case):
    """Chunks of 16 tokens, alone and in a batch whose pages run out (preempted requests
    recompute their prompts and generated tokens as prefill)."""
    tight = case.engine(**TIGHT)
    watched(tight, [], 0).assert_same(case.alone, "chunks of 16")
    watched(tight, OTHERS, 3).assert_same(case.alone, "chunks of 16, batch of 8, preempted")
    assert tight.engine.stats().num_preemptions > 0


def test_greedy_speculative_decoding(case):
    """n-gram proposals verified several tokens a row at a time, alone and in a batch."""
    speculative = case.engine(**SPECULATIVE)
    watched(speculative, [], 0).assert_same(case.alone, "n-gram speculation")
    watched(speculative, OTHERS[:4], 2).assert_same(case.alone,
                                                     "n-gram speculation, batch of 5")


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("qwen3_moe", "bfloat16")])
def test_tensor_parallel_two(folders, arch, dtype):
    """At tp 2 (heads and the MLP split, sums all-reduced) the request is the same alone,
    in a batch and after preemption; tp 2 need not equal tp 1."""
    llm = LLM(str(folders[arch]), dtype=dtype, progress=False, tensor_parallel_size=2,
              **DETERMINISTIC)
    alone = watched(llm, [], 0)
    watched(llm, OTHERS, 5).assert_same(alone, "tp 2, batch of 8")
    watched(llm, OTHERS[:2], 1).assert_same(alone, "tp 2, batch of 3")


def test_default_mode_is_not_batch_invariant(folders):
    """Without the option the same request's bits do move with its batch (what the option
    is for); its tokens here still agree."""
    llm = LLM(str(folders["llama"]), dtype="float32", progress=False,
              **dict(DETERMINISTIC, enable_deterministic_inference=False))
    alone = watched(llm, [], 0)
    batched = [watched(llm, OTHERS[:size - 1], position)
               for size, position in ((3, 1), (8, 7))]
    assert any(not np.array_equal(alone.logprobs, b.logprobs) for b in batched)


def test_option_reads_vllm_switch_and_refuses_other_backends(folders, monkeypatch):
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert EngineConfig().enable_deterministic_inference is True
    assert not EngineConfig(enable_deterministic_inference=False).enable_deterministic_inference
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "0")
    assert EngineConfig().enable_deterministic_inference is False
    with pytest.raises(ValueError, match="enable_deterministic_inference"):
        LLM(str(folders["llama"]), progress=False, attention_backend="reference",
            **DETERMINISTIC)


def test_seeded_sampling(case):
    """A request that samples (temperature 1, top-p) with its own seed, alone and in batches."""
    params = dataclasses.replace(PARAMS, temperature=1.0, top_p=0.9, seed=5)
    alone = watched(case.llm, [], 0, params)
    for size, position in ((3, 2), (8, 4)):
        watched(case.llm, OTHERS[:size - 1], position, params).assert_same(
            alone, f"seeded sampling, batch of {size}, position {position}")
