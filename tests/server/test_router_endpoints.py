"""What vLLM's router reads from a worker (`jaxserve.server.router_routes`): the load while
requests run and wait, the server and model info, the `X-Request-Id` echo (given or made,
streaming or not, repeated by concurrent clients), and which of these routes need the key."""

import json
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import jaxserve
from jaxserve.server.state import ServerOptions, ServerState
from server_helpers import ThreadedServer, serving, wait_until
from tiny_models import SMALL_ENGINE

NAME = "tiny"
INFO_ROUTES = ("/load", "/get_load", "/get_server_info", "/get_model_info")
KEYED_ROUTES = ("/load", "/get_server_info", "/get_model_info")  # with a key, always


@pytest.fixture(scope="module")
def server(folder):
    options = ServerOptions(model=str(folder), served_model_name=[NAME, "tiny-alias"],
                            dtype="float32", engine_options=SMALL_ENGINE)
    with serving(options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def gauges(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")}


def stream_completion(url: str, request_id: str, out: list) -> None:
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 6, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                      headers={"X-Request-Id": request_id}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    ids = {json.loads(e)["id"] for e in events if e != "[DONE]"}
    out.append((response.status_code, response.headers["x-request-id"], ids, events[-1]))


def test_load_counts_running_and_waiting_requests(server):
    """The engine is held after each step: one request runs, ten more are accepted but not
    yet scheduled (counted as waiting, which the Prometheus gauge misses), then one step
    takes them into the scheduler and /load agrees with the gauges. All eleven send the same
    X-Request-Id: each gets it back and its own body id."""
    served = server.state.engine
    assert httpx.get(f"{server.url}/load").json()["server_load"] == 0
    gate, steps = threading.Semaphore(0), []

    def hold(deltas):
        steps.append(len(deltas))
        gate.acquire(timeout=30)

    served.on_step = hold
    results, threads = [], []
    try:
        def start():
            thread = threading.Thread(target=stream_completion,
                                      args=(server.url, "same-id", results))
            thread.start()
            threads.append(thread)

        start()
        wait_until(lambda: served.engine.stats().num_running == 1 and bool(steps), 30,
                   "first request not running")
        for _ in range(10):
            start()
        wait_until(lambda: served.num_in_flight == 11, 30, "requests not accepted")
        load = httpx.get(f"{server.url}/load").json()
        assert (load["server_load"], load["num_running"], load["num_waiting"]) == (11, 1, 10)
        assert load["load"] == 11
        assert load["models"] == [{"model": NAME, "running": 1, "waiting": 10, "load": 11,
                                   "max_waiting_requests": 1024, "status": "ready",
                                   "kv_cache_usage": load["models"][0]["kv_cache_usage"]}]
        assert gauges(server)["vllm:num_requests_waiting"] == 0  # not in the scheduler yet

        gate.release()  # one more step: the scheduler takes them all in
        wait_until(lambda: len(steps) == 2, 30, "second step not taken")
        stats = served.engine.stats()
        assert stats.num_running + stats.num_waiting == 11 and stats.num_waiting > 0
        seen = gauges(server)
        for route in ("/load", "/get_load"):
            load = httpx.get(f"{server.url}{route}").json()
            assert load["server_load"] == load["load"] == 11
            assert load["num_running"] == stats.num_running == seen["vllm:num_requests_running"]
            assert load["num_waiting"] == stats.num_waiting == seen["vllm:num_requests_waiting"]
    finally:
        served.on_step = None
        gate.release(100)
        for thread in threads:
            thread.join(timeout=60)
    assert len(results) == 11
    assert all(status == 200 and header == "same-id" and last == "[DONE]"
               for status, header, _, last in results)
    body_ids = [ids for *_, ids, _ in results]
    assert all(len(ids) == 1 for ids in body_ids) and len(set.union(*body_ids)) == 11
    wait_until(lambda: served.num_in_flight == 0, 30, "requests left in flight")
    assert httpx.get(f"{server.url}/get_load").json()["load"] == 0


def test_server_info_and_model_info(server, folder):
    info = httpx.get(f"{server.url}/get_server_info").json()
    # what the router parses (IGW mode): model_id a string, else model_path's last part
    assert info["model_id"] == NAME and info["model_path"] == str(folder)
    assert "priority" not in info and "cost" not in info and "worker_type" not in info
    assert info["tokenizer_path"] == str(folder) and info["is_generation"] is True
    assert info["served_model_names"] == [NAME, "tiny-alias", f"{NAME}@1"]
    assert info["max_model_len"] == info["context_length"] == SMALL_ENGINE["max_model_len"]
    engine = info["engine"]
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size",
                "num_pages", "num_decode_steps"):
        assert engine[key] == SMALL_ENGINE[key], key
    assert engine["tensor_parallel_size"] == engine["data_parallel_size"] == 1
    assert info["max_total_num_tokens"] == (SMALL_ENGINE["num_pages"] - 1) * 16
    assert info["max_running_requests"] == SMALL_ENGINE["max_num_seqs"]
    assert info["version"] == jaxserve.__version__ and info["jax_version"]
    assert info["model_type"] == "llama" and info["dtype"] == "float32"
    assert [m["served_model_name"] for m in info["models"]] == [NAME]

    model = httpx.get(f"{server.url}/get_model_info").json()
    assert {k: v for k, v in info.items() if k in model} == model
    assert model["aliases"] == ["tiny-alias"] and model["status"] == "ready"
    for wanted in ("tiny-alias", f"{NAME}@1"):
        assert httpx.get(f"{server.url}/get_model_info",
                         params={"model": wanted}).json() == model
    missing = httpx.get(f"{server.url}/get_model_info", params={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_request_id_is_echoed_or_made(server, client):
    raw = client.completions.with_raw_response.create(
        model=NAME, prompt="The fox", max_tokens=2, extra_headers={"X-Request-Id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42"
    assert raw.parse().id.startswith("cmpl-")
    made = client.completions.with_raw_response.create(model=NAME, prompt="The fox",
                                                       max_tokens=2)
    assert made.headers["x-request-id"] == made.parse().id  # the body id, when none given
    chat = client.chat.completions.with_raw_response.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.headers["x-request-id"] == chat.parse().id
    assert chat.parse().id.startswith("chatcmpl-")

    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}
    for given in ("stream-7", None):
        headers = {"X-Request-Id": given} if given else {}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          headers=headers, timeout=60) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        assert response.headers["x-request-id"] == (given or chunks[0]["id"])

    # errors and other routes carry one too; an unusable id is replaced by a made one
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": ""},
                     headers={"X-Request-Id": "err-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "err-1"
    for unusable in ("has space", "x" * 257):
        response = httpx.get(f"{server.url}/health", headers={"X-Request-Id": unusable})
        assert response.headers["x-request-id"].startswith("req-")
    # the router's other id headers, in its order of preference (x-request-id first)
    assert httpx.get(f"{server.url}/health", headers={"X-Correlation-Id": "corr-7"}).headers[
        "x-request-id"] == "corr-7"
    both = {"Request-Id": "plain-1", "X-Trace-Id": "trace-9"}
    assert httpx.get(f"{server.url}/health", headers=both).headers["x-request-id"] == "trace-9"
    ids = {httpx.get(f"{server.url}/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3


def test_info_routes_need_the_key_and_get_load_follows_the_metrics_policy(server):
    state, key = server.state, "router-key"
    state.api_key = key
    try:
        for path in ("/get_load", "/metrics", "/health"):  # the router's polls carry no key
            assert httpx.get(f"{server.url}{path}").status_code == 200, path
        for path in KEYED_ROUTES + ("/v1/models",):  # they show paths and settings
            assert httpx.get(f"{server.url}{path}").status_code == 401, path
        state.metrics_need_api_key = True
        for path in INFO_ROUTES + ("/metrics",):
            denied = httpx.get(f"{server.url}{path}")
            assert denied.status_code == 401, path
            assert denied.json()["error"]["type"] == "authentication_error"
            allowed = httpx.get(f"{server.url}{path}",
                                headers={"Authorization": f"Bearer {key}"})
            assert allowed.status_code == 200, path
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes never need it
    finally:
        state.api_key, state.metrics_need_api_key = None, False


def test_info_routes_are_503_until_the_models_are_ready(folder):
    release = threading.Event()

    def never_loads(entry):
        release.wait(30)
        raise RuntimeError("test: no model")

    running = ThreadedServer(ServerState(ServerOptions(model=str(folder)), never_loads)).start()
    try:
        for path in INFO_ROUTES + ("/health",):
            response = httpx.get(f"{running.url}{path}", headers={"X-Request-Id": "early"})
            assert response.status_code == 503, path
            assert response.json()["error"]["type"] == "service_unavailable"
            assert response.headers["x-request-id"] == "early"
    finally:
        release.set()
        running.stop()
