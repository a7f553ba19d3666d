"""The serving engine against the dense reference path, under load and edge cases."""

import random

import numpy as np
import pytest

from jaxserve.reference.dense_generation import DenseGenerator
from jaxserve.engine.engine import Engine
from jaxserve.engine.page_allocator import page_key
from jaxserve.config.engine import EngineConfig
from jaxserve.sampling.arrays import SamplingArrays
from jaxserve.sampling_params import SamplingParams
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.loading.weights import load_weights
from jaxserve.model.hf_config import load_config
from tiny_models import LADDERS, SMALL_ENGINE, build_model

EOS = 1
LOOPS = "final_only"  # the output kind whose all-decode steps run as decode loops


@pytest.fixture(scope="module")
def model(folder):
    return load_weights(folder, load_config(folder), progress=False)


def make_engine(model, folder, ladders: bool = True, **overrides):
    """The tiny engine with two rungs per ladder, so steps pad to several buckets (or, with
    `ladders=False`, its one step program and one decode loop, which other modules share)."""
    config = EngineConfig(**{**SMALL_ENGINE, **(LADDERS if ladders else {}), **overrides})
    return Engine(model, config, Tokenizer(folder), [EOS], progress=False)


def dense_reference(model, prompts, params, seeds, max_model_len=128):
    """Token ids the dense path generates for each request (rows are independent)."""
    max_new = [min(p.max_tokens, max_model_len - len(prompt))
               for prompt, p in zip(prompts, params)]
    stops = [sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})) for p in params]
    results = DenseGenerator(model).generate(
        prompts, max_new, stops, lambda rows: SamplingArrays.from_params(params, seeds, rows))
    return [ids for ids, _ in results]


def run_to_completion(engine, arrivals):
    """Feed requests at the given steps (step index → list of (id, prompt, params)) and step
    until everything finished. Returns finished sequences by id and all deltas."""
    sequences, deltas, step = {}, [], 0
    while arrivals or engine.has_unfinished():
        for request_id, prompt, params in arrivals.pop(step, []):
            sequences[request_id] = engine.add_request(request_id, prompt, params)
        deltas += engine.step()
        step += 1
        assert step < 2000, "engine did not finish"
    return sequences, deltas


def test_random_workload_with_preemption_equals_dense_reference(model, folder):
    """24 requests, prompts of 1 to ~5 pages, staggered arrival, a budget of 64 tokens per step
    (chunked prefill) and only 20 pages for 8 concurrent sequences (forces preemption)."""
    rng = random.Random(0)
    engine = make_engine(model, folder, num_pages=20)
    arrivals, prompts, params = {}, [], []
    for i in range(24):
        prompts.append([rng.randrange(2, 320) for _ in range(rng.choice([1, 5, 16, 17, 40, 70]))])
        params.append(SamplingParams(temperature=0, max_tokens=rng.choice([1, 3, 12, 30]),
                                     ignore_eos=i % 3 == 0, output_kind=LOOPS))
        arrivals.setdefault(rng.randrange(0, 30), []).append((f"r{i}", prompts[i], params[i]))
    expected = dict(zip((f"r{i}" for i in range(24)),
                        dense_reference(model, prompts, params, [0] * 24)))
    sequences, _ = run_to_completion(engine, arrivals)
    assert engine.stats().num_preemptions > 0
    for request_id, seq in sequences.items():
        assert seq.output_token_ids == expected[request_id], request_id
    assert engine.stats().kv_cache_usage == 0.0  # no page held by a finished request
    assert engine.runner.compiles_after_warmup == 0


def test_seeded_sampling_equals_dense_path_and_multi_step_equals_single_step(model, folder):
    prompts = [[0, 5, 6, 7], list(range(2, 40)), [9] * 20]
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=s, max_tokens=20,
                             ignore_eos=True, output_kind=LOOPS) for s in (11, 12, 13)]
    outputs = []
    for steps in (1, 4):  # one bucket each: what is compared is the decode loop's length
        engine = make_engine(model, folder, ladders=False, num_decode_steps=steps)
        arrivals = {0: [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]}
        sequences, _ = run_to_completion(engine, arrivals)
        outputs.append([sequences[f"r{i}"].output_token_ids for i in range(3)])
    assert outputs[0] == outputs[1]
    assert outputs[0] == dense_reference(model, prompts, params, [p.seed for p in params])


