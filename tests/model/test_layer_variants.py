"""Models whose layers differ (Gemma 3: sliding and global layers, two ropes; GLM-4.5: dense
and mixture-of-experts layers; gpt-oss: sliding and full layers with attention sinks),
sharded over
4 devices (8 query heads, 2 kv heads: kv heads repeated): greedy tokens equal transformers'
for prompts longer than the window, and such a model runs its layers as a loop (asking for
the scan is refused by name). One device is checked for every family in
`test_hf_parity.py`."""

import pytest

from jaxserve import LLM, SamplingParams
from tiny_models import SMALL_ENGINE, build_model, transformers_greedy

PROMPTS = [[(5 * i + 3 * n) % 300 + 2 for i in range(n)] for n in (30, 4, 19)]  # window 12
NEW_TOKENS = 16


@pytest.mark.slow  # CI's slow step: one device of each runs in hf_parity
@pytest.mark.parametrize("name", ["gemma3_text", "glm4_moe", "gpt_oss"])
def test_sharded_layer_variants_equal_transformers(name, tmp_path):
    """gemma3_text: sliding and global layers, two ropes, both caps (Gemma 2's and the
    sliding Qwen2's layers run the same sharded code); glm4_moe: a dense layer, then sparse
    ones with expert parallelism (shared experts tensor-parallel beside them); gpt_oss:
    each device 2 heads' sinks, and one whole expert with its biases."""
    moe = name == "glm4_moe"  # 8 experts in 2 groups, 2 whole experts on each device
    hf_model = build_model(name, tmp_path, num_layers=3, num_attention_heads=8,
                           num_key_value_heads=2, **(dict(n_routed_experts=8) if moe else {}))
    llm = LLM(str(tmp_path), dtype="float32", progress=False, tensor_parallel_size=4,
              enable_expert_parallel=name != "gemma3_text", **SMALL_ENGINE)
    assert not llm.model.scan_layers
    if moe:
        assert llm.model.layers[1].mlp.gate_proj.get_value().sharding.spec[0] == "model"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == transformers_greedy(hf_model, prompt, NEW_TOKENS)
    with pytest.raises(ValueError, match="scan_layers: this model's layers differ"):
        LLM(str(tmp_path), dtype="float32", progress=False, scan_layers=True, **SMALL_ENGINE)
