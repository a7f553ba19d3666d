"""`jaxserve serve --speculative-config` as an OpenAI client sees it: streamed and whole
completions give the text the engine gives without speculation, `/metrics` counts drafts under
vLLM's names, and a bad config is refused at start-up naming the key."""

import asyncio
import json

import httpx
import openai
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.bench.serve_bench import run_benchmark
from jaxserve.cli.main import build_parser, flag_options
from jaxserve.server.state import ServerOptions
from server_helpers import serving
from tiny_models import SMALL_ENGINE

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
PROMPT = "the fox and the dog and the fox and the dog and the"


def test_completions_stream_and_metrics(folder):
    want = LLM(str(folder), dtype="float32", progress=False, **SMALL_ENGINE).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    argv = ["serve", "--speculative-config", json.dumps(SPEC)]
    options = {**SMALL_ENGINE, **flag_options(build_parser().parse_args(argv))}
    with serving(ServerOptions(model=str(folder), served_model_name=["tiny"], dtype="float32",
                               engine_options=options)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                      extra_body={"ignore_eos": True})
        whole = client.completions.create(**kwargs)
        assert whole.choices[0].text == want.text
        streamed = "".join(chunk.choices[0].text
                           for chunk in client.completions.create(stream=True, **kwargs)
                           if chunk.choices)
        assert streamed == want.text
        metrics = httpx.get(f"{server.url}/metrics").text
        counters = server.state.engine.engine.metrics.snapshot()["counters"]
        args = build_parser().parse_args([
            "bench", "serve", "--url", server.url, "--num-prompts", "6", "--input-len", "12",
            "--output-len", "10", "--prompt-token-range", "2", "40"])
        args.request_rate, args.max_concurrency = args.request_rate[0], args.max_concurrency[0]
        summary = asyncio.run(run_benchmark(args))
        after = server.state.engine.engine.metrics.snapshot()["counters"]
    drafts = [line for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_draft_tokens_total{")]
    assert drafts and float(drafts[0].split()[-1]) > 0
    # bench serve's acceptance rate: the engine's own counters over the run
    proposed, accepted = (after[k] - counters[k] for k in (
        "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
    assert proposed > 0 and summary["spec_acceptance_rate"] == pytest.approx(
        accepted / proposed)


def test_a_bad_config_names_the_key(folder):
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        LLM(str(folder), progress=False, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
            **SMALL_ENGINE)
