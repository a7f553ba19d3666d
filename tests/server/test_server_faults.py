"""Engine faults seen over HTTP: a failed step answers its requests with a 500 in OpenAI's
error shape (an error event in a stream) while the server goes on serving; an engine that
gives up turns `/health` to 500 so that a supervisor restarts the process."""

import json
import threading

import httpx
import pytest

from jaxserve.engine.step_results import MAX_CONSECUTIVE_FAILURES
from jaxserve.server.state import ServerOptions
from server_helpers import serving, wait_until
from tiny_models import SMALL_ENGINE

BODY = {"prompt": [0, 5, 6], "max_tokens": 4, "ignore_eos": True}


@pytest.fixture
def server(folder):
    options = ServerOptions(model=str(folder), dtype="float32",
                            engine_options=SMALL_ENGINE)
    with serving(options) as running:
        yield running


def fail_next_launches(server, monkeypatch, count: int) -> None:
    runner = server.state.llm.engine.runner
    left = [count]
    for name in ("launch_step", "launch_decode"):
        launch = getattr(runner, name)

        def maybe_failing(*args, launch=launch):
            if left[0] > 0:
                left[0] -= 1
                raise RuntimeError("injected fault")
            return launch(*args)
        monkeypatch.setattr(runner, name, maybe_failing)


def test_a_failed_step_is_a_500_and_the_server_goes_on(server, monkeypatch):
    fail_next_launches(server, monkeypatch, 1)
    failed = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    fail_next_launches(server, monkeypatch, 1)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**BODY, "stream": True},
                      timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["error"]["type"] == "server_error" and events[-1] == "[DONE]"
    # the request id, not the raw error, for the client (the log has the error)
    assert response.headers["x-request-id"] in json.loads(events[0])["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{server.url}/health").status_code == 200
    engine = server.state.llm.engine
    wait_until(lambda: engine.stats().kv_cache_usage == 0.0, 30, "pages not freed")
    assert server.state.engine.num_in_flight == 0


def test_an_engine_that_gives_up_fails_health(server, monkeypatch):
    fail_next_launches(server, monkeypatch, 10**6)
    for _ in range(MAX_CONSECUTIVE_FAILURES):
        response = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
        assert response.status_code == 500
    wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 500, 30,
               "health still passes after the engine gave up")
    assert "engine failed" in httpx.get(f"{server.url}/health").json()["error"]["message"]


def test_a_fault_in_delivery_kills_the_engine_and_fails_health(server, monkeypatch, caplog):
    """Handing out a step's deltas is the engine thread's too: if it raises, no request would
    be answered again, so the engine is dead: its requests fail, `/health` answers 500 and
    the server is asked to exit (`on_fatal`; `jaxserve serve` then exits 1)."""
    exits = []
    server.state.on_fatal = lambda: exits.append(True)

    def broken(deltas):
        raise RuntimeError("injected delivery fault")
    monkeypatch.setattr(server.state.engine, "_deliver", broken)
    answer = {}
    sender = threading.Thread(target=lambda: answer.setdefault("response", httpx.post(
        f"{server.url}/v1/completions", json=BODY, timeout=60)), daemon=True)
    sender.start()
    wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 500, 30,
               "/health still passes after the engine thread failed")
    sender.join(timeout=30)
    failed = answer["response"]
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert "injected delivery fault" in server.state.fatal_error and exits == [True]
    assert "injected delivery fault" in caplog.text  # the reason, with its traceback, logged
