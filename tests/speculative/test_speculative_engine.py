"""N-gram speculative decoding through the engine (`speculative_config`), against the target
alone and transformers.

- Exactness: greedy and seeded requests (temperature, top-k, top-p, min-p, log-probabilities,
  stop tokens, length limits) give the tokens the same engine gives without speculation, in
  a batch with rows that cannot speculate (penalties, a grammar); so do they with a draft
  model that is often wrong, and a draft identical to the target has every draft accepted.
- Distribution: unseeded sampling with a prompt-lookup draft that is often wrong (so both
  acceptance and rejection happen) follows transformers' probabilities (a chi-square test on
  the first three tokens).
- Pages of rejected drafts are freed, nothing compiles after warm-up, and `/metrics` carries
  vLLM's spec_decode counters.
"""

import numpy as np
import pytest
import torch
import transformers
from scipy import stats

from jaxserve import LLM, SamplingParams
from jaxserve.engine.prometheus import PrometheusMetrics
from tiny_models import SMALL_ENGINE

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
PATTERN = [17, 40, 98, 203, 5, 77]  # prompts repeat it, so lookups find drafts


@pytest.fixture(scope="module")
def base(folder):
    return LLM(str(folder), dtype="float32", progress=False, **SMALL_ENGINE)


@pytest.fixture(scope="module")
def spec(folder):
    return LLM(str(folder), dtype="float32", progress=False, strict_compile=True,
               speculative_config=SPEC, **SMALL_ENGINE)


def prompts():
    return [{"prompt_token_ids": (PATTERN * 6)[:n]} for n in (9, 14, 23, 31)]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=37, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05, seed=3, max_tokens=30,
                   ignore_eos=True, logprobs=3),
], ids=["greedy", "seeded", "filtered-logprobs"])
def test_tokens_equal_the_target_alone(base, spec, params):
    before = spec.engine.metrics.snapshot()["counters"]
    want, got = base.generate(prompts(), params), spec.generate(prompts(), params)
    assert tokens(got) == tokens(want)
    if params.logprobs:
        for w, g in zip(want, got):
            for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                assert a.keys() == b.keys()
                np.testing.assert_allclose(list(a.values()), [b[t] for t in a], atol=1e-5)
    after = spec.engine.metrics.snapshot()["counters"]
    proposed = after["spec_decode_num_draft_tokens"] - before.get(
        "spec_decode_num_draft_tokens", 0)
    accepted = after["spec_decode_num_accepted_tokens"] - before.get(
        "spec_decode_num_accepted_tokens", 0)
    assert proposed > 0  # drafts were verified, not skipped
    if params.temperature == 0:
        assert accepted > 0  # and kept: the greedy text repeats itself


def test_stop_tokens_and_lengths_cut_where_the_target_alone_does(base, spec):
    free = SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)
    run = base.generate(prompts(), free)
    stop = run[2].outputs[0].token_ids[9]  # a token the third prompt samples mid-way
    params = [SamplingParams(temperature=1.0, seed=11, max_tokens=n, ignore_eos=True,
                             stop_token_ids=[stop]) for n in (30, 5, 30, 2)]
    want, got = base.generate(prompts(), params), spec.generate(prompts(), params)
    assert tokens(got) == tokens(want)
    assert [o.outputs[0].finish_reason for o in got] == [
        o.outputs[0].finish_reason for o in want]
    assert got[2].outputs[0].finish_reason == "stop"


def test_rows_that_cannot_speculate_run_beside_rows_that_do(base, spec):
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             repetition_penalty=1.4, presence_penalty=0.5),
              SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True,
                             frequency_penalty=0.3),
              SamplingParams(temperature=1.0, seed=2, max_tokens=12,
                             structured_outputs={"choice": ["fox", "forest", "time"]})]
    texts = ["Once upon a time"] * 4
    want, got = base.generate(texts, params), spec.generate(texts, params)
    assert tokens(got) == tokens(want)
    assert got[3].outputs[0].text in ("fox", "forest", "time")


