"""Hybrid KV memory end to end (`jaxserve.engine.window_pages`): a Gemma 3 model whose
sliding layers keep their pages in a window pool of a few pages, recycled many times over
while sequences outgrow the window, share prefixes and preempt each other, generates
transformers' greedy tokens."""

import pytest

from jaxserve import LLM, SamplingParams
from tiny_models import build_model, transformers_greedy

PREFIX = [(7 * i) % 200 + 3 for i in range(40)]  # shared by three prompts: 2 full pages
PROMPTS = [PREFIX + [5, 9, 11, 4, 8], PREFIX + [6], PREFIX + list(range(20, 32)), [17, 4, 9]]
NEW_TOKENS = 60  # the window is 12 tokens: pages slide out all along


@pytest.mark.parametrize("name", ["gemma3_text"])
def test_recycled_window_pages_give_transformers_tokens(name, tmp_path):
    hf_model = build_model(name, tmp_path, num_layers=3)
    # a full pool of one full-length sequence (9 pages) for two running sequences: the
    # newest is preempted; the window pool holds 2 x 3 pages + one step ahead
    llm = LLM(str(tmp_path), dtype="float32", progress=False, max_model_len=128,
              page_size=16, num_pages=9, max_num_seqs=2, max_num_batched_tokens=16,
              token_buckets=(16,), seq_buckets=(2,), num_decode_steps=4)
    engine = llm.engine
    assert engine.window.layers == (0, 2) and engine.window.num_pages == 8
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == transformers_greedy(hf_model, prompt, NEW_TOKENS)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
