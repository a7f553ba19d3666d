"""Tensor and data parallelism on the 8 forced CPU devices: same greedy tokens and
log-probabilities as one device, parameters and KV cache sharded as the rules say."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sharding
from jaxserve import LLM, SamplingParams
from jaxserve.loading.weights import load_weights
from jaxserve.model.hf_config import load_config
from sweeps import sweep
from tiny_models import SMALL_ENGINE, build_model

PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * n) % 300 + 2 for i in range(n)]}
           for n in (3, 17, 40, 9)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """8 query heads, 2 kv heads: tp 4 and 8 need kv heads repeated."""
    path = tmp_path_factory.mktemp("llama_tp")
    build_model("llama", path, num_attention_heads=8, num_key_value_heads=2,
                initializer_range=0.5)
    return path


def generate(folder, **options):
    llm = LLM(str(folder), dtype="float32", progress=False, **SMALL_ENGINE, **options)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
    return llm, [c.token_ids for c in outputs], [c.logprobs for c in outputs]


@pytest.fixture(scope="module")
def single(folder):
    _, tokens, logprobs = generate(folder)
    assert len({tuple(t) for t in tokens}) > 1 and len(set(tokens[0])) > 2  # not degenerate
    return tokens, logprobs


def assert_same(result, single):
    tokens, logprobs = result
    assert tokens == single[0]
    for got_row, want_row in zip(logprobs, single[1]):
        for got, want in zip(got_row, want_row):
            assert got.keys() == want.keys()
            np.testing.assert_allclose([got[k] for k in want], list(want.values()),
                                       rtol=1e-4, atol=1e-4)


def spec(array):
    return tuple(array.sharding.spec) + (None,) * (array.ndim - len(array.sharding.spec))


@pytest.mark.parametrize("tp", sweep([2, 4, 8], keep={1}))
def test_tensor_parallel_matches_one_device(folder, single, tp):
    """tp=4 in the main suite (kv heads repeated); 2 and 8 in the slow step."""
    llm, tokens, logprobs = generate(folder, tensor_parallel_size=tp)
    assert_same((tokens, logprobs), single)
    repeats = max(1, tp // 2)
    state = llm.engine.runner.state
    attn, mlp = state["layers"][0]["attn"], state["layers"][0]["mlp"]
    assert llm.engine.mesh.shape == {"data": 1, "model": tp}
    assert spec(attn["q_proj"][...]) == (None, "model", None)  # column split on heads
    assert spec(attn["k_proj"][...]) == (None, "model", None)
    assert attn["k_proj"][...].shape == (64, 2 * repeats, 8)  # kv heads repeated tp/Hkv times
    assert spec(attn["o_proj"][...]) == ("model", None, None)  # row split
    assert spec(mlp["gate_proj"][...]) == (None, "model")
    assert spec(mlp["down_proj"][...]) == ("model", None)
    assert spec(state["embed"][...]) == ("model", None)  # vocab-parallel
    assert spec(state["lm_head"][...]) == (None, "model")
    assert spec(state["final_norm"]["weight"][...]) == (None,)
    q_shard = attn["q_proj"][...].addressable_shards[0].data
    assert q_shard.shape == (64, 8 // tp, 8)  # each device holds only its heads
    k_pages, _ = llm.engine.runner.caches[0]
    assert spec(k_pages) == (None, None, "model")  # [N, page_size, Hkv * D]
    assert k_pages.shape[2] == 2 * repeats * 8
    assert k_pages.addressable_shards[0].data.shape[2] == 8  # one whole kv head per device
    assert llm.engine.runner.compiles_after_warmup == 0


def test_data_by_model_mesh_matches_one_device(folder, single):
    llm, tokens, logprobs = generate(folder, tensor_parallel_size=4, data_parallel_size=2)
    assert_same((tokens, logprobs), single)
    assert [r.runner.mesh.shape["model"] for r in llm.engine.replicas] == [4, 4]
    meshes = [set(r.runner.mesh.devices.flat) for r in llm.engine.replicas]
    assert not meshes[0] & meshes[1]  # disjoint halves of the 8 devices
    assert [r.allocator.usage for r in llm.engine.replicas] == [0.0, 0.0]  # pages returned
    engine = llm.engine
    for i in range(2):  # two new requests go to different replicas and run at once
        engine.add_request(f"x{i}", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    engine.step()
    assert [len(r.scheduler.running) for r in engine.replicas] == [1, 1]
    while engine.has_unfinished():
        engine.step()


def test_sharded_loading_puts_only_shards_on_devices(folder):
    """The placer never builds a full tensor on a device: each shard is its own slice."""
    mesh = sharding.make_mesh(4)
    cfg = load_config(folder)
    model = load_weights(folder, cfg, np.float32, progress=False, mesh=mesh)
    embed = model.embed[...]
    assert embed.sharding.spec == P("model", None)
    assert {s.data.shape for s in embed.addressable_shards} == {(80, 64)}
    full = load_weights(folder, cfg, np.float32, progress=False)
    np.testing.assert_array_equal(np.asarray(embed), np.asarray(full.embed[...]))
    k = np.asarray(model.layers[1].attn.k_proj[...])  # [E, 4, D]: heads 0,0,1,1
    np.testing.assert_array_equal(k, np.repeat(np.asarray(full.layers[1].attn.k_proj[...]),
                                               2, axis=1))
    assert model.config.num_kv_heads == 4


def test_mesh_and_rule_errors_name_the_field():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        sharding.make_mesh(16)
    with pytest.raises(ValueError, match="data_parallel_size"):
        sharding.make_mesh(4, 3)
    with pytest.raises(ValueError, match="data_parallel_size"):
        sharding.make_mesh(1, 0)
    with pytest.raises(ValueError, match="num_attention_heads"):
        sharding.kv_head_repeats(2, 6, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        sharding.kv_head_repeats(3, 12, 4)
    assert sharding.kv_head_repeats(2, 8, 8) == 4
    assert sharding.kv_head_repeats(8, 8, 4) == 1
    mesh = sharding.make_mesh(4, 2)
    assert mesh.axis_names == ("data", "model") and mesh.devices.shape == (2, 4)
    assert sharding.partition_spec(("vocab", "embed"), (322, 64), mesh) == P(None, None)
    assert sharding.partition_spec(("embed", "mlp"), (64, 112), mesh) == P(None, "model")
    assert len(jax.devices()) == 8


@pytest.mark.slow  # CI's slow step: two replicas of Pallas programs in interpret mode
def test_stacked_layers_shard_and_match_the_layer_loop(tmp_path):
    """`scan_layers` (stacked weights, one page pool of all layers, the Pallas kernels) over
    tp=4 x dp=2 gives the one-device layer loop's tokens; stacked parameters keep a whole
    "layers" axis and split heads as before, the pool splits on kv heads. (The main suite
    keeps stacked layers against transformers, test_hf_parity, and tp against one device.)"""
    build_model("llama", tmp_path, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                initializer_range=0.5)
    _, tokens, logprobs = generate(tmp_path)
    llm, *result = generate(tmp_path, tensor_parallel_size=4, data_parallel_size=2,
                            scan_layers=True)
    assert_same(result, (tokens, logprobs))
    q_proj = llm.model.layers[0].attn.q_proj.get_value()  # [L, E, Hq, D]
    assert q_proj.shape[0] == 2 and spec(q_proj) == (None, None, "model", None)
    for replica in llm.engine.replicas:
        [(k_pages, v_pages)], tail = replica.runner.caches  # [L * N, page_size, Hkv * D]
        assert tail == []
        assert k_pages.shape[0] == 2 * llm.engine.num_pages
        assert spec(k_pages) == (None, None, "model") and v_pages.shape == k_pages.shape
