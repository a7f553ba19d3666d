"""jaxserve against Hugging Face `transformers` on the same model folders.

For each architecture: float32 logits on a batch of ragged prompts agree to ~1e-4, and greedy
generation gives the same 32 tokens, both through the serving engine (`LLM.generate`) and
through the dense reference path. bfloat16 is checked against float32 by teacher-forced
next-token agreement (see `test_bfloat16_mostly_agrees_with_float32`).
"""

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.sampling.arrays import SamplingArrays
from jaxserve.reference.dense_generation import DenseGenerator
from sweeps import sweep
from tiny_models import ARCHITECTURES, SMALL_ENGINE, build_model

PROMPTS = [[0, 5, 9, 22, 7], [0, 3], list(range(10, 31)), [0] + list(range(100, 140, 3))]
LOGIT_TOLERANCE = 1e-4
NEW_TOKENS = 32


# YaRN's parity runs in the slow step; its frequencies and scale are checked against
# transformers' own computation in the main suite (tests/model/test_config.py). Mixtral's
# too: Qwen3-MoE's experts run in the main suite here and in tests/model/test_moe.py. The
# sliding Qwen2's too: Gemma's layers slide in the main suite.
FAMILIES = sorted(ARCHITECTURES)
MAIN_SUITE = {i for i, name in enumerate(FAMILIES)
              if name not in ("llama_yarn", "mixtral", "qwen2_sliding")}


@pytest.fixture(scope="module", params=sweep(FAMILIES, keep=MAIN_SUITE))
def hf_and_llm(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = build_model(request.param, folder)
    return request.param, hf_model, LLM(str(folder), dtype="float32", progress=False,
                                         **SMALL_ENGINE)


def test_logits_match_transformers(hf_and_llm):
    name, hf_model, llm = hf_and_llm
    ours = DenseGenerator(llm.model).logits(PROMPTS)
    worst = 0.0
    for prompt, logits in zip(PROMPTS, ours):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0].numpy()
        assert logits.shape == reference.shape
        worst = max(worst, float(np.abs(logits - reference).max()))
    print(f"\n{name}: max |logit difference| = {worst:.2e}")
    assert worst < LOGIT_TOLERANCE


def test_greedy_tokens_match_transformers(hf_and_llm):
    _, hf_model, llm = hf_and_llm
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    dense = DenseGenerator(llm.model).generate(
        PROMPTS, [NEW_TOKENS] * len(PROMPTS), [[]] * len(PROMPTS),
        lambda rows: SamplingArrays.from_params([params] * len(PROMPTS), [0] * len(PROMPTS), rows))
    for prompt, output, (dense_ids, _) in zip(PROMPTS, outputs, dense):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            reference = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == reference
        assert dense_ids == reference
        assert output.outputs[0].finish_reason == "length"


def test_bfloat16_mostly_agrees_with_float32(tmp_path):
    """bfloat16 keeps 8 bits of mantissa, so near-ties between the top two logits can flip.
    Teacher-forced on the float32 greedy continuation (so one flip cannot cascade), the
    bfloat16 argmax must agree at >= 90% of positions, and logits stay within 0.1 of
    float32 (this random model's logits span about +-1.5)."""
    build_model("llama", tmp_path)
    f32 = LLM(str(tmp_path), dtype="float32", progress=False, **SMALL_ENGINE)
    bf16 = LLM(str(tmp_path), dtype="bfloat16", progress=False, **SMALL_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = f32.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, outputs)]
    agree = total = 0
    for seq, lf, lb in zip(sequences, DenseGenerator(f32.model).logits(sequences),
                           DenseGenerator(bf16.model).logits(sequences)):
        assert np.abs(lf - lb).max() < 0.1
        agree += int((lf.argmax(-1) == lb.argmax(-1)).sum())
        total += len(seq)
    print(f"\nbfloat16 teacher-forced argmax agreement: {agree}/{total}")
    assert agree / total >= 0.9
    greedy_bf16 = bf16.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in greedy_bf16)


@pytest.mark.parametrize("name", sweep(["llama", "mistral", "qwen3", "gemma3_text", "gpt_oss"],
                                      keep={2, 3}))
def test_stacked_layers_match_transformers(name, tmp_path):
    """`scan_layers=True` (the TPU/GPU default: one `lax.scan` over stacked weights, one
    page pool per stack, the Pallas kernels in interpret mode here) gives transformers'
    greedy tokens, with biases, a sliding window and q/k norm. head_dim 64: the kernels'.
    Gemma 3 and gpt-oss alternate sliding and full layers: 5 layers stack as 2 groups of a
    period of 2, and the fifth runs alone; their sliding stacks keep their pages in the
    window pool. (qwen3 and gemma3_text in the main suite; the others in the slow step.)"""
    periodic = name in ("gemma3_text", "gpt_oss")
    hf_model = build_model(name, tmp_path, head_dim=64, num_layers=5 if periodic else 3)
    llm = LLM(str(tmp_path), dtype="float32", progress=False, scan_layers=True,
              **SMALL_ENGINE)
    assert llm.model.scan_layers
    stacks = [layer.attn.q_proj.get_value().shape[0] for layer in llm.model.layers]
    assert (stacks, len(llm.model.tail)) == (([2, 2], 1) if periodic else ([3], 0))
    if name != "llama" and name != "qwen3":  # Mistral's layers all slide, one in two others
        assert llm.engine.window.layers == ((0, 2, 4) if periodic else (0, 1, 2))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            reference = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == reference
