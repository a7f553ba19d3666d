"""The HTTP server against real clients: the official `openai` package, raw HTTP for bad
input, the serving benchmark for load, Prometheus' parser for /metrics."""

import asyncio
import json
import threading
import time

import httpx
import jsonschema
import numpy
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import LLM, SamplingParams
from jaxserve.bench.serve_bench import run_benchmark
from jaxserve.cli.main import build_parser
from jaxserve.server.state import ServerOptions, ServerState
from server_helpers import ThreadedServer, serving, wait_until
from tiny_models import SMALL_ENGINE

ENGINE = {**SMALL_ENGINE, "max_num_seqs": 8, "num_pages": 96}
NAME = "tiny"


@pytest.fixture(scope="module")
def server(folder):
    options = ServerOptions(model=str(folder), served_model_name=[NAME],
                            dtype="float32", engine_options=ENGINE)
    with serving(options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def reference(folder):
    return LLM(str(folder), dtype="float32", progress=False, **ENGINE)


def test_completions_equal_llm_generate(client, reference):
    out = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    expected = reference.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(reference.tokenizer.encode("Once upon a time"))


def test_streaming_completion_adds_up_with_usage(client):
    kwargs = dict(model=NAME, prompt="The fox", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_generation_config_gives_the_fields_a_request_leaves_out(server, client, reference,
                                                                 tmp_path):
    """--generation-config FOLDER: its temperature and max_new_tokens apply to a chat
    request that gives neither; a request's own field wins (the running server's options
    swapped for the test, then restored)."""
    import dataclasses

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 5}))
    messages = [{"role": "user", "content": "Hello there"}]
    expected = reference.chat(messages, SamplingParams(temperature=0, max_tokens=5,
                                                       ignore_eos=True))[0].outputs[0].text
    state, options = server.state, server.state.options
    state.options, state._generation_defaults = dataclasses.replace(
        options, generation_config=str(tmp_path)), {}
    try:
        out = client.chat.completions.create(model=NAME, messages=messages,
                                             extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
        assert out.choices[0].message.content == expected
        out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=7,
                                             extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 7
    finally:
        state.options, state._generation_defaults = options, {}


def test_seed_draws_the_seeds_of_unseeded_requests(reference):
    """`LLM(seed=)` / `serve --seed`: an unseeded request samples as a request seeded with
    the first draw of numpy's generator from that seed."""
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    first = int(numpy.random.default_rng(3).integers(2**32))
    seeded = reference.generate("Once upon a time", SamplingParams(
        temperature=1.0, max_tokens=8, ignore_eos=True, seed=first))[0].outputs[0].token_ids
    reference.engine.reseed(3)
    unseeded = reference.generate("Once upon a time", params)[0].outputs[0].token_ids
    assert list(unseeded) == list(seeded)


def test_chat_streaming_and_not_equal_llm_chat(client, reference):
    messages = [{"role": "user", "content": "Hello there"}]
    expected = reference.chat(messages, SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True))[0].outputs[0].text
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == expected
    assert out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=messages,
                                            max_completion_tokens=8, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "book"}}])