def test_pages_of_rejected_drafts_are_freed_and_nothing_compiles(spec):
    engine = spec.engine
    spec.generate(prompts(), SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True))
    allocator = engine.replicas[0].allocator
    assert allocator.num_free_pages == engine.num_pages - 1  # only the padding page held
    assert engine.stats().compiles_after_warmup == 0
    kinds = {kind for kind, _, _ in engine.runner.bucket_programs()}
    assert kinds == {"step", "spec"}


def test_metrics_have_vllm_spec_decode_names(spec):
    spec.generate(prompts()[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    metrics = PrometheusMetrics()
    metrics.attach(spec.engine, "ngram-model")
    text = metrics.render().decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        line = next(x for x in text.splitlines() if x.startswith(name + "{"))
        assert 'model_name="ngram-model"' in line and float(line.split()[-1]) > 0
    per_pos = [x for x in text.splitlines()
               if x.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert sorted(x.split('position="')[1][0] for x in per_pos) == ["0", "1", "2"]


def exact_joint(folder, prompt: list[int], top_k: int, length: int) -> dict[tuple, float]:
    """P(first `length` tokens) at temperature 1 with top-k, from transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, p in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            top = torch.topk(logits, top_k)
            probs = torch.softmax(top.values, -1)
            for token, q in zip(top.indices.tolist(), probs.tolist()):
                grown[prefix + (token,)] = p * q
        joint = grown
    return joint


def test_unseeded_sampling_follows_transformers_distribution(folder, base, spec):
    # The prompt holds samples of the target's own (top-3) continuations, so lookups propose
    # what the target sometimes samples: drafts are both accepted and rejected.
    top_k, length, samples = 3, 4, 540
    continuations = base.generate([{"prompt_token_ids": PATTERN * 2}] * 6, [
        SamplingParams(temperature=1.0, top_k=top_k, seed=s, max_tokens=6, ignore_eos=True)
        for s in range(6)])
    prompt = PATTERN * 2 + sum(tokens(continuations), []) + PATTERN * 2
    before = spec.engine.metrics.snapshot()["counters"]
    outs = spec.generate([{"prompt_token_ids": prompt}] * samples,
                         SamplingParams(temperature=1.0, top_k=top_k, max_tokens=length,
                                        ignore_eos=True))
    after = spec.engine.metrics.snapshot()["counters"]
    proposed, accepted = (after[name] - before.get(name, 0) for name in (
        "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
    assert 0 < accepted < proposed  # acceptance and rejection both exercised
    joint = exact_joint(folder, prompt, top_k, length)
    observed = {key: 0 for key in joint}
    for out in tokens(outs):
        observed[tuple(out)] += 1  # a sequence outside the top-k support is a KeyError
    cells = sorted(joint, key=joint.get, reverse=True)
    expected = np.asarray([joint[c] for c in cells]) * samples
    counts = np.asarray([observed[c] for c in cells])
    # pool the rare cells so every expected count is at least 5
    big = expected >= 5
    if not big.all():
        expected = np.append(expected[big], expected[~big].sum())
        counts = np.append(counts[big], counts[~big].sum())
    assert stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue > 1e-3


@pytest.fixture(scope="module")
def poor_draft(tmp_path_factory):
    """A one-layer random model of the target's vocabulary: a draft that is often wrong."""
    from tiny_models import build_model

    path = tmp_path_factory.mktemp("draft")
    build_model("llama", path, seed=5, num_layers=1)
    return path


@pytest.mark.slow  # CI's slow step; the target as its own draft stays in the main suite
def test_a_draft_model_keeps_the_target_tokens(folder, base, poor_draft):
    llm = LLM(str(folder), dtype="float32", progress=False, strict_compile=True,
              speculative_config={"method": "draft_model", "model": str(poor_draft),
                                  "num_speculative_tokens": 3}, **SMALL_ENGINE)
    batch = prompts() + [{"prompt_token_ids": [3] * 40}]
    for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_p=0.95, seed=4, max_tokens=30,
                                  ignore_eos=True, logprobs=2)):
        assert tokens(llm.generate(batch, params)) == tokens(base.generate(batch, params))
    counters = llm.engine.metrics.snapshot()["counters"]
    assert counters["spec_decode_num_draft_tokens"] > 0
    assert llm.engine.replicas[0].allocator.num_free_pages == llm.engine.num_pages - 1


def test_the_target_as_its_own_draft_is_always_accepted(folder, base):
    """A draft with the target's weights proposes the target's greedy tokens, so every draft
    is accepted: its KV cache (filled by prompt steps, re-fed and extended each round, and fed
    by the plain decode loop while more rows run than `disable_by_batch_size`) holds what the
    target's holds."""
    llm = LLM(str(folder), dtype="float32", progress=False,
              speculative_config={"method": "draft_model", "model": str(folder),
                                  "num_speculative_tokens": 3, "disable_by_batch_size": 2},
              **SMALL_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate(prompts()[:1], params)  # alone: speculates from the first decode step
    drafted_alone = llm.engine.metrics.snapshot()["counters"]["spec_decode_num_draft_tokens"]
    # Four at once (prompts beside decodes): the plain loop runs them until two finish, then
    # the other two speculate on the draft cache the plain loop kept.
    mixed = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 40) * 2]
    assert tokens(llm.generate(prompts(), mixed)) == tokens(base.generate(prompts(), mixed))
    counters = llm.engine.metrics.snapshot()["counters"]
    assert counters["spec_decode_num_draft_tokens"] - drafted_alone > 40
    assert counters["spec_decode_num_accepted_tokens"] == counters[
        "spec_decode_num_draft_tokens"]