def test_decode_loops_around_a_mixed_step_equal_the_dense_path(model, folder):
    """Decode loops of a, b and d, a mixed step when c arrives at step 3 (the same bucket of 8
    rows), loops of all four, then of c alone (another bucket): greedy outputs equal the dense
    path, so a loop that attended to a stale or another row's context would show."""
    engine = make_engine(model, folder)
    prompts = [list(range(2, 20)), list(range(30, 35)), list(range(90, 100)),
               list(range(40, 80))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=LOOPS)
    first = [(r, prompt, params) for r, prompt in zip("abd", prompts)]
    sequences, _ = run_to_completion(engine, {0: first, 3: [("c", prompts[3], params)]})
    assert [sequences[r].output_token_ids for r in "abdc"] == dense_reference(
        model, prompts, [params] * 4, [0] * 4)


def test_prefix_cache_hits_and_outputs_unchanged(model, folder):
    shared = list(range(2, 50))  # 3 full pages
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = make_engine(model, folder)
    first, _ = run_to_completion(engine, {0: [("a", shared + [60], params)]})
    second, _ = run_to_completion(engine, {0: [("b", shared + [61, 62], params)]})
    assert second["b"].num_cached_tokens == 48
    assert engine.stats().prefix_cache_hits == 48
    assert [second["b"].output_token_ids] == dense_reference(model, [shared + [61, 62]],
                                                             [params], [0])


def test_a_colliding_page_key_or_another_cache_salt_computes_its_own_kv(model, folder):
    """Page keys are SHA-256 (`page_allocator`); even a key function that gives every page
    one key (injected here) cannot hand a request another's K/V, since a hit must hold the
    same parent and tokens. Requests with different `cache_salt` share no page."""
    engine = make_engine(model, folder)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, other = list(range(2, 50)) + [60], list(range(100, 148)) + [61]

    def run(request_id, prompt, salt=None):
        seq = engine.make_sequence(request_id, prompt, params, cache_salt=salt)
        engine.enqueue(seq)
        while engine.has_unfinished():
            engine.step()
        return seq

    for replica in engine.replicas:
        replica.allocator.key_of = lambda parent, tokens: b"one key for every page"
    run("a", first)
    collided = run("b", other)
    assert collided.num_cached_tokens == 0
    assert [collided.output_token_ids] == dense_reference(model, [other], [params], [0])

    for replica in engine.replicas:
        replica.allocator.key_of = page_key
        replica.allocator.forget_all()
    assert run("c", first, salt="tenant-1").num_cached_tokens == 0
    assert run("d", first, salt="tenant-2").num_cached_tokens == 0
    assert run("e", first).num_cached_tokens == 0
    again = run("f", first, salt="tenant-1")
    assert again.num_cached_tokens == 48
    assert [again.output_token_ids] == dense_reference(model, [first], [params], [0])
    with pytest.raises(ValueError, match="cache_salt"):
        engine.make_sequence("g", first, params, cache_salt="")


def test_generated_text_is_prefix_cached_after_a_decode_loop(model, folder):
    """A follow-up whose prompt is an earlier request's prompt plus its output (multi-turn
    chat) reuses the pages the decode loop filled."""
    engine = make_engine(model, folder, num_decode_steps=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=LOOPS)
    first, _ = run_to_completion(engine, {0: [("a", list(range(2, 16)), params)]})
    follow_up = first["a"].token_ids + [3, 4]  # 26 tokens: its first page is cached
    second, _ = run_to_completion(engine, {0: [("b", follow_up, params)]})
    assert second["b"].num_cached_tokens == 16


def test_abort_frees_pages_and_others_carry_on(model, folder):
    engine = make_engine(model, folder)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("keep", [0, 4, 5], params)
    engine.add_request("drop", list(range(2, 40)), params)
    engine.step()
    engine.step()
    engine.abort("drop")
    deltas = engine.step()
    dropped = [d for d in deltas if d.request_id == "drop"]
    assert dropped and dropped[0].finished and dropped[0].finish_reason == "abort"
    sequences, _ = run_to_completion(engine, {})
    assert engine.stats().kv_cache_usage == 0.0
    assert engine.metrics.snapshot()["finished_by_reason"] == {"abort": 1, "length": 1}