def test_required_and_named_tool_calls_are_valid_on_a_random_model(client, tool_choice):
    """A random model knows no tools: only the grammar makes its arguments valid."""
    schema = {"type": "object", "properties": {"room": {"type": "integer", "minimum": 1},
                                               "guests": {"type": "array", "maxItems": 2,
                                                          "items": {"enum": ["Ann", "Bo"]}}},
              "required": ["room"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}}
             for name in ("book", "cancel")]
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hello"}], tools=tools,
        tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=100, temperature=0.7,
        seed=5)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("book", "cancel")
    assert tool_choice == "required" or calls[0].function.name == "book"
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def test_n_seed_and_logprobs(client):
    out = client.completions.create(model=NAME, prompt="A", max_tokens=6, n=3, seed=5,
                                    temperature=1.0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    again = client.completions.create(model=NAME, prompt="A", max_tokens=6, n=3, seed=5,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [c.text for c in again.choices]
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 6 and all(v <= 0 for v in logprobs.token_logprobs)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2)
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


def test_models_and_health(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["models"] == {NAME: "ready"}
    programs = health["programs"][NAME]  # every program landed: nothing compiles behind
    assert programs["ready"] == programs["total"] > 0


BAD_INPUTS = [
    # (path, body, status, param)
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_p": "high"}, 400, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": list(range(2, 200))}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [5, 999999]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 99}, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop_token_ids": [2**40]}, 400,
     "stop_token_ids"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop_token_ids": [5000]}, 400,
     "stop_token_ids"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"content": "no role"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]},
     400, "messages.0.role"),
    # tools with tool_choice "auto" (their default) on a server with no --tool-call-parser
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_INPUTS)
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, path, body, status,
                                                              param):
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    ok = httpx.post(f"{server.url}/v1/completions",
                    json={"model": NAME, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


def test_malformed_json_and_oversized_body(server):
    response = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "x",, }',
                          headers={"content-type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] is None  # not a character offset
    assert "not valid JSON" in error["message"]
    huge = httpx.post(f"{server.url}/v1/completions",
                      json={"model": NAME, "prompt": "x" * (5 << 20)})
    assert huge.status_code == 413 and "error" in huge.json()


def test_health_answers_while_the_largest_body_is_tokenized(server):
    """A prompt that fills the default body limit (4 MiB) takes seconds to tokenize. That
    runs on a worker thread, so `/health` (a Kubernetes probe gives up after 3 s) and every
    stream carry on meanwhile; then the prompt is refused, far past the context length."""
    sentence = "Once upon a time a little fox lived in the forest by the lazy dog. "
    shell = len(json.dumps({"model": NAME, "prompt": ""}))
    prompt = (sentence * (ServerOptions.max_body_bytes // len(sentence) + 1))[
        :ServerOptions.max_body_bytes - shell]
    body = json.dumps({"model": NAME, "prompt": prompt}).encode()
    assert len(body) == ServerOptions.max_body_bytes  # admitted: the largest body allowed
    answer = {}
    sender = threading.Thread(target=lambda: answer.setdefault("response", httpx.post(
        f"{server.url}/v1/completions", content=body, timeout=120,
        headers={"content-type": "application/json"})))
    # The longest time between two answers to /health: the probes run in this process, so
    # a thread holding the GIL (as `tokenizers` does in `encode`) stalls them too.
    answered = [time.perf_counter()]
    sender.start()
    while sender.is_alive():
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        answered.append(time.perf_counter())
        time.sleep(0.05)
    sender.join()
    took, longest = answered[-1] - answered[0], max(numpy.diff(answered))
    print(f"/health went at most {longest * 1000:.0f} ms unanswered ({len(answered) - 1} "
          f"probes) while a {len(body)}-byte body took {took:.1f} s to answer")
    response = answer["response"]
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    # on the event loop, a probe would wait for most of the tokenization; the bound is
    # relative too, as a busy shared machine slows every probe
    assert longest < min(3.0, took / 4)


def test_api_key_and_queue_full(server):
    state = server.state
    state.api_key = "secret"
    try:
        denied = httpx.get(f"{server.url}/v1/models")
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"
        allowed = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer secret"})
        assert allowed.status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200  # not behind the key
    finally:
        state.api_key = None
    state.engine.max_waiting = 0
    try:
        full = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": "x"})
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["type"] == "rate_limit_error"
    finally:
        state.engine.max_waiting = 1024


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    engine = server.state.llm.engine
    body = {"model": NAME, "prompt": "stream me", "max_tokens": 100, "stream": True,
            "ignore_eos": True}
    aborted_before = engine.metrics.snapshot()["finished_by_reason"].get("abort", 0)
    server.state.engine.on_step = lambda deltas: time.sleep(0.05)  # outlast the disconnect
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
        wait_until(lambda: engine.metrics.snapshot()["finished_by_reason"].get("abort", 0)
                   > aborted_before, 30, "request was not aborted")
    finally:
        server.state.engine.on_step = None
    wait_until(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0, 30,
               "pages not freed")
    wait_until(lambda: server.state.engine.num_in_flight == 0, 30, "request state leaked")


def test_non_streaming_request_whose_client_leaves_is_aborted(server):
    engine = server.state.llm.engine
    body = {"model": NAME, "prompt": "wait for me", "max_tokens": 100, "ignore_eos": True}
    aborted_before = engine.metrics.snapshot()["finished_by_reason"].get("abort", 0)
    server.state.engine.on_step = lambda deltas: time.sleep(0.1)  # outlast the client
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
        wait_until(lambda: engine.metrics.snapshot()["finished_by_reason"].get("abort", 0)
                   > aborted_before, 30, "request was not aborted")
    finally:
        server.state.engine.on_step = None
    wait_until(lambda: server.state.engine.num_in_flight == 0, 30, "request state leaked")
    assert engine.stats().kv_cache_usage == 0.0


def test_waiting_limit_is_exact_under_a_burst(server):
    """The engine is held inside a step, so nothing moves from the queue: of a burst of 12,
    exactly `max_waiting` are accepted and the rest get 429."""
    served, release = server.state.engine, threading.Event()
    served.on_step = lambda deltas: release.wait(30)
    first = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/completions",),
                             kwargs=dict(json={"model": NAME, "prompt": "hold", "max_tokens": 3},
                                         timeout=60))
    first.start()
    wait_until(lambda: served.engine.stats().num_running == 1, 30, "first request not running")
    served.max_waiting = 2

    async def burst():
        async with httpx.AsyncClient(timeout=60) as http:
            async def one():
                return await http.post(f"{server.url}/v1/completions",
                                       json={"model": NAME, "prompt": "x", "max_tokens": 2})
            pending = [asyncio.ensure_future(one()) for _ in range(12)]
            await asyncio.sleep(1.0)  # all 12 are answered or queued by now
            release.set()
            return [r.status_code for r in await asyncio.gather(*pending)]

    try:
        codes = asyncio.run(burst())
    finally:
        release.set()
        served.on_step, served.max_waiting = None, 1024
        first.join(timeout=60)
    assert sorted(codes) == [200] * 2 + [429] * 10


def test_200_requests_at_32_concurrent_streams(server):
    args = build_parser().parse_args([
        "bench", "serve", "--url", server.url, "--model", NAME, "--num-prompts", "200",
        "--max-concurrency", "32", "--input-len", "12", "--input-len-std", "4",
        "--output-len", "6", "--timeout", "300", "--prompt-token-range", "2", "300"])
    args.request_rate, args.max_concurrency = args.request_rate[0], args.max_concurrency[0]
    summary = asyncio.run(run_benchmark(args))
    assert summary["completed"] == 200 and summary["failed"] == 0, summary["errors"]
    assert summary["output_token_throughput"] > 0
    engine = server.state.llm.engine
    wait_until(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0, 30,
               "a finished request still holds pages")
    assert server.state.engine.num_in_flight == 0


def test_default_max_tokens_fits_the_room_left(server):
    prompt = list(range(2, 2 + 128 - 5))  # max_model_len 128: room for 5 new tokens
    out = httpx.post(f"{server.url}/v1/completions",
                     json={"model": NAME, "prompt": prompt, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 5


def test_metrics_parse_and_counters_move(server):
    def scrape():
        text = httpx.get(f"{server.url}/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if not s.labels.get("finished_reason") or s.labels["finished_reason"] == "length"}

    before = scrape()
    httpx.post(f"{server.url}/v1/completions",
               json={"model": NAME, "prompt": "count me", "max_tokens": 5, "ignore_eos": True})
    after = scrape()
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 5
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert after["vllm:request_success_total"] == before["vllm:request_success_total"] + 1
    assert after["vllm:e2e_request_latency_seconds_count"] == (
        before["vllm:e2e_request_latency_seconds_count"] + 1)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count",
                 "jaxserve:compilations_after_warmup_total"):
        assert name in after, name
    assert after["jaxserve:compilations_after_warmup_total"] == 0


def test_health_is_503_until_the_model_is_ready(folder):
    release = threading.Event()

    def slow_load(entry):
        release.wait(30)
        return LLM(entry.path, dtype="float32", progress=False, **ENGINE)

    state = ServerState(ServerOptions(model=str(folder), engine_options=ENGINE), slow_load)
    running = ThreadedServer(state).start()
    try:
        response = httpx.get(f"{running.url}/health")
        assert response.status_code == 503 and "loading" in response.json()["error"]["message"]
        busy = httpx.post(f"{running.url}/v1/completions", json={"prompt": "x"})
        assert busy.status_code == 503
        release.set()
        running.wait_ready()
    finally:
        release.set()
        running.stop()
