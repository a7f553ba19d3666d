"""gpt-oss as OpenAI publishes it: experts in MXFP4 (`*_blocks`, `*_scales`), dequantized as
they load, against transformers' own dequantization (`convert_moe_packed_tensors`), and a
tiny MXFP4 folder generating transformers' greedy tokens from the same weights; attention
sinks through the Pallas kernels (interpret mode, each of 2 devices its heads' sinks) and the
reference backend. The family's parity in float (attention sinks, alternating windows, YaRN,
biased experts, the clamped SwiGLU) runs with the others in test_hf_parity.py (the CPU
backend and the dense path) and, over 4 devices with expert parallelism, in
test_layer_variants.py."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxserve import LLM, SamplingParams
from jaxserve.loading.mxfp4 import dequantize
from tiny_models import SMALL_ENGINE, build_model, transformers_greedy

PROMPTS = [[0, 5, 9, 22, 7], list(range(10, 31))]


def random_mxfp4(rng, experts: int, out_size: int, in_size: int):
    """Blocks `[X, out, in / 32, 16]` of random codes and scales `[X, out, in / 32]` of
    exponents around 2^-6 (weights of about 0.02 to 0.4)."""
    blocks = rng.integers(0, 256, size=(experts, out_size, in_size // 32, 16), dtype=np.uint8)
    scales = rng.integers(127 - 8, 127 - 5, size=(experts, out_size, in_size // 32),
                          dtype=np.uint8)
    return blocks, scales


@pytest.mark.quick
def test_mxfp4_dequantization_equals_transformers():
    blocks, scales = random_mxfp4(np.random.default_rng(0), 3, 40, 96)
    ours = dequantize(blocks, scales).astype(np.float32)  # [X, in, out]
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32).numpy()
    assert ours.shape == theirs.shape == (3, 96, 40)
    np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize(blocks, scales[..., :1])


@pytest.mark.parametrize("backend, devices", [("pallas", 2), ("reference", 1)])
def test_sinks_through_the_paged_backends(backend, devices, tmp_path):
    hf_model = build_model("gpt_oss", tmp_path, head_dim=64)  # a head_dim the kernels take
    llm = LLM(str(tmp_path), dtype="float32", progress=False, attention_backend=backend,
              tensor_parallel_size=devices, **SMALL_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == [transformers_greedy(hf_model, p, 16)
                                                        for p in PROMPTS]


def test_mxfp4_checkpoint_generates_transformers_tokens(tmp_path):
    """The experts' gate_up and down projections stored as MXFP4 with
    `quantization_config.quant_method` "mxfp4" (attention, router and embeddings in float,
    as in the published checkpoints): the engine's greedy tokens equal transformers' from
    the weights transformers dequantizes."""
    hf_model = build_model("gpt_oss", tmp_path, intermediate_size=64)
    tensors = load_file(tmp_path / "model.safetensors")
    rng = np.random.default_rng(1)
    state = hf_model.state_dict()
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, in_size, out_size = tensors.pop(name).shape
        blocks, scales = random_mxfp4(rng, experts, out_size, in_size)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        state[name] = convert_moe_packed_tensors(torch.from_numpy(blocks),
                                                 torch.from_numpy(scales), dtype=torch.float32)
    hf_model.load_state_dict(state)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    llm = LLM(str(tmp_path), dtype="float32", progress=False, **SMALL_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == [transformers_greedy(hf_model, p, 16)
                                                        for p in PROMPTS]