def test_speculative_config_is_checked_by_key(folder):
    bad = [({"method": "medusa", "num_speculative_tokens": 2}, "not supported yet"),
           ({"method": "ngarm", "num_speculative_tokens": 2}, "method must be one of"),
           ({"method": "ngram"}, "num_speculative_tokens is required"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2}, "prompt_lookup_min"),
           ({"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}, "draft_tp"),
           ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required"),
           ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "has no model")]
    for config, message in bad:
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), progress=False, speculative_config=config, **SMALL_ENGINE)


def test_a_draft_of_another_vocabulary_is_refused(folder, tmp_path):
    from tiny_models import build_model

    build_model("llama", tmp_path, num_layers=1, vocab_size=400)
    with pytest.raises(ValueError, match="speculative_config.model .* vocabulary of 400"):
        LLM(str(folder), progress=False, **SMALL_ENGINE, speculative_config={
            "method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})


def test_disable_by_batch_size_picks_programs_per_rung():
    from jaxserve.config.engine import EngineConfig

    config = EngineConfig(max_num_seqs=16, seq_buckets=(1, 2, 4, 8, 16),
                          speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                              "disable_by_batch_size": 5})
    assert config.decode_programs() == [("spec", 1), ("spec", 2), ("spec", 4), ("spec", 8),
                                        ("decode", 8), ("decode", 16)]
    assert config.speculative_config.prompt_lookup_min == 5  # vLLM's default
    assert [config.speculates(n) for n in (1, 5, 6)] == [True, True, False]



@pytest.mark.slow  # CI's slow step: Pallas interpret mode; plans compile it for TPU/GPU
def test_pallas_kernels_verify_drafts_as_the_reference_decodes(tmp_path):
    """The verification forward through the Pallas ragged kernel (interpret mode on CPU; what
    TPUs and GPUs run) keeps the tokens the reference backend decodes one at a time. head_dim
    64 because the kernels take 64/128/256."""
    from tiny_models import build_model

    build_model("llama_tied_headdim_rope3", tmp_path, head_dim=64)
    engine = dict(SMALL_ENGINE, seq_buckets=(2,), max_num_seqs=2, token_buckets=(32,),
                  max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    few = prompts()[:2]
    want = LLM(str(tmp_path), dtype="float32", progress=False, attention_backend="reference",
               **engine).generate(few, params)
    llm = LLM(str(tmp_path), dtype="float32", progress=False, attention_backend="pallas",
              speculative_config=SPEC, **engine)
    assert tokens(llm.generate(few, params)) == tokens(want)
    assert llm.engine.metrics.snapshot()["counters"]["spec_decode_num_accepted_tokens"] > 0
