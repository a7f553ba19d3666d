"""Mixture of experts (`jaxserve.model.moe`): the router against a numpy transcription of
Qwen3-MoE's and Mixtral's (softmax, top-k with ties to the lower id, optional
renormalization) and of GLM-4.5's (sigmoid, correction bias, best groups, scaling); which
layers stay dense; the grouped layer against a per-token numpy loop, with every token on one
expert and experts that get none; Qwen3-MoE (tensor-parallel experts) and Mixtral (expert
parallelism) on stacked layers over tp=4 against transformers' greedy tokens (one device:
tests/model/test_hf_parity.py)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.loading.checkpoint import convert
from jaxserve.model.config import ModelConfig, MoEConfig, WeightQuantization, with_expert_parallel
from jaxserve.model.hf_config import config_from_hf
from jaxserve.model.moe import SparseMoE, expert_counts, route, route_sigmoid
from jaxserve.model.quantization import dequantize, quantize
from tiny_models import (SMALL_ENGINE, build_model, is_router, put_on_grid,
                         transformers_greedy)


def numpy_route(logits: np.ndarray, top_k: int, normalize: bool):
    """transformers' router: float32 softmax, torch.topk (ties: lower id), renormalized."""
    z = logits.astype(np.float32) - logits.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, experts, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


@pytest.mark.quick
@pytest.mark.parametrize("normalize", [False, True])
def test_router_matches_numpy_with_ties(normalize):
    rng = np.random.default_rng(0)
    logits = np.round(rng.normal(size=(64, 8)), 1).astype(np.float32)  # many exact ties
    logits[:4] = 0.0  # every expert tied: experts 0..k-1
    weights, experts = route(jnp.asarray(logits), 3, normalize)
    want_weights, want_experts = numpy_route(logits, 3, normalize)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-6)


