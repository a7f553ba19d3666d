"""Orbax checkpoints: convert a Hugging Face folder, restore onto another mesh (and dtype),
same outputs as loading the safetensors; saved quantized, or quantized as they restore."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.loading.checkpoint import MARKER, convert, is_checkpoint, saved_quantization
from jaxserve.model.config import WeightQuantization
from jaxserve.model.quantization import CONTRACTED_AXES
from tiny_models import SMALL_ENGINE, build_model

PROMPTS = [{"prompt_token_ids": [(3 * i + n) % 300 + 2 for i in range(n)]} for n in (5, 30)]
PARAMS = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    hf = tmp_path_factory.mktemp("hf")
    hf_model = build_model("qwen3", hf, num_attention_heads=8, num_key_value_heads=2,
                           initializer_range=0.5)
    ckpt = tmp_path_factory.mktemp("ckpt") / "orbax"
    assert convert(hf, ckpt, dtype="float32", progress=False) == ckpt.absolute()
    return hf, ckpt, hf_model


def run(folder, **options):
    llm = LLM(str(folder), progress=False, **SMALL_ENGINE, **options)
    return llm, [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]


def assert_same_outputs(got, want):
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        for gl, wl in zip(g.logprobs, w.logprobs):
            np.testing.assert_allclose([gl[k] for k in wl], list(wl.values()), atol=1e-4)


def assert_codes_round_the_float_weights(llm, hf_model, layer=1):
    """Each restored weight is transformers' float weight rounded to the quantized grid:
    codes x scale within half a step (int8), or within e4m3's rounding (3 mantissa bits:
    1/16 relative, half the subnormal spacing 2^-9 absolute, in units of the scale)."""
    attn = llm.model.layers[layer].attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        codes = np.asarray(getattr(attn, name)[...])
        scale = np.asarray(getattr(attn, name + "_scale")[...], np.float32)
        if name in ("k_proj", "v_proj"):  # [E, Hkv x repeats, D]: each head repeated in a row
            repeats = codes.shape[1] // hf_model.config.num_key_value_heads
            codes, scale = codes[:, ::repeats], scale[::repeats]
        step = np.expand_dims(scale, CONTRACTED_AXES[name])
        restored = codes.astype(np.float32) * step
        weight = getattr(hf_model.model.layers[layer].self_attn, name).weight
        weight = weight.detach().numpy().T.reshape(restored.shape)  # HF [out, in] → [in, out]
        if codes.dtype == jnp.int8:
            bound = 0.5 * step * (1 + 1e-5)
        else:
            bound = np.abs(weight) / 16 + step * 2.0 ** -10
        assert np.all(np.abs(restored - weight) <= bound), name


def test_checkpoint_folder_is_self_contained(folders):
    hf, ckpt, _ = folders
    assert is_checkpoint(ckpt) and not is_checkpoint(hf)
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / "config.json").is_file()
    assert not list(ckpt.glob("*.safetensors"))
    marker = json.loads((ckpt / MARKER).read_text())
    assert marker["dtype"] == "float32" and marker["quantization"] is None
    with pytest.raises(ValueError, match="out_dir"):
        convert(hf, ckpt, progress=False)


def test_restore_on_another_mesh_gives_the_same_outputs(folders):
    hf, ckpt, _ = folders
    # The checkpoint was written from the host (no mesh); both restore onto tp=8, where kv
    # heads are repeated 4x. (That tp=8 gives one device's tokens: tests/engine/test_sharding.)
    _, want = run(hf, tensor_parallel_size=8)
    llm, got = run(ckpt, tensor_parallel_size=8, dtype="auto")
    assert_same_outputs(got, want)
    k_proj = llm.model.layers[0].attn.k_proj[...]
    assert k_proj.dtype == jnp.float32 and k_proj.shape[1] == 8
    assert tuple(k_proj.sharding.spec) == (None, "model", None)
    assert llm.model.embed[...].sharding.spec[0] == "model"


@pytest.mark.slow  # CI's slow step (a bfloat16 engine at tp 4 x dp 2); restores at tp 4 stay
def test_restore_casts_to_the_requested_dtype(folders):
    _, ckpt, _ = folders
    llm = LLM(str(ckpt), progress=False, dtype="bfloat16", tensor_parallel_size=4,
              data_parallel_size=2, **SMALL_ENGINE)
    assert llm.model.embed[...].dtype == jnp.bfloat16
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_checkpoint_saved_quantized_restores_its_codes(folders, tmp_path):
    """`convert(quantization="int8")` saves codes and scales; restored on another mesh they
    are the float weights on the int8 grid, and generate what quantizing the Hugging Face
    folder on load generates."""
    hf, _, hf_model = folders
    ckpt = convert(hf, tmp_path / "int8", dtype="float32", quantization="int8", progress=False)
    assert saved_quantization(ckpt) == WeightQuantization("int8")
    assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())
    _, want = run(hf, quantization="int8", tensor_parallel_size=4)
    llm, got = run(ckpt, tensor_parallel_size=4)  # quantization comes from the checkpoint
    assert llm.config.quantization.method == "int8"
    k_proj = llm.model.layers[0].attn.k_proj[...]
    assert k_proj.dtype == jnp.int8 and k_proj.shape[1] == 4  # kv heads repeated 2x
    assert_codes_round_the_float_weights(llm, hf_model)
    assert_same_outputs(got, want)
    with pytest.raises(ValueError, match="quantization='fp8'"):
        LLM(str(ckpt), progress=False, quantization="fp8", **SMALL_ENGINE)


def test_checkpoint_marked_by_an_older_jaxserve(folders, tmp_path):
    """A marker without the `quantization` field (written before it existed) is a float
    checkpoint, which quantizes as it restores (here at tp 2: no kv head repeated); one whose
    config.json still says compressed-tensors is refused, as is a marker that names arrays
    the checkpoint does not hold."""
    hf, ckpt, hf_model = folders
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    marker = json.loads((old / MARKER).read_text())
    del marker["quantization"]
    (old / MARKER).write_text(json.dumps(marker))
    _, want = run(hf, quantization="int8", tensor_parallel_size=2)
    llm, got = run(old, quantization="int8", tensor_parallel_size=2)
    assert llm.model.layers[0].attn.k_proj[...].shape[1] == 2
    assert_codes_round_the_float_weights(llm, hf_model)
    assert_same_outputs(got, want)

    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}}))
    with pytest.raises(ValueError, match="convert"):
        LLM(str(old), progress=False, **SMALL_ENGINE)
    (old / "config.json").write_text(json.dumps(config))
    (old / MARKER).write_text(json.dumps({**marker, "quantization": {"method": "int8"}}))
    with pytest.raises(ValueError, match="missing.*embed_scale"):
        LLM(str(old), progress=False, **SMALL_ENGINE)


def test_float_checkpoint_is_quantized_as_it_restores(folders):
    """A checkpoint saved in float32 restored with `quantization="fp8"`: each weight is
    quantized on the devices, sharded, with kv heads repeated after quantizing."""
    hf, ckpt, hf_model = folders
    _, want = run(hf, quantization="fp8", tensor_parallel_size=8)
    llm, got = run(ckpt, quantization="fp8", tensor_parallel_size=8)
    k_proj = llm.model.layers[0].attn.k_proj[...]
    assert k_proj.dtype == jnp.float8_e4m3fn and k_proj.shape[1] == 8
    assert tuple(k_proj.sharding.spec) == (None, "model", None)
    assert llm.model.embed[...].dtype == jnp.float8_e4m3fn  # embedding quantized too
    assert_codes_round_the_float_weights(llm, hf_model)
    assert_same_outputs(got, want)
