"""A quantized KV cache through the serving engine.

The reference is the dense model run eagerly with an attention written here, whose keys and
values go through int8 / fp8 quantization done in numpy (int8: a scale per token and kv head,
absmax / 127; fp8: e4m3 after clipping to ±448): the engine's greedy tokens must be that
reference's, for each CPU-runnable backend. Prefix caching, preemption and tensor
parallelism (kv heads repeated when tp exceeds them) must not change the tokens of an int8
cache. The kernels' own quantized reads are tested in tests/kernels."""

import random

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.kv_cache import page_bytes
from jaxserve.loading.weights import load_weights
from jaxserve.model.hf_config import load_config
from jaxserve.model.contract import StepContext
from jaxserve.reference.dense_generation import DenseGenerator
from sweeps import sweep
from tiny_models import SMALL_ENGINE

PROMPTS = [[0, 5, 9, 22, 7], [0, 3], list(range(10, 31))]
NEW_TOKENS = 12


def numpy_round_trip(x: np.ndarray, kind: str, head_scale=None) -> np.ndarray:
    """x `[T, Hkv, D]` as a cache of `kind` gives it back (fp8: stored as x / head_scale
    `[Hkv]`, default 1)."""
    x = x.astype(np.float32)
    if kind == "int8":
        largest = np.abs(x).max(axis=-1, keepdims=True)
        scale = np.where(largest > 0, largest / 127.0, 1.0).astype(np.float32)
        return np.clip(np.round(x / scale), -127, 127) * scale
    scale = np.ones(x.shape[1], np.float32) if head_scale is None else head_scale
    codes = np.clip(x / scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return codes.astype(np.float32) * scale[:, None]


def numpy_causal_attention(q, k, v):
    """Causal attention in numpy: q `[T, Hq, D]`, k/v `[T, Hkv, D]` float32 → `[T, Hq, D]`."""
    q = np.asarray(q, np.float32)
    tokens, heads, head_dim = q.shape
    group = heads // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [T, Hq, D]
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim)
    scores = np.where(np.tril(np.ones((tokens, tokens), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return jnp.asarray(np.einsum("hts,shd->thd", weights, v))


def quantized_dense_greedy(model, prompt, steps, kind, head_scales=None):
    """Greedy tokens of the dense model whose attention reads numpy-quantized K/V (fp8:
    with head_scales[layer] = (k scale, v scale) `[Hkv]` each, default 1)."""
    def attention(layer_index, q, k, v, cache):  # q [T, Hq, D], k/v [T, Hkv, D]
        k_scale, v_scale = head_scales[layer_index] if head_scales else (None, None)
        k = numpy_round_trip(np.asarray(k), kind, k_scale)
        v = numpy_round_trip(np.asarray(v), kind, v_scale)
        return numpy_causal_attention(q, k, v), cache

    # Every step runs the same padded length (causal attention: the padding after the real
    # tokens changes none of their outputs), so each eager op compiles once, not per length.
    width = max(len(p) for p in PROMPTS) + NEW_TOKENS
    tokens = list(prompt)
    for _ in range(steps):
        ids = jnp.asarray(tokens + [0] * (width - len(tokens)), jnp.int32)
        hidden = model(ids, jnp.arange(width), [None] * len(model.layers),
                       StepContext(attention)).hidden
        tokens.append(int(jnp.argmax(model.logits(hidden[len(tokens) - 1]))))
    return tokens[len(prompt):]


def generate(folder, **options):
    llm = LLM(str(folder), dtype="float32", progress=False, **{**SMALL_ENGINE, **options})
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return llm, [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def references(folder):
    model = load_weights(folder, load_config(folder), jnp.float32, progress=False)
    with jax.default_device(jax.devices("cpu")[0]):
        return {kind: [quantized_dense_greedy(model, p, NEW_TOKENS, kind) for p in PROMPTS]
                for kind in ("int8", "fp8")}


@pytest.mark.parametrize("kind,backend", [("int8", "cpu"), ("fp8", "cpu"),
                                          ("int8", "reference")])
def test_engine_reads_the_cache_it_quantized(folder, references, kind, backend):
    """Greedy tokens = the numpy-quantized reference's, then again from the prefix cache."""
    llm, tokens = generate(folder, kv_cache_dtype=kind, attention_backend=backend)
    layer = llm.engine.replicas[0].runner.caches[0]
    assert layer[0].dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kind]
    assert len(layer) == 4  # int8 pages carry their scale pools, fp8 their head scales
    if kind == "fp8":
        np.testing.assert_array_equal(np.asarray(layer[2]), 1.0)  # uncalibrated: scale 1
    assert tokens == references[kind]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert llm.engine.stats().prefix_cache_hits > 0
    assert [list(o.outputs[0].token_ids) for o in again] == references[kind]


def calibrated_scales(model, prompt):
    """Per layer, (k scale, v scale) `[Hkv]` calibrated on the prompt as an fp8 cache does:
    the largest |k| (|v|) of each kv head over its tokens and head_dim, x 2 / 448, computed
    in numpy layer by layer, each layer attending over K/V stored with its new scales."""
    found = {}

    def attention(layer_index, q, k, v, cache):  # calibrates, then attends in numpy
        scales = tuple(np.where(a > 0, a * 2.0 / 448.0, 1.0) for a in (
            np.abs(np.asarray(x, np.float32)).max(axis=(0, 2)) for x in (k, v)))
        found[layer_index] = scales
        k, v = (numpy_round_trip(np.asarray(x), "fp8", scale) for x, scale in zip((k, v), scales))
        return numpy_causal_attention(q, k, v), cache

    ids = jnp.asarray(prompt, jnp.int32)
    model(ids, jnp.arange(len(prompt)), [None] * len(model.layers), StepContext(attention))
    return [found[i] for i in range(len(model.layers))]


@pytest.mark.parametrize("scan_layers,tp", sweep([(False, 1), (True, 1), (False, 2)],
                                                 keep={0, 1}))
def test_calibrated_fp8_scales_come_from_the_first_prompt(folder, scan_layers, tp):
    """calculate_kv_scales: each layer's scales are the first prompt's K/V absmax per kv
    head (numpy, from the dense model) x 2 / 448; later prompts keep them, and greedy tokens
    equal the dense model's reading K/V quantized in numpy with those scales. With stacked
    layers, and with the heads split over 2 devices (slow step; tensor-parallel int8 pages
    are in the main suite)."""
    model = load_weights(folder, load_config(folder), jnp.float32, progress=False)
    first, rest = PROMPTS[2], PROMPTS[:2]
    with jax.default_device(jax.devices("cpu")[0]):
        want_scales = calibrated_scales(model, first)
        dense = DenseGenerator(model, "fp8").calibrated_head_scales(first)  # the bench's
        np.testing.assert_allclose(np.asarray(dense), np.array(want_scales), rtol=1e-5)
        want = [quantized_dense_greedy(model, p, NEW_TOKENS, "fp8", want_scales)
                for p in [first] + rest]
    llm = LLM(str(folder), dtype="float32", progress=False, kv_cache_dtype="fp8",
              calculate_kv_scales=True, scan_layers=scan_layers, tensor_parallel_size=tp,
              **SMALL_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = []
    for prompts in ([first], rest):  # the first step holds only the first prompt
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        tokens += [list(o.outputs[0].token_ids) for o in outputs]
        caches = llm.engine.replicas[0].runner.caches
        for i, (k_scale, v_scale) in enumerate(want_scales):
            got = ([np.asarray(x[i]) for x in caches[0][0][2:]] if scan_layers  # one stack
                   else [np.asarray(x) for x in caches[i][2:]])
            np.testing.assert_allclose(got[0], k_scale, rtol=1e-5)
            np.testing.assert_allclose(got[1], v_scale, rtol=1e-5)
    assert tokens == want


def test_calculate_kv_scales_needs_an_fp8_cache(folder):
    with pytest.raises(ValueError, match="calculate_kv_scales .* needs kv_cache_dtype='fp8'"):
        LLM(str(folder), kv_cache_dtype="int8", calculate_kv_scales=True, progress=False)


def test_tensor_parallel_keeps_int8_tokens(folder, references):
    """tp 4 over 2 kv heads: heads, and their scale pools, repeated on the devices."""
    _, sharded = generate(folder, kv_cache_dtype="int8", tensor_parallel_size=4)
    assert sharded == references["int8"]


def test_eight_bit_pages_hold_about_twice_the_tokens(folder):
    cfg = load_config(folder)
    for head_dim, at_least in ((64, 1.88), (128, 1.93)):
        shape = cfg.__class__(**{**cfg.__dict__, "head_dim": head_dim})
        bf16 = page_bytes(shape, 16, jnp.bfloat16)
        assert bf16 / page_bytes(shape, 16, jnp.float8_e4m3fn) == 2.0
        assert bf16 / page_bytes(shape, 16, jnp.int8) >= at_least  # scales: 4 bytes a head


def test_unknown_kv_cache_dtype_names_the_field(folder):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(folder), kv_cache_dtype="int4", progress=False)


@pytest.mark.slow  # preemption with a float cache: test_engine's workload, main suite
def test_preemption_rewrites_pages_and_scales(folder):
    """A workload that preempts (20 pages for 8 sequences of up to 86 tokens) gives the tokens
    of the same workload with room for all, on an int8 cache: recomputed pages get their
    scales back."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 320) for _ in range(rng.choice([5, 17, 40, 70]))]
               for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for num_pages in (20, 200):
        llm = LLM(str(folder), dtype="float32", progress=False,
                  **{**SMALL_ENGINE, "num_pages": num_pages, "kv_cache_dtype": "int8"})
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs.append(([list(o.outputs[0].token_ids) for o in outputs],
                     llm.engine.stats().num_preemptions))
    (tight, preemptions), (roomy, none) = runs
    assert preemptions > 0 and none == 0
    assert tight == roomy


def test_pallas_kernels_read_int8_pages_as_the_reference_does(tmp_path):
    """The engine on the Pallas kernels (interpret mode) with an int8 cache gives the
    reference backend's tokens: the scale pools reach the kernels. head_dim 64, as the
    kernels take 64/128/256."""
    from tiny_models import build_model

    build_model("llama_tied_headdim_rope3", tmp_path, head_dim=64)
    results = [generate(tmp_path, kv_cache_dtype="int8", attention_backend=backend)[1]
               for backend in ("reference", "pallas")]
    assert results[0] == results[1]