def numpy_route_sigmoid(logits, bias, moe: MoEConfig):
    """GLM-4.5's router written out per token: sigmoid scores; each group's score is its
    two best (score + bias); experts outside the best `top_k_groups` groups are out; the
    top k of score + bias; weights the chosen scores, normalized, scaled."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    weights, experts = [], []
    size = logits.shape[1] // moe.num_groups
    for row in scores:
        choice = row + bias
        groups = [np.sort(choice[g * size:(g + 1) * size])[-2:].sum()
                  for g in range(moe.num_groups)]
        kept = np.argsort(groups)[::-1][:moe.top_k_groups]
        allowed = np.where(np.repeat(np.isin(np.arange(moe.num_groups), kept), size),
                           choice, -np.inf)
        chosen = np.argsort(allowed)[::-1][:moe.top_k]
        w = row[chosen] / (row[chosen].sum() + 1e-20) if moe.normalize_top_k else row[chosen]
        weights.append(w * moe.routed_scaling_factor)
        experts.append(chosen)
    return np.array(weights), np.array(experts)


@pytest.mark.quick
@pytest.mark.parametrize("normalize", [False, True])
def test_sigmoid_router_matches_numpy(normalize):
    """8 experts in 4 groups, 2 groups kept, top 3, a bias large enough to change choices."""
    moe = MoEConfig(8, 3, 16, normalize, "sigmoid", num_groups=4, top_k_groups=2,
                    routed_scaling_factor=2.5)
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(64, 8)).astype(np.float32)
    bias = (0.5 * rng.normal(size=8)).astype(np.float32)
    weights, experts = route_sigmoid(jnp.asarray(logits), jnp.asarray(bias), moe)
    want_weights, want_experts = numpy_route_sigmoid(logits, bias, moe)
    order = np.argsort(np.asarray(experts), axis=1)  # the chosen set, in any order
    want_order = np.argsort(want_experts, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                  np.take_along_axis(want_experts, want_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(want_weights, want_order, 1), rtol=1e-5)
    unbiased = numpy_route_sigmoid(logits, 0 * bias, moe)[1]
    assert (np.sort(unbiased, 1) != np.sort(want_experts, 1)).any()  # the bias counts


def per_token_reference(layer: SparseMoE, x: np.ndarray) -> np.ndarray:
    """The layer by a loop over tokens and their experts, in numpy."""
    router = np.asarray(layer.router[...])
    k = layer.kernels()
    gate, up, down = (np.asarray(w, np.float32) if scale is None else
                      dequantize(w, scale, (1,))
                      for w, scale in ((k.gate, k.gate_scale), (k.up, k.up_scale),
                                       (k.down, k.down_scale)))
    weights, experts = numpy_route(x @ router, layer.top_k, layer.normalize)
    out = np.zeros_like(x)
    for t in range(len(x)):
        for w, j in zip(weights[t], experts[t]):
            g, u = x[t] @ gate[j], x[t] @ up[j]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[j])
    return out


@pytest.mark.quick
@pytest.mark.parametrize("case, method", [("random", None), ("one_expert_for_all", None),
                                          ("few_tokens", None), ("random", "int8"),
                                          ("few_tokens", "fp8")])
def test_grouped_experts_match_a_per_token_loop(case, method):
    """37 tokens (74 pairs: sorted into blocks of rows by expert), or 3 (6 pairs, no more
    than the 6 experts: their experts' weights gathered); quantized experts (`method`: codes
    and a scale per expert and output channel) against the float weights they stand for."""
    cfg = ModelConfig("qwen3_moe", vocab_size=16, hidden_size=24, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      moe=MoEConfig(num_experts=6, top_k=2, intermediate_size=40),
                      quantization=method and WeightQuantization(method))
    layer = SparseMoE(cfg, jnp.float32, nnx.Rngs(0))
    rng = np.random.default_rng(1)
    for name in ("gate_proj", "up_proj", "down_proj"):
        value = rng.normal(size=getattr(layer, name).shape) * 0.3
        if method is None:
            getattr(layer, name).set_value(jnp.asarray(value, jnp.float32))
            continue
        codes, scale = quantize(value, method, (1,))
        getattr(layer, name).set_value(jnp.asarray(codes))
        getattr(layer, name + "_scale").set_value(jnp.asarray(scale))
        assert codes.dtype.itemsize == 1 and scale.shape == (6, value.shape[2])
    x = rng.normal(size=(3 if case == "few_tokens" else 37, 24)).astype(np.float32)
    if case != "one_expert_for_all":
        layer.router.set_value(jnp.asarray(rng.normal(size=(24, 6)), jnp.float32))
    else:  # expert 4 scores 50 x0 > 0, the rest 0: every token picks 4, then 0 (the tie)
        x[:, 0] = np.abs(x[:, 0]) + 0.1
        router = np.zeros((24, 6), np.float32)
        router[0, 4] = 50.0
        layer.router.set_value(jnp.asarray(router))
    ours, routed = jax.jit(lambda v: layer(v))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(ours), per_token_reference(layer, x), rtol=2e-4,
                               atol=2e-5)
    # the expert load: pairs per expert, padding tokens (the last 5 here) not counted
    _, want = numpy_route(x @ np.asarray(layer.router[...]), 2, False)
    real = np.arange(len(x)) < len(x) - 5
    np.testing.assert_array_equal(np.asarray(routed), want)
    np.testing.assert_array_equal(np.asarray(expert_counts(routed, 6, jnp.asarray(real))),
                                  np.bincount(want[real].reshape(-1), minlength=6))


@pytest.mark.quick
def test_unsupported_moe_settings_name_the_field():
    base = dict(model_type="qwen3_moe", vocab_size=16, hidden_size=8, intermediate_size=8,
                num_hidden_layers=2, num_attention_heads=2, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        config_from_hf({**base, "num_experts_per_tok": 5})
    assert config_from_hf(base).moe == MoEConfig(4, 2, 8, normalize_top_k=False)
    with pytest.raises(ValueError, match="n_group"):
        config_from_hf({**base, "model_type": "glm4_moe", "n_routed_experts": 4,
                        "n_group": 3})


@pytest.mark.quick
def test_dense_layers_among_sparse_ones():
    """Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`, GLM's
    `first_k_dense_replace`, counted by hand."""
    base = dict(model_type="qwen3_moe", vocab_size=16, hidden_size=8, intermediate_size=8,
                num_hidden_layers=6, num_attention_heads=2, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=8)
    assert config_from_hf(base).dense_layers == ()
    assert config_from_hf({**base, "mlp_only_layers": [0, 4]}).dense_layers == (0, 4)
    assert config_from_hf({**base, "decoder_sparse_step": 2}).dense_layers == (0, 2, 4)
    glm = config_from_hf({**base, "model_type": "glm4_moe", "n_routed_experts": 4,
                          "first_k_dense_replace": 2})
    assert glm.dense_layers == (0, 1) and not glm.scannable  # nothing repeats
    assert [glm.sparse_layer(i) for i in range(6)] == [False, False] + [True] * 4


PROMPTS = [[0, 5, 9, 22, 7], [0, 3], list(range(10, 31)), [0] + list(range(100, 140, 3))]


@pytest.mark.parametrize("name, expert_parallel", [("qwen3_moe", False), ("mixtral", True)])
def test_stacked_experts_over_tp4_match_transformers(name, expert_parallel, tmp_path):
    """`scan_layers` (the TPU/GPU layout: stacked experts `[L, X, ...]`, the Pallas kernels
    in interpret mode) over 4 devices: tensor-parallel experts (each device holds a quarter
    of every expert) and expert parallelism (`enable_expert_parallel`: each device holds one
    whole expert of Mixtral's 4 and computes only the tokens routed to it). The routers
    decide the tokens: with them zeroed, transformers' own tokens change. Each token's
    log-probability equals transformers', and the engine's expert load equals
    transformers' routers' choices over the same tokens."""
    hf_model = build_model(name, tmp_path, head_dim=64, num_layers=2,
                           num_attention_heads=4, num_key_value_heads=4)
    llm = LLM(str(tmp_path), dtype="float32", progress=False, scan_layers=True,
              tensor_parallel_size=4, enable_expert_parallel=expert_parallel, **SMALL_ENGINE)
    gate = llm.model.layers[0].mlp.gate_proj.get_value()  # [L, X, E, I]
    spec = tuple(gate.sharding.spec) + (None,) * 4
    assert spec[:4] == ((None, "model", None, None) if expert_parallel else
                        (None, None, None, "model"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    expected = [transformers_greedy(hf_model, p, 12) for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # the expert load: every token the engine ran (prompt, then each output but the last)
    # through transformers' routers, counted per layer and expert; and each output token's
    # log-probability against transformers' log-softmax at its position
    load = np.zeros_like(llm.engine.expert_load())
    for prompt, output, ours in zip(PROMPTS, expected, outputs):
        with torch.no_grad():
            hf_out = hf_model(torch.tensor([prompt + output[:-1]]), output_router_logits=True)
        logprobs = torch.log_softmax(hf_out.logits[0, len(prompt) - 1:].float(), -1)
        want = logprobs[torch.arange(len(output)), torch.tensor(output)].numpy()
        got = [step[token] for step, token in zip(ours.outputs[0].logprobs, output)]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        routers = hf_out.router_logits  # L x [T, X]
        for layer, logits in enumerate(routers):
            chosen = torch.topk(logits.float(), hf_model.config.num_experts_per_tok).indices
            load[layer] += np.bincount(chosen.reshape(-1).numpy(), minlength=load.shape[1])
    np.testing.assert_array_equal(llm.engine.expert_load(), load)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if is_router(name):
                param.zero_()
    assert [transformers_greedy(hf_model, p, 12) for p in PROMPTS] != expected


@pytest.mark.parametrize("name, method, expert_parallel, experts", [
    ("qwen3_moe", "int8", True, {"num_experts": 8}), ("mixtral", "fp8", False, {})])
def test_quantized_experts_on_the_grid_give_transformers_tokens(name, method, expert_parallel,
                                                                 experts, tmp_path):
    """Experts (and every other linear layer) whose weights the method stores exactly:
    quantized as they load, each expert keeps a scale per output channel, so the engine over
    tp=4 (stacked layers; each device's whole experts with expert parallelism, a slice of
    every expert's width without) gives transformers' greedy tokens."""
    hf_model = build_model(name, tmp_path, head_dim=64, num_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, **experts)
    put_on_grid(hf_model, method)
    hf_model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", quantization=method, progress=False,
              scan_layers=True, tensor_parallel_size=4, enable_expert_parallel=expert_parallel,
              **SMALL_ENGINE)
    experts = llm.model.layers[0].mlp  # the one stack
    assert experts.gate_proj.get_value().dtype.itemsize == 1
    layers, x, _, i = experts.gate_proj.get_value().shape
    assert experts.gate_proj_scale.get_value().shape == (layers, x, i)
    assert experts.down_proj_scale.get_value().shape == (layers, x, hf_model.config.hidden_size)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == [transformers_greedy(hf_model, p, 12)
                                                        for p in PROMPTS]


def test_compressed_tensors_moe_checkpoint_gives_transformers_tokens(tmp_path):
    """A compressed-tensors INT8 Qwen3-MoE folder as llm-compressor writes one: every expert's
    and every other Linear's weight int8 with a `weight_scale` per output channel, routers
    and lm_head ignored (left in float). The engine gives the greedy tokens transformers
    computes from the dequantized weights, and so does its orbax conversion (saved as codes,
    restored with expert parallelism at tp=4)."""
    build_model("qwen3_moe", tmp_path / "float", num_experts=8)
    tensors = load_file(tmp_path / "float" / "model.safetensors")
    quantized = {}
    for name, value in tensors.items():
        if name.endswith("proj.weight"):  # [out, in]
            codes, scale = quantize(value, "int8", (1,))
            quantized[name], quantized[name + "_scale"] = codes, scale[:, None]
            tensors[name] = dequantize(codes, scale, (1,))
        else:
            quantized[name] = value
    save_file(tensors, tmp_path / "float" / "model.safetensors", metadata={"format": "pt"})
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float").eval()
    (tmp_path / "int8").mkdir()
    for file in (tmp_path / "float").iterdir():
        shutil.copy(file, tmp_path / "int8")
    save_file(quantized, tmp_path / "int8" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True,
            "dynamic": False}}},
        "ignore": ["lm_head", "re:.*mlp.gate$"]}
    (tmp_path / "int8" / "config.json").write_text(json.dumps(config))
    expected = [transformers_greedy(hf_model, p, 12) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm = LLM(str(tmp_path / "int8"), dtype="float32", progress=False, **SMALL_ENGINE)
    assert llm.model.layers[1].mlp.up_proj[...].dtype == jnp.int8
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    del llm
    ckpt = convert(tmp_path / "int8", tmp_path / "orbax", dtype="float32", progress=False)
    restored = LLM(str(ckpt), dtype="float32", progress=False, tensor_parallel_size=4,
                   enable_expert_parallel=True, **SMALL_ENGINE)
    assert restored.model.layers[1].mlp.down_proj_scale[...].shape == (8, 64)
    assert [o.outputs[0].token_ids for o in restored.generate(prompts, params)] == expected


@pytest.mark.quick
def test_expert_parallel_needs_experts_that_divide():
    cfg = config_from_hf(dict(model_type="mixtral", vocab_size=16, hidden_size=8,
                              intermediate_size=8, num_hidden_layers=1,
                              num_attention_heads=2, num_local_experts=6,
                              num_experts_per_tok=2))
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        with_expert_parallel(cfg, True, 4)
    assert with_expert_parallel(cfg, True, 3).moe.expert_parallel
    assert not with_expert_parallel(cfg, False, 3).moe.expert_parallel
