"""Orbax checkpoints: convert a Hugging Face folder, restore onto another mesh (and dtype),
same outputs as loading the safetensors."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.loading.checkpoint import MARKER, convert, is_checkpoint
from tiny_models import SMALL_ENGINE, build_model

ENGINE = dict(SMALL_ENGINE, token_buckets=(64,), seq_buckets=(8,))
PROMPTS = [{"prompt_token_ids": [(3 * i + n) % 300 + 2 for i in range(n)]} for n in (5, 30)]
PARAMS = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    hf = tmp_path_factory.mktemp("hf")
    build_model("qwen3", hf, num_attention_heads=8, num_key_value_heads=2,
                initializer_range=0.5)
    ckpt = tmp_path_factory.mktemp("ckpt") / "orbax"
    assert convert(hf, ckpt, dtype="float32", progress=False) == ckpt.absolute()
    return hf, ckpt


def run(folder, **options):
    llm = LLM(str(folder), progress=False, **ENGINE, **options)
    return llm, [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]


def test_checkpoint_folder_is_self_contained(folders):
    hf, ckpt = folders
    assert is_checkpoint(ckpt) and not is_checkpoint(hf)
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / "config.json").is_file()
    assert not list(ckpt.glob("*.safetensors"))
    assert json.loads((ckpt / MARKER).read_text())["dtype"] == "float32"
    with pytest.raises(ValueError, match="out_dir"):
        convert(hf, ckpt, progress=False)


def test_restore_on_another_mesh_gives_the_same_outputs(folders):
    hf, ckpt = folders
    _, want = run(hf, tensor_parallel_size=2)  # as if saved from tp=2
    llm, got = run(ckpt, tensor_parallel_size=8, dtype="auto")  # kv heads repeated 4x
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        for gl, wl in zip(g.logprobs, w.logprobs):
            np.testing.assert_allclose([gl[k] for k in wl], list(wl.values()), atol=1e-4)
    k_proj = llm.model.layers[0].attn.k_proj[...]
    assert k_proj.dtype == jnp.float32 and k_proj.shape[1] == 8
    assert tuple(k_proj.sharding.spec) == (None, "model", None)
    assert llm.model.embed[...].sharding.spec[0] == "model"


def test_restore_casts_to_the_requested_dtype(folders):
    _, ckpt = folders
    llm = LLM(str(ckpt), progress=False, dtype="bfloat16", tensor_parallel_size=4,
              data_parallel_size=2, **ENGINE)
    assert llm.model.embed[...].dtype == jnp.bfloat16
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