@pytest.mark.parametrize("output_kind", ["delta", LOOPS])
def test_streamed_text_adds_up_and_stop_strings_cut_it(model, folder, output_kind):
    engine = make_engine(model, folder)
    free_params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seqs, _ = run_to_completion(engine, {0: [("free", [0, 40, 41], free_params)]})
    full = engine.pop_output(seqs["free"]).outputs[0].text
    stop = full[6:9]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                            output_kind=output_kind)
    seqs, deltas = run_to_completion(engine, {0: [("cut", [0, 40, 41], params)]})
    final = engine.pop_output(seqs["cut"]).outputs[0]
    streamed = "".join(d.new_text for d in deltas if d.request_id == "cut")
    assert final.text == full[:full.index(stop)] == streamed
    assert final.finish_reason == "stop"


def test_eos_ends_a_request_with_stop(model, folder):
    engine = make_engine(model, folder)
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seqs, _ = run_to_completion(engine, {0: [("free", [0, 7, 8], free)]})
    tokens = seqs["free"].output_token_ids
    stop_params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tokens[2]])
    seqs, _ = run_to_completion(engine, {0: [("stop", [0, 7, 8], stop_params)]})
    out = seqs["stop"]
    assert out.output_token_ids == tokens[:tokens.index(tokens[2]) + 1]
    assert out.finish_reason == "stop"


@pytest.mark.slow  # the main suite runs the kernels in the engine on stacked layers, the
# TPU/GPU layout (tests/model/test_hf_parity.py, tests/model/test_moe.py)
def test_pallas_kernel_backend_equals_reference_backend(tmp_path):
    """The engine with the Pallas kernels (interpret mode on CPU) gives the reference's
    tokens on the layer loop. head_dim 64 because the kernels take 64/128/256."""
    build_model("llama_tied_headdim_rope3", tmp_path, head_dim=64)
    model = load_weights(tmp_path, load_config(tmp_path), progress=False)
    prompts = [[0, 3, 4], list(range(2, 30))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = []
    for backend in ("reference", "pallas"):
        engine = make_engine(model, tmp_path, attention_backend=backend)
        seqs, _ = run_to_completion(
            engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
        results.append([seqs[f"r{i}"].output_token_ids for i in range(2)])
    assert results[0] == results[1]
    assert np.all([len(r) == 6 for r in results[0]])


def _penalized_greedy(model, prompt, params, steps):
    """numpy reference: teacher-forced dense logits, vLLM's penalties, argmax."""
    dense = DenseGenerator(model)
    tokens = list(prompt)
    for _ in range(steps):
        logits = dense.logits([tokens])[0][-1].astype(np.float64)  # [V]
        generated = np.bincount(tokens[len(prompt):], minlength=logits.size)
        seen = np.bincount(tokens, minlength=logits.size) > 0
        rep = params.repetition_penalty
        logits = np.where(seen, np.where(logits > 0, logits / rep, logits * rep), logits)
        logits -= params.frequency_penalty * generated + params.presence_penalty * (generated > 0)
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):]


def test_penalties_match_a_numpy_reference_in_step_and_decode_loop(model, folder):
    prompt = [0, 9, 9, 10, 11, 9]
    cases = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=LOOPS,
                            **kw) for kw in (
        dict(repetition_penalty=1.8), dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0, repetition_penalty=0.7))]
    engine = make_engine(model, folder, num_decode_steps=4)
    seqs, _ = run_to_completion(engine, {0: [(f"r{i}", prompt, p) for i, p in enumerate(cases)]})
    plain = dense_reference(model, [prompt], [SamplingParams(temperature=0, max_tokens=10,
                                                              ignore_eos=True)], [0])[0]
    for i, params in enumerate(cases):
        expected = _penalized_greedy(model, prompt, params, 10)
        assert seqs[f"r{i}"].output_token_ids == expected
        assert expected != plain  # the penalty changed something


def test_logprobs_are_the_models_log_softmax(model, folder):
    engine = make_engine(model, folder)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                            output_kind=LOOPS)
    seqs, deltas = run_to_completion(engine, {0: [("r", [0, 5, 6, 7], params)]})
    out = engine.pop_output(seqs["r"]).outputs[0]
    streamed = [lp for d in deltas for lp in (d.new_logprobs or [])]
    assert streamed == out.logprobs and len(out.logprobs) == 6
    logits = DenseGenerator(model).logits([[0, 5, 6, 7] + out.token_ids])[0]
    reference = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - logits.max(-1, keepdims=True)  # [L, V] log-softmax
    for k, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[3 + k]
        top3 = np.argsort(-row)[:3]
        assert set(entry) == set(top3.tolist()) and token == top3[0]
        for t, value in entry.items():
            assert abs(value - row[t]) < 1e-4
