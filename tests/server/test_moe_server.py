"""A mixture-of-experts model served: `/metrics` reports the expert load under
`jaxserve:moe_expert_tokens_total` (per layer and expert) and
`jaxserve:moe_expert_load_imbalance` (per layer), counted by hand from the usage an OpenAI
client gets back: every token the model ran (the prompt, then each output token but the
last) sends `num_experts_per_tok` pairs through each layer. Whose experts they are is checked
against transformers' routers in tests/model/test_moe.py."""

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.server.state import ServerOptions
from server_helpers import serving
from tiny_models import SMALL_ENGINE, build_model

TOP_K, LAYERS, EXPERTS = 2, 2, 6  # tiny_models' qwen3_moe


def samples(text: str, name: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def test_metrics_count_every_routed_token(tmp_path):
    build_model("qwen3_moe", tmp_path)
    with serving(ServerOptions(model=str(tmp_path), served_model_name=["moe"],
                               dtype="float32", engine_options=SMALL_ENGINE)) as server:
        assert not samples(httpx.get(f"{server.url}/metrics").text,
                           "jaxserve:moe_expert_tokens_total")  # nothing ran yet
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        ran = 0
        for prompt in ([5, 9, 22, 7, 3], list(range(10, 40))):
            usage = client.completions.create(model="moe", prompt=prompt, max_tokens=6,
                                              temperature=0,
                                              extra_body={"ignore_eos": True}).usage
            ran += usage.prompt_tokens + usage.completion_tokens - 1
        text = httpx.get(f"{server.url}/metrics").text
    tokens = samples(text, "jaxserve:moe_expert_tokens_total")
    assert {(s.labels["layer"], s.labels["expert"]) for s in tokens} == {
        (str(layer), str(expert)) for layer in range(LAYERS) for expert in range(EXPERTS)}
    for layer in range(LAYERS):
        assert sum(s.value for s in tokens if s.labels["layer"] == str(layer)) == TOP_K * ran
    ratios = samples(text, "jaxserve:moe_expert_load_imbalance")
    assert sorted(s.labels["layer"] for s in ratios) == ["0", "1"]
    for ratio in ratios:  # max over mean of the layer's counters
        counts = [s.value for s in tokens if s.labels["layer"] == ratio.labels["layer"]]
        assert abs(ratio.value - max(counts) / (sum(counts) / EXPERTS)) < 1e-9
